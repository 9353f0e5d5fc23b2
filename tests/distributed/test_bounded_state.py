"""What a long-running deployment remembers stays bounded: a long stream of requests (or of faults) leaves every
per-request and per-event container of the homes and the ingress at a fixed size, while the duplicate checks
within those bounds still hold. Counts, not timings."""

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from edgemoe.distributed.batching import HomeBatcher, StreamRequest
from edgemoe.distributed.health import EVENTS_KEPT, Membership
from edgemoe.distributed.ledger import RequestLedger
from edgemoe.distributed.sampling import SamplingParams


@pytest.fixture(scope="module")
def home(tiny_path, lab3_home):
    return lab3_home(tiny_path)


def finish(batcher: HomeBatcher, rid: str) -> list[int]:
    toks = []
    while True:
        p = batcher.poll(rid, len(toks), 30.0)
        assert p["error"] is None
        toks += [t for t, _, _ in p["tokens"]]
        if p["done"]:
            return toks


def test_a_home_remembers_at_most_keep_finished_streams(home):
    keep, n = 8, 60
    batcher = HomeBatcher(lambda: home, keep=keep)
    greedy = SamplingParams(temperature=0.0)
    try:
        sizes = []
        for i in range(n):
            batcher.start(StreamRequest(f"r{i}", i % 2, np.array([3, 1, 4, 1, 5]), 1, greedy))
            finish(batcher, f"r{i}")
            sizes.append(batcher.remembered())
        assert max(sizes) == sizes[-1] == keep  # the newest and the latest finished ones
        # a finished stream is still answered while kept (its last poll may be retried) ...
        assert batcher.poll(f"r{n - 1}", 0, 1.0)["done"]
        # ... and a finished stream nobody polled for orphan_s seconds is forgotten at the next start
        with batcher._cv:
            for s in batcher._streams.values():
                s.touched -= 2 * batcher.orphan_s
        batcher.start(StreamRequest("last", 0, np.array([2, 7]), 1, greedy))
        assert batcher.remembered() == 1
        finish(batcher, "last")
    finally:
        batcher.close()


def test_the_ledger_keeps_the_latest_results_only():
    @dataclass(frozen=True)
    class Result:
        request_id: str
        replayed: bool = False

    ledger = RequestLedger(keep=16)
    for i in range(1000):
        ledger.record(Result(f"q{i}"))
    assert len(ledger.finished) == 16 and ledger.served == 1000
    assert ledger.replay("q999").replayed and ledger.replay("q0") is None


def test_membership_events_are_bounded_and_read_incrementally():
    m = Membership(3)
    seen, counted = 0, 0
    for i in range(3 * EVENTS_KEPT):
        m.exclude(i % 3)
        m.readmit(i % 3)
        if i % 7 == 0:  # a reader that checks now and then gets each event once
            new, seen = m.events_since(seen)
            counted += len(new)
    new, seen = m.events_since(seen)
    counted += len(new)
    assert len(m.events) == EVENTS_KEPT and m.event_total == 6 * EVENTS_KEPT == seen == counted
    assert m.events_since(seen) == ([], seen)
    assert m.events_since(0)[0] == list(m.events)  # far behind: what is kept


def test_the_ingress_answers_and_home_event_counts_are_bounded():
    from edgemoe.distributed import serve
    from edgemoe.serve.ray_engine import RayEngine

    ctx = SimpleNamespace(num_nodes=2, node_names=("a", "b"))
    dep = SimpleNamespace(cfg=SimpleNamespace(ctx=ctx, backoff_base_s=0.2, backoff_max_s=1.0))
    client = serve.Client(dep, probe=False)
    for i in range(3 * serve.ANSWERS_KEPT):
        client._record(SimpleNamespace(request_id=f"x{i}"))
    last = f"x{3 * serve.ANSWERS_KEPT - 1}"
    first = client.answers[last]
    assert client._record(SimpleNamespace(request_id=last)) is first and client.duplicates == 1
    assert len(client.answers) == serve.ANSWERS_KEPT

    # the ray ingress counts each home's membership events once, one entry per home whatever its restarts
    counted = []
    tele = SimpleNamespace(membership_event=lambda by, kind, node: counted.append((by, kind, node)))
    fake = SimpleNamespace(_lock=__import__("threading").Lock(), _events_seen={}, telemetry=tele,
                           ctx=SimpleNamespace(node_names=("a", "b")))
    count = RayEngine._count_home_events
    for pid in range(100, 150):  # 50 restarts of home 0, each answering two polls with one new event between
        count(fake, 0, {"pid": pid, "total": 1, "events": [("excluded", 1)]})
        count(fake, 0, {"pid": pid, "total": 1, "events": [("excluded", 1)]})  # a concurrent poll: no new event
        count(fake, 0, {"pid": pid, "total": 2, "events": [("excluded", 1), ("readmitted", 1)]})  # sent before it counted
    assert len(fake._events_seen) == 1 and fake._events_seen[0] == (149, 2)
    assert counted == [("home a", "excluded", "b"), ("home a", "readmitted", "b")] * 50
