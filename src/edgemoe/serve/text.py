"""Text in and out: incremental detokenisation with stop strings, and the plain chat template.

`TextStream` turns generated token ids into text pieces safe to send: it holds back a tail that may still
become a stop string or that ends in an incomplete UTF-8 character, and cuts the text where a stop string
begins (the stop string itself is not part of the completion, as in OpenAI's API).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete multi-byte character to


def not_unicode_at(text: str) -> int | None:
    """Index of the first character of `text` that is not a Unicode scalar value (a lone UTF-16 surrogate,
    U+D800-U+DFFF: what JSON's \\u escapes can spell and Python decodes non-UTF-8 arguments to), None when
    there is none. No tokenizer encodes such a character, nor UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


class TextStream:
    """Generated ids -> the completion's text, released piece by piece."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` released so far
        self.stopped_at: int | None = None  # where the first stop string begins (the completion ends there)

    def add(self, token: int) -> str:
        """Append a generated token; returns the newly released text ('' when held back or stopped)."""
        if self.stopped_at is not None:
            return ""
        self.ids.append(int(token))
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        begin = max(self.sent - self.holdback, 0)
        hits = [i for i in (self.text.find(s, begin) for s in self.stop) if i >= 0]
        if hits:
            self.stopped_at = min(hits)
            return self._release(self.stopped_at)
        safe = len(self.text) - self.holdback
        while safe > self.sent and self.text[safe - 1] == REPLACEMENT:
            safe -= 1
        return self._release(safe)

    def finish(self) -> str:
        """The rest of the text once generation has ended (nothing more can complete a stop string)."""
        return self._release(len(self.text) if self.stopped_at is None else self.stopped_at)

    @property
    def completion(self) -> str:
        return self.text if self.stopped_at is None else self.text[:self.stopped_at]

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece


CHAT_ROLES = ("system", "user", "assistant")
CHAT_STOP = ("\nUser:",)  # the plain template's next turn: a completion ends where the model starts one


def plain_chat_prompt(messages: list[dict]) -> str:
    """The plain chat template of the shipped models (they were trained on plain text, no chat tokens):

        System: <text>
        User: <text>
        Assistant: <text>
        ...
        Assistant:

    One line per message (content as given), then 'Assistant:' for the reply."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


def chat_prompt(tokenizer, messages: list[dict]) -> tuple[str, tuple[str, ...]]:
    """(prompt text, extra stop strings) of a chat: the tokenizer's own chat template when it has one (hub chat
    models; its end-of-turn token ends the reply as EOS or a stop string of the request), else the plain
    template with its next-turn stop."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), ()
    return plain_chat_prompt(messages), CHAT_STOP
