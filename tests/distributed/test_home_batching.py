"""Continuous batching on a home (edgemoe.distributed.batching) with servers as in-process objects: a stream's
tokens do not depend on what it is batched with, a resumed stream continues with the tokens it would have
made, and the slots of a decode step bound for one server leave as one call whichever streams they are."""

import numpy as np
import pytest

from edgemoe.distributed.batching import HomeBatcher, StreamRequest
from edgemoe.distributed.sampling import SamplingParams
from edgemoe.distributed.server import HomeEngine, LocalTransport, ServerConfig, ServerCore
from edgemoe.distributed.wire import GenerateRequest

PROMPTS = [np.array([5, 6, 7, 8, 9, 10, 11]), np.array([3, 1, 4, 1, 5]), np.array([2, 7, 1, 8, 2, 8, 1, 8, 2])]


class CountingTransport(LocalTransport):
    """LocalTransport that records (layer, rows) of every call."""

    def __init__(self, servers):
        super().__init__(servers)
        self.calls = []

    def submit(self, node, call):
        self.calls.append((call.layer, len(call.experts)))
        return super().submit(node, call)


# A finished stream is forgotten orphan_s after its last poll (60 s by default). These tests poll finished streams
# again after later ones ran, and on a cold numba cache under load the first OrderMoE decode step compiles for
# longer than that: a bound far above any test's run, so that the answer does not depend on the host's speed.
KEEP_S = 3600.0


@pytest.fixture(scope="module")
def home(tiny_path, lab3_home):
    return lab3_home(tiny_path, CountingTransport)


def run(batcher: HomeBatcher, reqs: list[StreamRequest]) -> list[list[int]]:
    """Start every stream at once, then poll each to its end -> their tokens."""
    for r in reqs:
        batcher.start(r)
    out = []
    for r in reqs:
        toks = []
        while True:
            p = batcher.poll(r.request_id, len(toks), 30.0)
            assert p["error"] is None
            toks += [t for t, _, _ in p["tokens"]]
            if p["done"]:
                break
        out.append(toks)
    return out


def test_streams_give_alone_what_they_give_batched(home):
    greedy = SamplingParams(temperature=0.0)
    sampled = [SamplingParams(1.0, 0.9, 0, seed) for seed in (1, 2, 3)]
    alone_greedy = home.generate(GenerateRequest("g", 0, PROMPTS[0], 6)).tokens.tolist()
    batcher = HomeBatcher(lambda: home, orphan_s=KEEP_S)
    try:
        assert run(batcher, [StreamRequest("a0", 0, PROMPTS[0], 6, greedy)]) == [alone_greedy]
        alone = [run(batcher, [StreamRequest(f"s{i}", i, PROMPTS[i], 6, sampled[i])])[0] for i in range(3)]
        home.transport.calls.clear()
        steps0 = batcher.steps
        together = run(batcher, [StreamRequest(f"t{i}", i, PROMPTS[i], 6, sampled[i]) for i in range(3)])
        assert together == alone
        assert len({tuple(t) for t in alone}) == 3  # different seeds and prompts, different texts
        steps = batcher.steps - steps0
        assert batcher.load()["batched_rows"] > batcher.steps  # some step decoded several streams at once
        # one call per server and layer in each pass, whichever streams its rows belong to: a decode step of
        # 3 streams (2 slots each) puts more than 2 rows on some call
        L, N = home.ctx.num_layers, home.ctx.num_nodes
        assert len(home.transport.calls) <= (steps + 3) * L * N
        assert max(rows for layer, rows in home.transport.calls) >= 3
        # a resumed stream (after a failure elsewhere) continues with the tokens it would have made
        k = 2
        rest = run(batcher, [StreamRequest("r", 1, np.concatenate([PROMPTS[1], alone[1][:k]]), 6 - k, sampled[1],
                                           first_index=k)])[0]
        assert rest == alone[1][k:]
    finally:
        batcher.close()


def test_eos_length_and_cancel(home):
    batcher = HomeBatcher(lambda: home, orphan_s=KEEP_S)
    try:
        first = run(batcher, [StreamRequest("x", 0, PROMPTS[0], 3, SamplingParams(temperature=0.0))])[0]
        assert len(first) == 3
        # the second greedy token declared EOS: the stream stops there with reason "stop"
        batcher.start(StreamRequest("e", 0, PROMPTS[0], 3, SamplingParams(temperature=0.0), eos=(first[1],)))
        p = batcher.poll("e", 0, 30.0)
        while not p["done"]:
            p = batcher.poll("e", 0, 30.0)
        assert [t for t, _, _ in p["tokens"]] == first[:2] and p["reason"] == "stop"
        assert p["stats"]["expert_slots"]["slots"] > 0 and sum(p["stats"]["node_slots"]) > 0
        batcher.start(StreamRequest("c", 0, PROMPTS[0], 200, SamplingParams(temperature=0.0)))
        batcher.poll("c", 0, 30.0)
        assert batcher.cancel("c")["expert_slots"]["slots"] > 0
        p = batcher.poll("c", 0, 30.0)
        while not p["done"]:
            p = batcher.poll("c", 0, 30.0)
        assert p["reason"] == "cancelled"
        with pytest.raises(Exception, match="unknown here"):
            batcher.poll("never", 0, 0.1)
    finally:
        batcher.close()


def _ordermoe_home(tiny_path, ctx):
    """Home b running OrderMoE at a budget where it substitutes, drops and zeroes slots; its servers.
    Its decisions depend on the rows alone: no backlog estimate from measured replies (`use_load`) and frozen
    adaptive weights (`ewma=0`), which would otherwise carry wall-clock timings and earlier requests' feedback
    into later decisions."""
    cfg = ServerConfig(ctx, str(tiny_path), policy="ordermoe", policy_params=(("budget", 0.5), ("ewma", 0.0)),
                       wire="fp32", links_enabled=False, call_timeout_s=5.0, use_load=False)
    servers = {n: ServerCore(n, cfg.model_path, ctx, cfg.links(32), cfg.make_clock()) for n in range(ctx.num_nodes)}
    return HomeEngine(cfg, 1, LocalTransport(servers)), servers


def _stats(batcher: HomeBatcher, request_id: str) -> dict:
    return batcher.poll(request_id, 1 << 30, 0.0)["stats"]


def test_exact_and_budgeted_streams_in_one_step_give_what_they_give_alone(tiny_path, lab3):
    """One decode step holding an exact stream, a budget-0 stream and one at the deployment's budget (three
    policy row groups in one pass): each gives the tokens and slot counts it gives alone; the exact and
    budget-0 streams run every routed expert, the third does not."""
    from dataclasses import replace

    home, _ = _ordermoe_home(tiny_path, lab3("home"))
    greedy = SamplingParams(temperature=0.0)
    reqs = [StreamRequest("e", 1, PROMPTS[0], 5, greedy, exact=True),
            StreamRequest("z", 1, PROMPTS[1], 5, greedy, budget=0.0),
            StreamRequest("o", 1, PROMPTS[2], 5, greedy)]
    batcher = HomeBatcher(lambda: home, orphan_s=KEEP_S)
    try:
        alone = [run(batcher, [replace(r, request_id=r.request_id + "-alone")])[0] for r in reqs]
        steps = batcher.steps
        assert run(batcher, reqs) == alone
        assert batcher.batched_rows > batcher.steps - steps  # the streams shared decode steps
        for r in reqs:
            together, by_itself = _stats(batcher, r.request_id), _stats(batcher, r.request_id + "-alone")
            assert together["budget_granted"] == pytest.approx(by_itself["budget_granted"])
            if r.request_id != "o":
                assert together["expert_slots"] == by_itself["expert_slots"]
                continue
            # The budgeted stream decides from its gates, and a [3, d] matmul is not bit for bit a [1, d] one
            # (BLAS blocks them differently; with one thread per worker a gate moves in its last bits), so a
            # stand-in at the budget's edge may flip between substitute and drop: same slots, at most 2% moved.
            slots = sum(by_itself["expert_slots"].values())
            assert sum(together["expert_slots"].values()) == slots
            moved = sum(abs(together["expert_slots"][k] - by_itself["expert_slots"][k]) for k in by_itself["expert_slots"])
            assert moved <= 0.02 * slots
        stood_in = {r.request_id: sum(_stats(batcher, r.request_id)["expert_slots"][k]
                                      for k in ("substituted", "dropped", "zeroed")) for r in reqs}
        assert stood_in["e"] == stood_in["z"] == 0 < stood_in["o"]
        assert _stats(batcher, "e")["budget_granted"] == 0 < _stats(batcher, "o")["budget_granted"]
    finally:
        batcher.close()


def test_an_exact_stream_on_an_ordermoe_home_fails_rather_than_degrade(tiny_path, lab3):
    """Servers a and c lost (the experts e % 3 == 1 have no replica left): a stream that asked for exact
    execution ends with a 503 naming the expert, unless it allows degradation; the deployment's own
    (budgeted) streams are answered."""
    home, servers = _ordermoe_home(tiny_path, lab3("home"))
    del servers[0], servers[2]
    greedy = SamplingParams(temperature=0.0)
    batcher = HomeBatcher(lambda: home, orphan_s=KEEP_S)
    try:
        batcher.start(StreamRequest("strict", 1, PROMPTS[0], 3, greedy, exact=True))
        end = batcher.poll("strict", 1 << 30, 60.0)
        assert end["done"] and end["error"][0] == 503 and "no reachable replica" in end["error"][1]
        lenient = StreamRequest("lenient", 1, PROMPTS[0], 3, greedy, exact=True, allow_degraded=True)
        assert len(run(batcher, [lenient, StreamRequest("own", 1, PROMPTS[0], 3, greedy)])[0]) == 3
        assert _stats(batcher, "lenient")["expert_slots"]["degraded"] > 0
    finally:
        batcher.close()
