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


@pytest.fixture(scope="module")
def home(tiny_path, lab3):
    ctx = lab3("home")
    cfg = ServerConfig(ctx, str(tiny_path), wire="fp32", links_enabled=False, call_timeout_s=5.0)
    servers = {n: ServerCore(n, cfg.model_path, ctx, cfg.links(32), cfg.make_clock()) for n in range(ctx.num_nodes)}
    return HomeEngine(cfg, 0, CountingTransport(servers))


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
    batcher = HomeBatcher(lambda: home)
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
    batcher = HomeBatcher(lambda: home)
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
