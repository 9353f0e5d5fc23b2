"""The simulator's calendar job queue (`edgemoe.runtime.sim.jobqueue.JobQueue`) serves every node's jobs in (arrival,
seq) order, whatever the bucket width, the crowding of a bucket or the window: checked against a plain sort."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.runtime.sim.jobqueue import JobQueue, _earliest_job, _enqueue, _serve

_I = np.int64


def reference_finish(arrival, service, node, num_nodes):
    """Per-node FIFO in (arrival, seq) order: finish = max(free, arrival) + service; jobs given in seq order."""
    finish = np.empty(len(arrival))
    free = np.zeros(num_nodes)
    for j in np.lexsort((np.arange(len(arrival)), arrival)):
        free[node[j]] = max(free[node[j]], arrival[j]) + service[j]
        finish[j] = free[node[j]]
    return finish


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), window=st.sampled_from([0.0, 1e-4, 1e-3]), crowd=st.sampled_from([0, 5, 80]),
       in_flight=st.sampled_from([1, 64, 10**5]))
def test_calendar_queue_serves_in_arrival_then_seq_order(seed, window, crowd, in_flight):
    rng = np.random.default_rng(seed)
    N, max_xfer, waves = 5, 4e-3, 30
    counters = np.zeros(4, _I)
    q = JobQueue(window, max_xfer, in_flight, counters, capacity=8)
    node_free, node_busy = np.zeros(N), np.zeros(N)
    P = 4000
    done_t, outstanding = np.full(P, -np.inf), np.zeros(P, _I)
    arrival, service, node, back = [], [], [], []
    t0, seq = 0.0, 0
    for _ in range(waves):
        m = int(rng.integers(0, 40)) + (crowd if rng.random() < 0.3 else 0)
        # arrivals in [t0, t0 + window + max_xfer): some at t0 itself, some repeated (ties), crowds at one instant
        a = t0 + rng.choice([0.0, 1.0, rng.random()], size=m) * rng.random(m) * (window + max_xfer) * 0.999
        if m and crowd:
            a[: m // 2] = t0 + window / 2
        new_f = np.column_stack([a, rng.random(m) * 1e-3, rng.random(m) * 1e-3])
        new_i = np.column_stack([np.arange(seq, seq + m), rng.integers(0, N, m), np.arange(seq, seq + m)]).astype(_I)
        q.room(int(counters[1]) + m)
        _enqueue(q.arrays(), counters, new_f, new_i, m)
        outstanding[seq:seq + m] = 1
        arrival += list(a)
        service += list(new_f[:, 1])
        node += list(new_i[:, 1])
        back += list(new_f[:, 2])
        seq += m
        pending = np.array([arrival[j] for j in range(seq) if outstanding[j]])
        assert counters[1] == pending.size
        assert _earliest_job(t0, q.arrays()) == (pending.min() if pending.size else np.inf)
        touched = np.empty(int(counters[1]), _I)
        got = _serve(t0, t0 + window, window > 0, q.arrays(), counters, node_free, node_busy, done_t, outstanding,
                     touched, 0)
        due = pending[(pending < t0 + window) if window > 0 else (pending <= t0)]
        assert got == due.size
        # the next wave starts no later than the earliest pending arrival (as `_pick` guarantees)
        nxt = _earliest_job(t0, q.arrays())
        t0 = min(t0 + window if window > 0 else t0 + 1e-4, nxt) if np.isfinite(nxt) else t0 + max(window, 1e-4)
    # drain
    while counters[1]:
        t0 = _earliest_job(t0, q.arrays())
        _serve(t0, t0 + window, window > 0, q.arrays(), counters, node_free, node_busy, done_t, outstanding,
               np.empty(int(counters[1]), _I), 0)
    assert (outstanding[:seq] == 0).all()
    # each job is its own pass here: its end is its finish plus its trip back
    expect = reference_finish(np.array(arrival), np.array(service), np.array(node, _I), N) + np.array(back)
    np.testing.assert_array_equal(done_t[:seq], expect)


def test_infinite_transfer_is_a_clear_error():
    with pytest.raises(ValueError, match="xfer_s"):
        JobQueue(1e-3, np.inf, 10, np.zeros(4, _I))
