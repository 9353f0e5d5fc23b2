"""The fast engine's pending expert jobs: a calendar queue (numba; a plain-Python fallback without it).

Adding a job and taking the due ones cost O(1) a job (`_enqueue`, `_serve`, `_earliest_job`), where a
sorted queue would merge every wave's jobs into all pending ones (O(pending) a wave). `JobQueue` holds the
arrays; the compiled functions take them as one `QueueArrays` group and share the run's `counters` array,
whose entries the `C_*` constants name (the wave engine, `edgemoe.runtime.sim.engine`, uses the others).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgemoe.jit import njit

_I = np.int64

# entries of the engine's int64 counters array (`WaveEngine.counters`)
C_READY = 0  # entries in the ready list
C_PENDING = 1  # pending jobs in the queue
C_SEQ = 2  # the next job's sequence number
C_FREE = 3  # height of the queue's free-slot stack
C_ENDED = 4  # passes ended so far (their ids in `WaveEngine.ended`, in end order)
NUM_COUNTERS = 5

# columns of the job slots
JF_ARRIVAL, JF_SERVICE, JF_BACK = 0, 1, 2  # jobs_f: arrival, service seconds, trip back to the meeting node
JI_PASS, JI_NODE, JI_SEQ = 0, 1, 2  # jobs_i: pass, node, sequence number


class QueueArrays(NamedTuple):
    """A `JobQueue` as the compiled functions take it (one argument, fields by name)."""

    jobs_f: np.ndarray  # [C, 3] float: arrival, service, trip back (JF_*)
    jobs_i: np.ndarray  # [C, 3] int: pass, node, seq (JI_*)
    next: np.ndarray  # [C] next slot in the bucket's list (-1: none)
    free: np.ndarray  # [C] stack of free slots (height: counters[C_FREE])
    head: np.ndarray  # [B] first slot of each bucket (-1: empty)
    tail: np.ndarray  # [B] last slot of each bucket
    width: float  # bucket width, seconds
    due: np.ndarray  # [C] scratch: the slots a wave serves
    # scratch of the wave engine's `_wave_step`, which allocates nothing (see `edgemoe.runtime.sim.engine`)
    new_f: np.ndarray  # [C, 3] a wave's new jobs (`_push_jobs`), then queued
    new_i: np.ndarray  # [C, 3]
    keys: np.ndarray  # [C] their (node, layer, expert) keys (`_price_calls`)
    starts: np.ndarray  # [C + 1] each pass's first new job
    order: np.ndarray  # [C] a sort's permutation
    tmp: np.ndarray  # [C] a merge sort's buffer (`_stable_sort`)
    touched: np.ndarray  # [C + passes] a wave's decided passes, then the passes of the jobs it serves


@njit(cache=True, inline="always")
def _sort_key(x, key, by_value):
    """The key `_stable_sort` orders entry x by: key[x], or x itself with by_value."""
    return float(x) if by_value else key[x]


@njit(cache=True, inline="always")
def _merge_pass(src, dst, lo, hi, width, key, by_value):
    """One pass of a bottom-up merge sort: each pair of sorted runs of `width` in src[lo:hi] merged into dst
    (a run's entries first on equal keys: stable; a lone run is copied)."""
    for start in range(lo, hi, 2 * width):
        mid = min(start + width, hi)
        end = min(start + 2 * width, hi)
        i, j = start, mid
        for o in range(start, end):
            if j >= end or (i < mid and _sort_key(src[i], key, by_value) <= _sort_key(src[j], key, by_value)):
                dst[o] = src[i]
                i += 1
            else:
                dst[o] = src[j]
                j += 1


@njit(cache=True, inline="always")
def _stable_sort(idx, lo, hi, key, tmp, by_value):
    """Sort idx[lo:hi] in place, stably, by key[idx[i]] (by idx[i] itself with by_value; key is then not read):
    a bottom-up merge sort through tmp[lo:hi]. What np.argsort(kind="mergesort") orders (NaN keys aside),
    without allocating: the wave engine's `_wave_step` allocates nothing. (No insertion sort for short ranges:
    inlined, a branch between two sorts would keep the reference counts of the caller's arguments.)"""
    width = 1
    while width < hi - lo:  # two passes a turn, idx -> tmp -> idx (the second a copy once one run is left)
        _merge_pass(idx, tmp, lo, hi, width, key, by_value)
        width *= 2
        _merge_pass(tmp, idx, lo, hi, width, key, by_value)
        width *= 2


@njit(cache=True, inline="always")
def _enqueue(queue, counters, new_f, new_i, m):
    """Add m new jobs (in creation order, which is seq order) to the calendar queue.

    The queue (`JobQueue`) is a pool of job slots (jobs_f [C, 3], jobs_i [C, 3], a stack of free slots) and a
    ring of B time buckets of width w: bucket floor(arrival / w) mod B holds a linked list of its jobs in seq
    order. Every pending arrival lies in [t0, t0 + window + max transfer), fewer than B - 1 buckets (the ring
    size is chosen so), so the ring never folds two live buckets into one. Adding is O(1) a job: no job moves.
    """
    jobs_f, jobs_i, job_next, free_slots, head, tail, width = (queue.jobs_f, queue.jobs_i, queue.next, queue.free,
                                                               queue.head, queue.tail, queue.width)
    B = head.shape[0]
    nfree = counters[C_FREE]
    for j in range(m):
        nfree -= 1
        slot = free_slots[nfree]
        for c in range(3):
            jobs_f[slot, c] = new_f[j, c]
            jobs_i[slot, c] = new_i[j, c]
        job_next[slot] = -1
        b = _bucket(new_f[j, JF_ARRIVAL], width) % B
        if head[b] < 0:
            head[b] = slot
        else:
            job_next[tail[b]] = slot
        tail[b] = slot
    counters[C_FREE] = nfree
    counters[C_PENDING] += m


@njit(cache=True, inline="always")
def _bucket(t, width):
    """Absolute index of the time bucket holding t (floor: monotone in t)."""
    return int(np.floor(t / width))


@njit(cache=True, inline="always")
def _serve(t0, horizon, windowed, queue, counters, node_free, node_busy, done_t, outstanding, touched, n_touched):
    """Take the jobs arriving before the horizon (at t0 with window 0) out of the queue and serve them FIFO per
    node: finish = max(node free, arrival) + service, in (arrival, seq) order.

    Buckets are visited in time order and each one's due jobs sorted by arrival, stably: equal arrivals share
    a bucket, whose list is in seq order, so the due jobs come out in (arrival, seq) order. Buckets are narrow
    (`JobQueue`), so a bucket holds few jobs to sort (`_stable_sort`). Popped passes are appended to
    `touched`; returns the new count.
    """
    if counters[C_PENDING] > 0:
        n_touched = _serve_due(t0, horizon, windowed, queue, counters, node_free, node_busy, done_t, outstanding,
                               touched, n_touched)
    return n_touched


@njit(cache=True, inline="always")
def _serve_due(t0, horizon, windowed, queue, counters, node_free, node_busy, done_t, outstanding, touched, n_touched):
    """`_serve` with jobs pending."""
    jobs_f, jobs_i, job_next, free_slots, head, tail, width, due = (queue.jobs_f, queue.jobs_i, queue.next, queue.free,
                                                                    queue.head, queue.tail, queue.width, queue.due)
    B = head.shape[0]
    b0 = _bucket(t0, width)
    b1 = _bucket(horizon, width) if windowed else b0
    if b1 > b0 + B - 1:
        b1 = b0 + B - 1
    m = 0
    for ab in range(b0, b1 + 1):
        b = ab % B
        prev = -1
        slot = head[b]
        lo = m
        while slot >= 0:
            nxt = job_next[slot]
            a = jobs_f[slot, JF_ARRIVAL]
            if (a < horizon) if windowed else (a <= t0):
                due[m] = slot
                m += 1
                if prev < 0:
                    head[b] = nxt
                else:
                    job_next[prev] = nxt
                if tail[b] == slot:
                    tail[b] = prev
            else:
                prev = slot
            slot = nxt
        # by arrival, stably
        _stable_sort(due, lo, m, jobs_f[:, JF_ARRIVAL], queue.tmp, False)
    nfree = counters[C_FREE]
    for i in range(m):
        slot = due[i]
        node = jobs_i[slot, JI_NODE]
        arrival = jobs_f[slot, JF_ARRIVAL]
        start = node_free[node] if node_free[node] > arrival else arrival
        finish = start + jobs_f[slot, JF_SERVICE]
        node_free[node] = finish
        p = jobs_i[slot, JI_PASS]
        done = finish + jobs_f[slot, JF_BACK]
        if done > done_t[p]:
            done_t[p] = done
        outstanding[p] -= 1
        node_busy[node] += jobs_f[slot, JF_SERVICE]
        touched[n_touched] = p
        n_touched += 1
        free_slots[nfree] = slot
        nfree += 1
    counters[C_FREE] = nfree
    counters[C_PENDING] -= m
    return n_touched


@njit(cache=True, inline="always")
def _earliest_job(t_low, queue):
    """Earliest pending arrival (inf when none): the first non-empty bucket from t_low, a lower bound of every
    pending arrival, holds it."""
    jobs_f, job_next, head, width = queue.jobs_f, queue.next, queue.head, queue.width
    B = head.shape[0]
    b0 = _bucket(t_low, width)
    best = np.inf
    step = 0
    while step < B:
        slot = head[(b0 + step) % B]
        step = B if slot >= 0 else step + 1  # (one return: see `_stable_sort`)
        while slot >= 0:
            if jobs_f[slot, JF_ARRIVAL] < best:
                best = jobs_f[slot, JF_ARRIVAL]
            slot = job_next[slot]
    return best



class JobQueue:
    """The pending expert jobs of a run: a calendar queue (`_enqueue`, `_serve`, `_earliest_job`).

    Slots: jobs_f [C, 3] (arrival, service, trip back), jobs_i [C, 3] (pass, node, seq), next slot in the
    bucket's list [C], and a stack of free slots (its height in counters[C_FREE]). Buckets: a ring of B list heads
    and tails of width w. Every pending arrival lies in [t0, t0 + window + max transfer) (a pass starts
    before its wave's horizon and its calls arrive one transfer later), so B = that span / w + 3 buckets
    never fold two live buckets into one. Width w: about PER_BUCKET jobs a bucket if `in_flight` calls (users x
    K) spread over the span, at most 1/16 of the window (a wave then pops whole buckets but its last), and no
    narrower than span / MAX_BUCKETS (with window 0 a wave pops only its own instant). Narrow buckets keep
    `_serve`'s per-bucket sorts short; the width changes the speed, never the result.
    """

    MAX_BUCKETS = 1 << 14
    PER_BUCKET = 4

    def __init__(self, window: float, max_xfer: float, in_flight: int, counters: np.ndarray, capacity: int = 1024,
                 passes: int = 0):
        if not np.isfinite(max_xfer):
            raise ValueError("context xfer_s: every transfer time must be finite (a node pair with no link?)")
        span = window + max_xfer
        crowded = span * self.PER_BUCKET / max(in_flight, 1)
        self.width = max(min(window / 16, crowded), span / (self.MAX_BUCKETS - 3)) or 1.0
        buckets = int(np.ceil(span / self.width)) + 3
        self.head = np.full(buckets, -1, _I)
        self.tail = np.full(buckets, -1, _I)
        self.counters = counters
        self.passes = int(passes)  # the run's passes: `touched` holds up to passes + capacity
        self.jobs_f = np.zeros((0, 3))
        self.jobs_i = np.zeros((0, 3), _I)
        self.next = np.zeros(0, _I)
        self.free = np.zeros(0, _I)
        self.due = np.zeros(0, _I)
        self.room(capacity)

    def room(self, need: int) -> None:
        """Grow the pool to >= need slots (at least doubling); the new slots go on the free stack."""
        have = self.jobs_f.shape[0]
        if need <= have:
            return
        more = max(need, 2 * have) - have
        self.jobs_f = np.concatenate([self.jobs_f, np.zeros((more, 3))])
        self.jobs_i = np.concatenate([self.jobs_i, np.zeros((more, 3), _I)])
        self.next = np.concatenate([self.next, np.full(more, -1, _I)])
        height = int(self.counters[C_FREE])
        free = np.empty(have + more, _I)
        free[:height] = self.free[:height]
        free[height:height + more] = np.arange(have + more - 1, have - 1, -1)
        self.free = free
        self.counters[C_FREE] = height + more
        C = have + more
        self.due = np.empty(C, _I)
        self.new_f, self.new_i = np.empty((C, 3)), np.empty((C, 3), _I)
        self.keys, self.starts, self.order, self.tmp = np.empty(C, _I), np.empty(C + 1, _I), np.empty(C, _I), np.empty(C, _I)
        self.touched = np.empty(C + self.passes, _I)

    def arrays(self) -> QueueArrays:
        """The queue as the compiled functions take it."""
        return QueueArrays(self.jobs_f, self.jobs_i, self.next, self.free, self.head, self.tail, self.width, self.due,
                           self.new_f, self.new_i, self.keys, self.starts, self.order, self.tmp, self.touched)
