"""The HTTP API (FastAPI): OpenAI-style completions and chat completions over the serving engine.

    POST /v1/completions        prompt (text or token ids) -> text; `stream: true` sends server-sent events
    POST /v1/chat/completions   messages -> the assistant's reply (the plain chat template, edgemoe.serve.text)
    GET  /v1/models             the one served model
    GET  /health                200 while the engine runs, else 503
    GET  /metrics               Prometheus text format (edgemoe.serve.telemetry)

Errors are OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}` with 400 (bad request),
401 (API key), 404 (no such model or route), 413 (body too large), 429 (queue full, with Retry-After),
503 (engine stopped). edgemoe's own part of a request is the `edgemoe` object of the body (the OpenAI client
sends it with `extra_body`): `user` (name or index: whose home), `budget` (quality allowance per token-layer),
`max_ppl_increase` (quality in the field's unit, a maximum relative perplexity increase: mapped to a budget by
the server's quality dial, `edgemoe serve --dial`, edgemoe.serve.dial) or `exact: true`, `explain: true`, `allow_degraded: true` (the ray backend: a failed server may cost slots); the response carries an `edgemoe` object with the request's counts.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import re
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgemoe.distributed.sampling import SamplingParams
from edgemoe.errors import EdgeMoEError

from .engine import Busy, Closed, Delta, Failed, Finished, GenerationRequest
from .text import chat_prompt, not_unicode_at

MAX_SEED = 2**63 - 1
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_exceeded", 499: "client_closed_request",
               500: "internal_error", 503: "service_unavailable"}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for. None: the model's context length."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# ---- request bodies ---------------------------------------------------------------------------------------
class EdgeMoEOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user: str | int | None = None  # a cluster user's name or index: the request lives at its home
    budget: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None  # quality allowance per token-layer
    # quality as a maximum relative perplexity increase (0.05: +5%), mapped by the server's dial to a budget
    max_ppl_increase: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    exact: bool = False
    explain: bool = False
    allow_degraded: bool = False  # accept slots that a failed server drops (else exact execution fails with 503)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the usage (choices empty)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # allow_inf_nan=False: Python's json reads NaN and Infinity, which the range checks misname ("<= 2" for NaN)
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1: no top-k cut (vLLM's -1 accepted)
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None  # only with stream: true
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None  # OpenAI's end-user tag: kept for logs only (edgemoe.user picks the home)
    edgemoe: EdgeMoEOptions | None = None


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict]
    name: str | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None


def message_text(content: str | list[dict], where: str) -> str:
    """A chat message's text: the string, or its content parts' texts joined. Only text parts are served (the
    model reads text alone); any other part is a 400 naming it, rather than a reply that silently ignored it."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            got = f"type {kind!r}" if kind != "text" else "a text part without a string 'text'"
            raise ApiError(400, f"{where}.{j}: only text content parts are supported, got {got}",
                           param=f"{where}.{j}")
        texts.append(part["text"])
    return "".join(texts)


def lone_surrogate(doc) -> str | None:
    """The dotted path of the first string in a decoded JSON document (keys included) holding a lone UTF-16
    surrogate (code points U+D800-U+DFFF, which JSON's \\u escapes can spell and UTF-8 cannot), "" for the
    document itself, None when there is none (`not_unicode_at` per string: valid text costs one pass)."""
    stack = [(doc, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not_unicode_at(item) is not None:
                return where
        elif isinstance(item, dict):
            for key, value in reversed(list(item.items())):
                name = f"{where}.{key}" if where else str(key)
                if not_unicode_at(key) is not None:
                    return where
                stack.append((value, name))
        elif isinstance(item, list):
            stack.extend((value, f"{where}.{i}" if where else str(i)) for i, value in reversed(list(enumerate(item))))
    return None


GONE = object()  # put on a request's event queue when its client has closed the connection


async def client_gone(request: Request, queue: asyncio.Queue) -> None:
    """Put GONE on `queue` once the client has closed its connection. The body has been read, so the next ASGI
    message is the disconnect (uvicorn sends it when the connection is lost or after the response)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(GONE)


# pydantic names the member of a union field (prompt, stop, content, edgemoe.user) after the field in an error's loc
UNION_MEMBER = re.compile(r"(str|int|float|bool|(list|dict)\[.*\])")


def _validation_message(exc: ValidationError) -> tuple[str, str]:
    """(message, param) of a body pydantic refused: its first error. A union field's errors are one per member
    type: the field is named, with the types it takes (its loc held a member's name, e.g. "prompt.str")."""
    errors = exc.errors()
    loc = list(errors[0]["loc"])
    at = next((i for i, x in enumerate(loc) if isinstance(x, str) and UNION_MEMBER.fullmatch(x)), None)
    if at is not None:
        field = loc[:at]
        members = list(dict.fromkeys(e["loc"][at] for e in errors if list(e["loc"][:at]) == field
                                     and len(e["loc"]) > at))
        name = ".".join(str(x) for x in field)
        kinds = ", ".join(m.replace("dict[any,any]", "object") for m in members)
        return f"{name}: expected one of {kinds}", name
    name = ".".join(str(x) for x in loc)
    return f"{name}: {errors[0]['msg']}" if name else errors[0]["msg"], name


# ---- the app ------------------------------------------------------------------------------------------------
def create_app(engine, model_name: str, api_key: str | None = None, limits: Limits = Limits(),
               default_user: int = 0, dial=None) -> FastAPI:
    """The FastAPI app serving `engine` (edgemoe.serve.engine.Engine) as model `model_name`; dial: the
    deployment's QualityDial (edgemoe.eval.dial), which maps a request's `max_ppl_increase` to its budget."""
    app = FastAPI(title="edgemoe", docs_url=None, redoc_url=None, openapi_url=None)
    tele = engine.telemetry
    dep = engine.dep
    context = dep.context_length
    max_prompt = min(limits.max_prompt_tokens or context, context)
    max_new = min(limits.max_tokens or context, context)
    created = int(time.time())
    tokenizer = engine.tokenizer

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request, exc: StarletteHTTPException):
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        return error_response(exc.status_code, message)

    if tele is not None:
        app.add_middleware(CountRequests, telemetry=tele)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), api_key.encode())):
            raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes is over the limit of {limits.max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limits.max_body_bytes:
                raise ApiError(413, f"request body is over the limit of {limits.max_body_bytes} bytes")
        try:
            doc = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON ({exc})") from None
        except RecursionError:  # arrays or objects nested thousands deep: no request of this API is
            raise ApiError(400, "the body is not valid JSON for this API (nested too deeply)") from None
        except ValueError:  # an integer literal past Python's int_max_str_digits: no field of this API takes one
            raise ApiError(400, f"the body is not valid JSON for this API (an integer of more than "
                           f"{sys.get_int_max_str_digits()} digits)") from None
        where = lone_surrogate(doc)
        if where is not None:  # JSON's \ud800-\udfff escapes decode to code points no tokenizer can encode
            raise ApiError(400, f"{where or 'the body'}: a lone UTF-16 surrogate escape is not a Unicode character",
                           param=where or None)
        return doc

    def parse(cls, data):
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            message, loc = _validation_message(exc)
            raise ApiError(400, message, param=loc or None) from None

    def check_common(body: _Sampling) -> None:
        if body.model != model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise ApiError(400, f"n={body.n}: only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise ApiError(400, f"{name} is not supported (give 0 or leave it out)", param=name)
        if body.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if engine.failure or not engine.alive:
            raise ApiError(503, engine.failure or "the engine is not running")

    def stops(body: _Sampling) -> tuple[str, ...]:
        s = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(s) > 4:
            raise ApiError(400, f"stop: at most 4 stop strings, got {len(s)}", param="stop")
        return tuple(x for x in s if x)

    def user_of(opts: EdgeMoEOptions | None) -> int:
        ctx = engine.ctx
        if opts is None or opts.user is None:
            return default_user
        if isinstance(opts.user, int):
            if not 0 <= opts.user < ctx.num_users:
                raise ApiError(400, f"edgemoe.user {opts.user}: expected an index in [0, {ctx.num_users}) or a user name",
                               param="edgemoe.user")
            return opts.user
        if opts.user not in ctx.user_names:
            shown = ", ".join(ctx.user_names[:8]) + (", ..." if ctx.num_users > 8 else "")
            raise ApiError(400, f"edgemoe.user {opts.user!r} is not a user of cluster {ctx.cluster_name!r} "
                           f"(users: {shown})", param="edgemoe.user")
        return ctx.user_names.index(opts.user)

    def check_prompt(ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise ApiError(400, "the prompt is empty (it must hold at least one token)", param="prompt")
        vocab = dep.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt token id {ids[bad]} at position {bad} is outside the vocabulary [0, {vocab})",
                           param="prompt")
        if len(ids) > max_prompt:
            raise ApiError(400, f"the prompt has {len(ids)} tokens, over this server's limit of {max_prompt}",
                           param="prompt")
        if max_tokens > max_new:
            raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of {max_new}", param="max_tokens")
        if len(ids) + max_tokens > context:
            raise ApiError(400, f"the prompt's {len(ids)} tokens plus max_tokens {max_tokens} make {len(ids) + max_tokens}, "
                           f"over the model's context of {context} tokens", param="max_tokens")

    def generation(body: _Sampling, ids: list[int], max_tokens: int, logprobs: int | None, extra_stop=(),
                   prefix: str = "cmpl") -> GenerationRequest:
        opts = body.edgemoe
        if opts is not None and opts.exact and opts.budget is not None:
            raise ApiError(400, "edgemoe: give a budget or exact: true, not both", param="edgemoe.budget")
        budget = None if opts is None else opts.budget
        mix = None  # (high, share) of a max_ppl_increase request's budget mixture
        if opts is not None and opts.max_ppl_increase is not None:
            if opts.exact or opts.budget is not None:
                raise ApiError(400, "edgemoe: give one of max_ppl_increase, budget or exact: true",
                               param="edgemoe.max_ppl_increase")
            if dial is None:
                raise ApiError(400, "edgemoe.max_ppl_increase: this server has no quality dial (start it with "
                               "`edgemoe serve --dial FILE`, the file made by `edgemoe dial`)",
                               param="edgemoe.max_ppl_increase")
            budget, high, share = dial.mix(opts.max_ppl_increase)
            mix = (high, share)
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        try:
            sampling = SamplingParams(body.temperature, body.top_p, max(body.top_k, 0), seed)
        except EdgeMoEError as exc:
            raise ApiError(400, str(exc)) from None
        return GenerationRequest(tuple(ids), max_tokens, sampling, stops(body) + tuple(extra_stop), logprobs,
                                 user_of(opts), bool(opts and opts.exact), budget,
                                 bool(opts and opts.explain), engine.new_request_id(prefix),
                                 bool(opts and opts.allow_degraded), mix)

    remote = getattr(engine, "remote", False)  # the engine runs in another process (edgemoe.serve.front)

    async def submit(req: GenerationRequest):
        queue: asyncio.Queue = asyncio.Queue()
        try:
            if remote:  # its events are read in this event loop: straight into the queue
                seq = await engine.submit_async(req, queue.put_nowait)
            else:  # the engine thread's events hop into the loop
                loop = asyncio.get_running_loop()
                seq = engine.submit(req, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event))
        except Busy as exc:
            if tele is not None:
                tele.rejected.inc()
            raise ApiError(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
        except Closed as exc:
            raise ApiError(503, str(exc)) from None
        except EdgeMoEError as exc:  # a request the engine refuses: a 400 naming the field
            raise ApiError(400, str(exc), param=str(exc).split(":")[0]) from None
        return seq, queue

    async def collect(seq, queue, request: Request) -> tuple[str, list, Finished]:
        """Wait for the whole completion: (text, token infos, the Finished event). A client that closes its
        connection meanwhile cancels the sequence (its slot is free at the engine's next step; nobody reads it)."""
        text, infos = [], []
        watch = asyncio.ensure_future(client_gone(request, queue))
        try:
            while True:
                ev = await queue.get()
                if ev is GONE:
                    raise ApiError(499, "the client closed the connection before the completion was done")
                if isinstance(ev, Delta):
                    text.append(ev.text)
                    infos.extend(ev.tokens)
                elif isinstance(ev, Finished):
                    return "".join(text), infos, ev
                elif isinstance(ev, Failed):
                    raise ApiError(ev.status, ev.message)
        finally:
            watch.cancel()
            if not seq.done:
                seq.cancelled = True

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(t: int) -> str:  # a token's text never changes: decode each id once (logprobs ask per token)
        return tokenizer.decode([t])

    def completion_logprobs(infos, offset0: int = 0) -> dict:
        tokens = [token_text(i.token) for i in infos]
        offsets, at = [], offset0
        for s in tokens:
            offsets.append(at)
            at += len(s)
        return {"tokens": tokens, "token_logprobs": [i.logprob for i in infos],
                "top_logprobs": [{token_text(t): lp for t, lp in i.top} for i in infos], "text_offset": offsets}

    def chat_logprobs(infos) -> dict:
        def entry(t, lp):
            s = token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {"content": [dict(entry(i.token, i.logprob), top_logprobs=[entry(t, lp) for t, lp in i.top])
                            for i in infos]}

    def usage(req: GenerationRequest, completion_tokens: int) -> dict:
        p = len(req.prompt_ids)
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_response(seq, queue, chunk_of, final_of, chunk_object: str, include_usage: bool) -> StreamingResponse:
        """Server-sent events: chunk_of(delta) per piece, final_of(finished) at the end, a usage chunk when asked,
        then [DONE]. chunk_object: the chunks' `object` name."""

        async def events():
            count = 0
            try:
                while True:
                    ev = await queue.get()
                    if isinstance(ev, Delta):
                        count += len(ev.tokens)
                        if ev.text or ev.tokens:
                            yield sse(chunk_of(ev))
                    elif isinstance(ev, Finished):
                        yield sse(final_of(ev))
                        if include_usage:
                            yield sse({"id": seq.req.request_id, "object": chunk_object, "created": created,
                                       "model": model_name, "choices": [],
                                       "usage": usage(seq.req, len(seq.generated))})
                        break
                    elif isinstance(ev, Failed):
                        yield sse({"error": {"message": ev.message, "type": ERROR_TYPES.get(ev.status, "error"),
                                             "param": None, "code": ev.status}})
                        break
                yield "data: [DONE]\n\n"
            finally:
                if not seq.done:
                    seq.cancelled = True

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": seq.req.request_id})

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        body: CompletionBody = parse(CompletionBody, await read_json(request))
        check_common(body)
        if body.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if body.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported (only 1)", param="best_of")
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request (got {len(prompt)})", param="prompt")
            prompt = prompt[0]
        ids = list(prompt) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        check_prompt(ids, max_tokens)
        req = generation(body, ids, max_tokens, body.logprobs)
        seq, queue = await submit(req)
        base = {"id": req.request_id, "object": "text_completion", "created": created, "model": model_name}
        if body.stream:
            def chunk(ev: Delta):
                lp = completion_logprobs(ev.tokens) if req.logprobs is not None else None
                return dict(base, choices=[{"text": ev.text, "index": 0, "logprobs": lp, "finish_reason": None}])

            def final(ev: Finished):
                return dict(base, choices=[{"text": "", "index": 0, "logprobs": None, "finish_reason": ev.reason}],
                            edgemoe=ev.stats)

            return stream_response(seq, queue, chunk, final, "text_completion",
                                   bool(body.stream_options and body.stream_options.include_usage))
        text, infos, fin = await collect(seq, queue, request)
        lp = completion_logprobs(infos) if req.logprobs is not None else None
        return JSONResponse(dict(base, choices=[{"text": text, "index": 0, "logprobs": lp, "finish_reason": fin.reason}],
                                 usage=usage(req, len(seq.generated)), edgemoe=fin.stats),
                            headers={"X-Request-Id": req.request_id})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        body: ChatBody = parse(ChatBody, await read_json(request))
        check_common(body)
        if not body.messages:
            raise ApiError(400, "messages: at least one message is required", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        messages = []
        for i, m in enumerate(body.messages):
            messages.append({"role": "system" if m.role == "developer" else m.role,
                             "content": message_text(m.content, f"messages.{i}.content")})
        try:
            text, chat_stop = chat_prompt(tokenizer, messages)
        except jinja2.TemplateSyntaxError:  # the model's own template is broken: not the request's fault
            raise
        except jinja2.TemplateError as exc:  # a hub chat template's raise_exception (roles, system messages)
            raise ApiError(400, f"messages: the model's chat template refused them ({exc})", param="messages") from None
        ids = tokenizer(text, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked if asked is not None else max(1, min(max_new, context - len(ids)))
        check_prompt(ids, max_tokens)
        top = (body.top_logprobs or 0) if body.logprobs else None
        req = generation(body, ids, max_tokens, top, chat_stop, prefix="chatcmpl")
        seq, queue = await submit(req)
        base = {"id": req.request_id, "object": "chat.completion", "created": created, "model": model_name}
        if body.stream:
            chunk_base = dict(base, object="chat.completion.chunk")
            first = [True]

            def chunk(ev: Delta):
                delta = {"content": ev.text}
                if first[0]:
                    delta["role"], first[0] = "assistant", False
                lp = chat_logprobs(ev.tokens) if req.logprobs is not None else None
                return dict(chunk_base, choices=[{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None}])

            def final(ev: Finished):
                delta = {"role": "assistant"} if first[0] else {}
                return dict(chunk_base, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": ev.reason}],
                            edgemoe=ev.stats)

            return stream_response(seq, queue, chunk, final, "chat.completion.chunk",
                                   bool(body.stream_options and body.stream_options.include_usage))
        text, infos, fin = await collect(seq, queue, request)
        lp = chat_logprobs(infos) if req.logprobs is not None else None
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                  "finish_reason": fin.reason}
        return JSONResponse(dict(base, choices=[choice], usage=usage(req, len(seq.generated)), edgemoe=fin.stats),
                            headers={"X-Request-Id": req.request_id})

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        ctx = engine.ctx
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "edgemoe", "max_model_len": context,
            "edgemoe": {"cluster": ctx.cluster_name, "placement": ctx.placement_method, "policy": engine.policy_name,
                        "mode": ctx.mode, "users": list(ctx.user_names), "nodes": list(ctx.node_names)}}]}

    @app.get("/health")
    async def health():
        if remote:
            await engine.refresh()
        if engine.failure or not engine.alive:
            return error_response(503, engine.failure or "the engine is not running")
        return {"status": "ok", **engine.load()}

    @app.get("/metrics")
    async def metrics(request: Request):
        check_key(request)
        from prometheus_client import CONTENT_TYPE_LATEST

        if tele is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        text = tele.render(await engine.metrics_text()) if remote else tele.render()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


KNOWN_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class CountRequests:
    """ASGI middleware: counts each response by route and status code (Telemetry.request) when it starts.

    A plain ASGI wrapper, not Starlette's `BaseHTTPMiddleware`: that one relays every chunk of a streamed
    response through a memory stream between two tasks, which costs event-loop work per token, and on a host
    where the engine thread holds the GIL most of the time (a policy deciding in Python) that work delays the
    engine."""

    def __init__(self, app, telemetry):
        self.app, self.telemetry = app, telemetry

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in KNOWN_ROUTES else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.telemetry.request(route, int(message["status"]))
            await send(message)

        return await self.app(scope, receive, counting_send)
