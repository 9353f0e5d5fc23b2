"""The HTTP front in its own process (edgemoe.serve.front): a spawned uvicorn process over the engine of this
one, driven by the openai client: the same answers as the in-thread app, streaming, stop strings, errors,
429, API key, metrics, health, a client that goes away, and an engine that stops."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgemoe.serve.engine import Engine, GenerationRequest
from edgemoe.serve.front import (
    FrontProcess,
    _encode,
    _lines,
    event_from_wire,
    event_to_wire,
    request_from_wire,
    request_to_wire,
)
from edgemoe.serve.telemetry import Telemetry


@pytest.fixture(scope="module")
def front(service):
    with FrontProcess.of(service) as f:
        yield f


@pytest.fixture(scope="module")
def remote_client(front):
    return openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_wire_round_trip():
    from edgemoe.distributed.sampling import SamplingParams
    from edgemoe.serve.engine import Delta, Failed, Finished, TokenInfo

    req = GenerationRequest((1, 2, 3), 5, SamplingParams(0.7, 0.9, 4, 11), ("\n",), 2, 1, False, 0.25, True, "cmpl-x",
                            True)
    assert request_from_wire(request_to_wire(req)) == req
    d = Delta("ab", [TokenInfo(5, -0.5, [(5, -0.5), (7, -1.25)])])
    for ev in (d, Finished("length", {"a": 1}), Failed(503, "gone")):
        assert event_from_wire(event_to_wire(3, ev, [1, 2])) == ev
    one, two = _encode({"t": "a\nb"}), _encode({"k": 2})  # a newline inside a string stays escaped
    lines, rest = _lines(b"", one + two[:3])  # a read may end inside a message
    assert lines == [one[:-1]] and _lines(rest, two[3:]) == ([two[:-1]], b"")


def test_same_answer_as_the_in_thread_app(client, remote_client):
    kw = dict(model="default", prompt="The history of", max_tokens=8, seed=5, temperature=0.8)
    here = client.completions.create(**kw)
    there = remote_client.completions.create(**kw)
    assert there.choices[0].text == here.choices[0].text
    assert there.usage.completion_tokens == here.usage.completion_tokens
    assert there.model_extra["edgemoe"]["expert_slots"] == here.model_extra["edgemoe"]["expert_slots"]
    pieces = [c.choices[0].text for c in remote_client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == here.choices[0].text


def test_stop_string_and_chat(remote_client):
    full = remote_client.completions.create(model="default", prompt="Once upon a time", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[3:6]
    cut = remote_client.completions.create(model="default", prompt="Once upon a time", max_tokens=12, temperature=0,
                                           stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    chat = remote_client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0)
    assert chat.choices[0].message.role == "assistant"


def test_errors_and_metrics(front, remote_client):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        remote_client.completions.create(model="default", prompt=[10**6], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        remote_client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert httpx.get(front.url + "/health").json()["status"] == "ok"
    # a generation of this test's own: the module's other tests may run on another xdist worker (worksteal)
    remote_client.completions.create(model="default", prompt="The", max_tokens=2, temperature=0)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(front.url + "/metrics").text)}
    statuses = {s.labels["status"] for s in fams["edgemoe_requests"].samples if s.name.endswith("_total")}
    assert {"200", "400", "404"} <= statuses  # counted in the front process
    assert fams["edgemoe_generation_tokens"].samples[0].value > 0  # from the engine process


def test_a_client_that_goes_away_cancels_its_stream(service, front):
    reg = service.engine.telemetry.registry

    def cancelled() -> float:
        return reg.get_sample_value("edgemoe_finished_sequences_total", {"reason": "cancelled"}) or 0.0

    before = cancelled()
    body = {"model": "default", "prompt": "Far away", "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", front.url + "/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1  # ended as cancelled, not after its 400 tokens


def test_api_key_busy_and_a_stopped_engine(deployment):
    engine = Engine(deployment, max_running=1, max_queue=0, telemetry=Telemetry(deployment.ctx.node_names), start=False)
    with FrontProcess(engine, deployment.spec.model, "default", api_key="k2") as f:
        url, auth = f.url + "/v1/completions", {"Authorization": "Bearer k2"}
        body = {"model": "default", "prompt": "x", "max_tokens": 2}
        assert httpx.post(url, json=body).status_code == 401
        engine.submit(GenerationRequest((1, 2), 2), lambda ev: None)  # fills it: the loop is not started
        r = httpx.post(url, json=body, headers=auth)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        engine.close()
        assert httpx.get(f.url + "/health").status_code == 503
        assert httpx.post(url, json=body, headers=auth).status_code == 503
