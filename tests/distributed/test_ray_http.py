"""The Ray deployment behind the HTTP app (edgemoe.serve.ray_engine), driven by the openai client against a
real uvicorn server on loopback: greedy text equal to the home's own generation, token streaming, seeded
sampling that does not depend on what a stream is batched with, stop strings, metrics, exact requests and
logprobs (per-request budgets and explain: test_ray_request_policy.py)."""

import threading

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def served(lab3_deployment, tiny_path):
    from edgemoe.models import load_tokenizer
    from edgemoe.serve.api import create_app
    from edgemoe.serve.ray_engine import RayEngine
    from edgemoe.serve.service import ServerThread
    from edgemoe.serve.telemetry import Telemetry

    tok = load_tokenizer(str(tiny_path))
    engine = RayEngine(lab3_deployment, tok, telemetry=Telemetry(lab3_deployment.cfg.ctx.node_names))
    try:
        with ServerThread(create_app(engine, "tiny")) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
            yield c, s, tok, engine
    finally:
        engine.close()


def metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def ask(c, **kw):
    kw.setdefault("extra_body", {"edgemoe": {"user": "u1"}})
    return c.completions.create(model="tiny", prompt=PROMPT, **kw)


def test_greedy_text_streaming_and_metrics(served, lab3_deployment):
    from edgemoe.distributed.serve import Client

    c, s, tok, _ = served
    direct = Client(lab3_deployment).generate(1, np.array(PROMPT), 6).tokens.tolist()
    before = metrics(s)
    r = ask(c, max_tokens=6, temperature=0)
    eos = tok.eos_token_id
    cut = direct[:direct.index(eos)] if eos in direct else direct
    assert r.choices[0].text == tok.decode(cut, skip_special_tokens=True)
    stats = r.model_extra["edgemoe"]
    assert stats["backend"] == "ray" and stats["home"] == "b" and stats["failovers"] == 0
    slots = stats["expert_slots"]
    assert slots["slots"] == sum(slots[k] for k in ("local", "remote", "substituted", "dropped", "zeroed")) > 0
    assert sum(stats["node_slots"].values()) == slots["slots"] - slots["dropped"] - slots["zeroed"]
    after = metrics(s)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("edgemoe_generation_tokens_total") == r.usage.completion_tokens
    for node, n in stats["node_slots"].items():
        assert delta("edgemoe_node_expert_slots_total", node=node) == n
    assert delta("edgemoe_failovers_total") == 0 and ("edgemoe_failovers_total", ()) in after
    # streaming: the text comes in pieces, as the home makes the tokens, and adds up to the whole response
    chunks = [ch for ch in ask(c, max_tokens=6, temperature=0, stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert sum(1 for ch in chunks if ch.choices[0].text) >= 2
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_seeded_sampling_alone_and_batched_and_stop_strings(served, lab3_deployment):
    c, s, tok, _ = served
    seeds = [11, 12, 13, 14]
    alone = {sd: ask(c, max_tokens=8, temperature=1.0, top_p=0.95, seed=sd).choices[0].text for sd in seeds}
    assert ask(c, max_tokens=8, temperature=1.0, top_p=0.95, seed=11).choices[0].text == alone[11]
    steps_before = ray.get(lab3_deployment.handles[1].health.remote())["streams"]
    got, errors = {}, []
    barrier = threading.Barrier(len(seeds))

    def run(sd):
        try:
            barrier.wait()
            stream = ask(c, max_tokens=8, temperature=1.0, top_p=0.95, seed=sd, stream=True)
            got[sd] = "".join(ch.choices[0].text for ch in stream if ch.choices)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(sd,)) for sd in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == alone
    after = ray.get(lab3_deployment.handles[1].health.remote())["streams"]
    steps, rows = after["steps"] - steps_before["steps"], after["batched_rows"] - steps_before["batched_rows"]
    assert rows > steps  # home b decoded several of the four streams in one step
    # a stop string: the text ends before it, finish_reason "stop"
    text = next(t for t in alone.values() if len(t.strip()) >= 4)
    seed = next(sd for sd, t in alone.items() if t == text)
    stop = text.strip()[2:4]
    r = ask(c, max_tokens=8, temperature=1.0, top_p=0.95, seed=seed, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]


def test_exact_request_and_logprobs(served):
    """exact: true on the exact deployment is its own answer; budget with exact is a 400 naming the field."""
    c, *_ = served
    plain = ask(c, max_tokens=3, temperature=0)
    exact = ask(c, max_tokens=3, temperature=0, extra_body={"edgemoe": {"user": "u1", "exact": True}})
    assert exact.choices[0].text == plain.choices[0].text and exact.model_extra["edgemoe"]["policy"] == "exact"
    with pytest.raises(openai.BadRequestError) as err:
        ask(c, max_tokens=2, extra_body={"edgemoe": {"user": "u1", "exact": True, "budget": 0.1}})
    assert "edgemoe.budget" in str(err.value.body)
    r = ask(c, max_tokens=2, temperature=0, logprobs=2)
    assert len(r.choices[0].logprobs.token_logprobs) == r.usage.completion_tokens
