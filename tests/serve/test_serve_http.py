"""The HTTP API through the official `openai` client against a real uvicorn server on loopback."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

MODEL = "default"
PROMPT = "The history of the city"


def hf_greedy(deployment, prompt: str, n: int) -> str:
    """The HF model's own greedy continuation (no policy), stopped at EOS: what exact execution must give."""
    tok, model = deployment.tokenizer, deployment.adapter.model
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tok.decode(out, skip_special_tokens=True)


def metrics(server) -> dict:
    """{(name, labels tuple): value} of every sample the server exposes."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_exact_greedy_equals_the_hf_model(client, deployment):
    expected = hf_greedy(deployment, PROMPT, 12)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"edgemoe": {"exact": True}})
    assert r.choices[0].text == expected
    stats = r.model_extra["edgemoe"]
    slots = stats["expert_slots"]
    assert slots["substituted"] == slots["dropped"] == slots["zeroed"] == 0 and stats["budget_spent"] == 0
    # every pass decides every row's K slots at each of the L layers: prompt rows + one row per later token
    ctx = deployment.ctx
    rows = r.usage.prompt_tokens + r.usage.completion_tokens - 1
    assert sum(slots.values()) == rows * ctx.num_layers * ctx.top_k
    assert stats["policy"] == "exact" and stats["home"] == ctx.node_names[int(ctx.user_home[0])]


def test_completion_options_and_counts(client, deployment):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=9, seed=3, top_p=0.9,
                                  logprobs=2, extra_body={"top_k": 40, "edgemoe": {"user": "u-a100-b-1"}})
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 9 and (ch.finish_reason == "stop" or r.usage.completion_tokens == 9)
    assert len(ch.logprobs.tokens) == len(ch.logprobs.token_logprobs) == len(ch.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)
    assert all(len(top) == 2 for top in ch.logprobs.top_logprobs)
    stats = r.model_extra["edgemoe"]
    assert stats["user"] == "u-a100-b-1" and stats["home"] == "a100-b" and stats["policy"] == "ordermoe"
    assert stats["seed"] == 3 and stats["budget_spent"] <= stats["budget_granted"] + 1e-9
    assert stats["measured"]["ttft_ms"] > 0 and stats["remote_bytes"] >= 0


def test_token_id_prompt_and_budget_zero(client, deployment):
    ids = deployment.tokenizer(PROMPT)["input_ids"]
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, seed=5)
    b = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=5)
    assert a.choices[0].text == b.choices[0].text  # ids or the text they tokenize to: the same request
    z = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"edgemoe": {"budget": 0}})
    s = z.model_extra["edgemoe"]["expert_slots"]
    assert s["substituted"] == s["dropped"] == s["zeroed"] == 0  # no budget: OrderMoE may not stand in


def test_same_seed_same_text(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string_cuts_the_text(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, seed=7, extra_body={"edgemoe": {"exact": True}})
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[:full.find(stop)] and cut.finish_reason == "stop"


def test_streaming_matches_the_whole_response(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=14, seed=11)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["edgemoe"]["expert_slots"] == whole.model_extra["edgemoe"]["expert_slots"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id


def test_chat_completion_and_stream(client):
    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Tell me of the sea."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, seed=2, logprobs=True, top_logprobs=1)
    msg = r.choices[0].message
    assert msg.role == "assistant" and "\nUser:" not in msg.content and r.id.startswith("chatcmpl-")
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens or r.choices[0].finish_reason == "stop"
    parts = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, seed=2, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == msg.content


def test_concurrent_streams_each_get_their_own_text(client):
    """Eight streams at once (batched by the engine) give the texts each gives alone."""
    seeds = list(range(100, 108))
    alone = {s: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=s).choices[0].text
             for s in seeds}
    got, errors = {}, []
    barrier = threading.Barrier(len(seeds))

    def run(s):
        try:
            barrier.wait()
            stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, seed=s, stream=True)
            got[s] = "".join(c.choices[0].text for c in stream if c.choices)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert got == alone


def test_request_ids_are_unique(client):
    ids = {client.completions.create(model=MODEL, prompt="a", max_tokens=1).id for _ in range(5)}
    assert len(ids) == 5


def test_models_and_health(client, server):
    (m,) = client.models.list().data
    assert m.id == MODEL and m.model_extra["edgemoe"]["cluster"] == "edge8"
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"


def test_metrics_count_what_was_served(client, server):
    before = metrics(server)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, seed=9)
    after = metrics(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("edgemoe_generation_tokens_total") == r.usage.completion_tokens
    assert delta("edgemoe_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("edgemoe_requests_total", endpoint="/v1/completions", status="200") == 1
    slots = r.model_extra["edgemoe"]["expert_slots"]
    for kind, n in slots.items():
        assert delta("edgemoe_expert_slots_total", policy="ordermoe", kind=kind) == n
    assert delta("edgemoe_time_to_first_token_seconds_count") == 1
    assert after[("edgemoe_running_sequences", ())] == 0


def test_explain_says_where_each_slot_ran(client, deployment):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, seed=4,
                                  extra_body={"edgemoe": {"explain": True}})
    explain = r.model_extra["edgemoe"]["explain"]
    ctx = deployment.ctx
    assert len(explain) == r.usage.completion_tokens
    for tok in explain:
        assert len(tok["layers"]) == ctx.num_layers and all(len(layer) == ctx.top_k for layer in tok["layers"])
        for layer in tok["layers"]:
            for s in layer:
                assert s["kind"] in ("local", "remote", "substituted", "dropped", "zeroed")
                assert (s["ran"] is None) == (s["kind"] in ("dropped", "zeroed"))
                assert (s["kind"] == "local") == (s["node"] == s["at"] and s["ran"] == s["routed"])


# ---- bad requests: every one gets its status code ------------------------------------------------------------
def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="a", max_tokens=1)
    assert "nope" in err.value.message


def test_token_outside_the_vocabulary_is_400(client, deployment):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[5, 99999], max_tokens=1)
    assert "99999" in err.value.message and str(deployment.vocab_size) in err.value.message


def test_prompt_plus_max_tokens_over_the_context_is_400(client, deployment):
    ids = deployment.tokenizer(PROMPT)["input_ids"]
    ctx_len = deployment.context_length
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=ctx_len - len(ids) + 1)
    msg = err.value.message
    assert f"{len(ids)} tokens" in msg and f"max_tokens {ctx_len - len(ids) + 1}" in msg and str(ctx_len) in msg


@pytest.mark.parametrize("kw,field", [
    ({"temperature": 3.0}, "temperature"), ({"n": 2}, "n"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"extra_body": {"edgemoe": {"user": "nobody"}}}, "edgemoe.user"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"extra_body": {"edgemoe": {"budget": -1}}}, "budget"), ({"extra_body": {"bogus": 1}}, "bogus"),
    ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"echo": True}, "echo"),
    # stream_options was an untyped dict: "include_usage": "no" sent a usage chunk, and without stream it was ignored
    ({"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_fields_are_400_naming_the_field(client, kw, field):
    args = {"model": MODEL, "prompt": "a", "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert field in err.value.message
    assert err.value.body["type"] == "invalid_request_error"


def test_raw_http_errors(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("raw,field,words", [
    # JSON may spell a lone surrogate, which no tokenizer (nor UTF-8) can encode
    (b'{"model": "default", "prompt": "ab\\udcff", "max_tokens": 2}', "prompt", "surrogate"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content", "surrogate"),
    # nested past Python's recursion limit: no request of this API is
    (b'{"model": "default", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
    # an integer past Python's int_max_str_digits (4300): json.loads raised a bare ValueError (a 500)
    (b'{"model": "default", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", None, "digits"),
])
def test_hostile_json_is_400_not_500(server, raw, field, words):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field
    assert words in err["message"]


@pytest.mark.parametrize("field,literal", [("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "-Infinity")])
def test_nan_and_infinity_are_400_saying_a_finite_number_is_expected(server, field, literal):
    """Python's json reads NaN and Infinity (not JSON): the range checks said "less than or equal to 2" for NaN."""
    raw = b'{"model": "default", "prompt": "a", "max_tokens": 1, "%s": %s}' % (field.encode(), literal.encode())
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "finite number" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,field,kinds", [
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "str, list[int], list[str], list[list[int]]"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, "stop", "str, list[str]"),
    ("/v1/completions", {"prompt": "a", "edgemoe": {"user": []}}, "edgemoe.user", "str, int"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "str, list[object]"),
])
def test_a_union_field_of_the_wrong_type_is_named_with_the_types_it_takes(server, path, body, field, kinds):
    """pydantic's loc holds the union member it tried first: the param was "prompt.str" (no such field) and the
    message said a string was expected where token ids are fine too."""
    r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 1, **body})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and err["message"] == f"{field}: expected one of {kinds}"


def test_chat_parts_other_than_text_are_400_naming_the_part(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert "messages.0.content.1" in err.value.message and "image_url" in err.value.message
    # text parts alone are served, joined
    out = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "The history "}, {"type": "text", "text": "of"}]}])
    same = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                          messages=[{"role": "user", "content": "The history of"}])
    assert out.choices[0].message.content == same.choices[0].message.content


def test_top_logprobs_without_logprobs_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=2, top_logprobs=3,
                                       messages=[{"role": "user", "content": "hi"}])
    assert "top_logprobs" in err.value.message


def test_a_tiny_temperature_samples_the_greedy_token(client):
    """1e-300 is inside [0, 2]: the scaled logits must not overflow to nan (they did: a 500)."""
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    tiny = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1e-300, seed=3)
    assert tiny.choices[0].text == greedy.choices[0].text


def test_api_key_and_body_limit(service):
    """A second app over the same engine, with an API key and a small body limit."""
    from edgemoe.serve.api import Limits, create_app
    from edgemoe.serve.service import ServerThread

    app = create_app(service.engine, MODEL, api_key="sekret", limits=Limits(max_body_bytes=400, max_tokens=8))
    with ServerThread(app) as s:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).completions.create(
                model=MODEL, prompt="a", max_tokens=1)
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="a", max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.BadRequestError) as err:
            good.completions.create(model=MODEL, prompt="a", max_tokens=9)
        assert "limit of 8" in err.value.message
        with pytest.raises(openai.APIStatusError) as err:
            good.completions.create(model=MODEL, prompt="word " * 200, max_tokens=1)
        assert err.value.status_code == 413
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200


def test_full_queue_is_429_and_a_stopped_engine_503(deployment):
    """An engine that has not started holds what it is given: its queue fills, then every request is refused."""
    from edgemoe.serve.api import create_app
    from edgemoe.serve.engine import Engine, GenerationRequest
    from edgemoe.serve.service import ServerThread

    engine = Engine(deployment, max_running=1, max_queue=1, start=False)
    for _ in range(2):
        engine.submit(GenerationRequest((5, 6), 1), lambda _ev: None)
    app = create_app(engine, MODEL)
    with ServerThread(app) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert int(err.value.response.headers["retry-after"]) >= 1
        engine.close()
        with pytest.raises(openai.APIStatusError) as err:
            c.completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert err.value.status_code == 503
        assert httpx.get(s.url + "/health").status_code == 503


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    """Closing a stream cancels its sequence: the engine ends it ('cancelled') and runs nothing more for it."""
    import time

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "seed": 21, "stream": True,
            "edgemoe": {"budget": 0}}
    before = metrics(server).get(("edgemoe_finished_sequences_total", (("reason", "cancelled"),)), 0.0)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
    assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health").json()["running"]:
        assert time.monotonic() < deadline, "the cancelled sequence still runs"
        time.sleep(0.1)
    after = metrics(server).get(("edgemoe_finished_sequences_total", (("reason", "cancelled"),)), 0.0)
    assert after == before + 1


def test_a_client_that_leaves_a_whole_response_frees_its_slot(server):
    """Not streamed: a client that closes its connection before the completion is done cancels its sequence (it
    ran to max_tokens before, holding its slot for a response nobody would read)."""
    import json
    import socket
    import time
    from urllib.parse import urlsplit

    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "seed": 22,
                       "edgemoe": {"budget": 0}}).encode()
    key = ("edgemoe_finished_sequences_total", (("reason", "cancelled"),))
    before = metrics(server).get(key, 0.0)
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 120
        while not httpx.get(server.url + "/health").json()["running"]:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    while httpx.get(server.url + "/health").json()["running"]:
        assert time.monotonic() < deadline, "the abandoned sequence still runs"
        time.sleep(0.1)
    assert metrics(server).get(key, 0.0) == before + 1


def test_messages_a_chat_template_refuses_are_400(service):
    """A hub chat model's template may refuse a conversation (raise_exception: roles that do not alternate, a
    system message it does not take); that is the request's fault, a 400 naming messages, not a 500."""
    import copy

    from edgemoe.serve.api import create_app
    from edgemoe.serve.service import ServerThread

    class WithTokenizer:  # the service's engine, seen with another tokenizer
        def __init__(self, engine, tokenizer):
            self._engine, self.tokenizer = engine, tokenizer

        def __getattr__(self, name):
            return getattr(self._engine, name)

    tok = copy.deepcopy(service.engine.tokenizer)
    tok.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                         "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with ServerThread(create_app(WithTokenizer(service.engine, tok), MODEL)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "system", "content": "Be brief."}])
        assert err.value.body["param"] == "messages" and "System role not supported" in err.value.message
        ok = c.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
        assert ok.usage.completion_tokens == 1
