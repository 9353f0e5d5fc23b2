"""Compiled bookkeeping of the simulator's fast engine (numba; a plain-Python fallback without it).

`WaveEngine` keeps every pass, job and node array of one run and advances it one wave at a time in a single
compiled call (`_wave_step`): it turns the wave's decision into jobs, serves the jobs that arrive within the
wave in per-node FIFO order, moves finished passes on, and picks the passes the next wave decides. The
policy call in between stays in numpy (`edgemoe.runtime.sim.simulate.run_fast`), except for policies with a
compiled rule (`Policy.compiled_rule`: exact, slimcaching, drop), which `_drive` decides in the compiled loop
too (`_decide_rows`), a chunk of waves per call. The model and the wave rule are those of the module
docstring of `edgemoe.runtime.sim.simulate`; this module only makes them cheap.

Pending jobs wait in a calendar queue (`JobQueue`): adding a job and taking the due ones cost O(1) a job, where
the sorted queue kept before merged every wave's jobs into all pending ones (O(pending) a wave).

Speed notes (measured with perf): numba reference-counts every array argument of a real call and of an
inlined call, so the per-wave parts take grouped arrays (tuples) and are inlined once per wave, and the hot
inner loops call nothing with array arguments. CPython passes a call of more than 30 arguments as *args,
which numba cannot inline: keep calls between compiled functions under that.

Numbers: the event order is that of the earlier numpy formulation (same waves, same ready-list order, same
job seq), and the FIFO recursion is the reference engine's sequential `finish = max(free, arrival) +
service`, so with window 0 every pass ends exactly when the reference says. Busy time is summed per node in
service order, which can differ from creation order in the last bit (utilisation to ~1e-16).
"""

from __future__ import annotations

import numpy as np

from edgemoe.jit import njit

from ..policy import Decision

_I = np.int64


@njit(cache=True, inline="always")
def _push_jobs(dec_pass, dec_layer, dec_home, dec_node, dec_experts, dec_loc, dec_next, start_t, done_t,
               outstanding, pass_begin, layer, wave_ids, xfer, call1, flops, nbytes, peak, mem_bw, overhead, num_layers,
               queue, counters):
    """Jobs of one wave's decision (T rows, K slots; rows grouped by pass) added to the pending queue
    (`_enqueue`), each with arrival, service, trip back (jobs_f) and pass, node, seq (jobs_i). A pass's slots for
    the same expert on the same node share one batched call: each is charged roofline(count) / count.
    """
    T, K = dec_node.shape
    E = flops.shape[1]
    for i in range(wave_ids.shape[0]):
        p = wave_ids[i]
        if layer[p] == 0 and not (pass_begin[p] == pass_begin[p]):  # nan: not begun at a dense stage
            pass_begin[p] = start_t[p]
        done_t[p] = start_t[p]
        outstanding[p] = 0
    new_f = np.empty((T * K, 3))
    new_i = np.empty((T * K, 3), _I)
    keys = np.empty(T * K, _I)
    n = 0
    seq = counters[2]
    r = 0
    while r < T:  # one pass (a run of rows with the same pass) at a time
        p = dec_pass[r]
        r_end = r
        while r_end < T and dec_pass[r_end] == p:
            r_end += 1
        first_job = n
        for t in range(r, r_end):
            start = start_t[p]
            trip_home = xfer[dec_next[t], dec_home[t]] if dec_layer[t] == num_layers - 1 else 0.0
            floor = start + trip_home
            if floor > done_t[p]:
                done_t[p] = floor
            for k in range(K):
                node = dec_node[t, k]
                if node < 0:
                    continue
                new_i[n, 0] = p
                new_i[n, 1] = node
                new_i[n, 2] = seq
                new_f[n, 0] = start + xfer[dec_loc[t], node]
                new_f[n, 2] = xfer[node, dec_next[t]] + trip_home
                new_f[n, 1] = dec_layer[t] * E + dec_experts[t, k]  # (layer, expert) key; priced below
                seq += 1
                n += 1
        _price_calls(new_f, new_i, first_job, n, keys, call1, flops, nbytes, peak, mem_bw, overhead)
        outstanding[p] += n - first_job
        r = r_end
    counters[2] = seq
    _enqueue(queue, counters, new_f, new_i, n)


@njit(cache=True, inline="always")
def _enqueue(queue, counters, new_f, new_i, m):
    """Add m new jobs (in creation order, which is seq order) to the calendar queue.

    The queue (`JobQueue`) is a pool of job slots (jobs_f [C, 3], jobs_i [C, 3], a stack of free slots) and a
    ring of B time buckets of width w: bucket floor(arrival / w) mod B holds a linked list of its jobs in seq
    order. Every pending arrival lies in [t0, t0 + window + max transfer), fewer than B - 1 buckets (the ring
    size is chosen so), so the ring never folds two live buckets into one. Adding is O(1) a job: no job moves.
    """
    jobs_f, jobs_i, job_next, free_slots, head, tail, width = queue[0], queue[1], queue[2], queue[3], queue[4], queue[5], queue[6]
    B = head.shape[0]
    nfree = counters[3]
    for j in range(m):
        nfree -= 1
        slot = free_slots[nfree]
        for c in range(3):
            jobs_f[slot, c] = new_f[j, c]
            jobs_i[slot, c] = new_i[j, c]
        job_next[slot] = -1
        b = _bucket(new_f[j, 0], width) % B
        if head[b] < 0:
            head[b] = slot
        else:
            job_next[tail[b]] = slot
        tail[b] = slot
    counters[3] = nfree
    counters[1] += m


@njit(cache=True, inline="always")
def _bucket(t, width):
    """Absolute index of the time bucket holding t (floor: monotone in t)."""
    return int(np.floor(t / width))


@njit(cache=True, inline="always")  # called per pass: a real call's refcounting would dominate
def _price_calls(jobs_f, jobs_i, lo, hi, keys, call1, flops, nbytes, peak, mem_bw, overhead):
    """Service seconds of the jobs lo..hi of one pass: roofline(count) / count per (node, layer, expert).

    On entry jobs_f[j, 1] holds the job's layer * E + expert; on exit its service seconds. keys: scratch [>= m];
    call1 [N * L * E]: `_call_s` of one-token calls, precomputed (`one_token_calls`).
    """
    m = hi - lo
    if m == 0:
        return
    for j in range(m):
        keys[j] = jobs_i[lo + j, 1] * flops.size + int(jobs_f[lo + j, 1])
    if m <= 16:  # a decode pass (K jobs): count equal keys pairwise rather than sort
        for j in range(m):
            count = 0
            for i in range(m):
                if keys[i] == keys[j]:
                    count += 1
            if count == 1:
                jobs_f[lo + j, 1] = call1[keys[j]]
            else:
                jobs_f[lo + j, 1] = _call_s(keys[j], count, flops, nbytes, peak, mem_bw, overhead)
        return
    order = np.argsort(keys[:m], kind="mergesort")
    a = 0
    while a < m:
        b = a
        while b < m and keys[order[b]] == keys[order[a]]:
            b += 1
        service = _call_s(keys[order[a]], b - a, flops, nbytes, peak, mem_bw, overhead)
        for c in range(a, b):
            jobs_f[lo + order[c], 1] = service
        a = b


@njit(cache=True, inline="always")
def _call_s(key, count, flops, nbytes, peak, mem_bw, overhead):
    """Seconds per token of one call of `count` tokens; key = (node * L + layer) * E + expert.

    The roofline of edgemoe.cluster.cost.roofline_s, operation for operation (the same float result):
    (overhead + max(count * flops / peak, bytes / bandwidth)) / count.
    """
    E = flops.shape[1]
    node = key // flops.size
    le = key % flops.size
    layer, expert = le // E, le % E
    compute = float(count) * flops[layer, expert] / peak[node]
    memory = nbytes[layer, expert] / mem_bw[node]
    return (overhead[node] + max(compute, memory)) / count


@njit(cache=True)
def one_token_calls(flops, nbytes, peak, mem_bw, overhead):
    """[N * L * E] seconds of a one-token call of (layer, expert) on each node, by `_call_s`."""
    N = peak.shape[0]
    out = np.empty(N * flops.size)
    for key in range(out.shape[0]):
        out[key] = _call_s(key, 1, flops, nbytes, peak, mem_bw, overhead)
    return out


@njit(cache=True, inline="always")
def _serve(t0, horizon, windowed, queue, counters, node_free, node_busy, done_t, outstanding, touched, n_touched):
    """Take the jobs arriving before the horizon (at t0 with window 0) out of the queue and serve them FIFO per
    node: finish = max(node free, arrival) + service, in (arrival, seq) order.

    Buckets are visited in time order and each one's due jobs sorted by arrival, stably: equal arrivals share
    a bucket, whose list is in seq order, so the due jobs come out in (arrival, seq) order. Buckets are narrow
    (`JobQueue`), so a bucket holds few jobs and the sort is an insertion sort. Popped passes are appended to
    `touched`; returns the new count.
    """
    jobs_f, jobs_i, job_next, free_slots, head, tail, width, due = queue
    if counters[1] == 0:
        return n_touched
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
            a = jobs_f[slot, 0]
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
        if m - lo > 32:  # a crowded bucket (many calls at one instant): merge sort, stable
            arr = np.empty(m - lo)
            for i in range(lo, m):
                arr[i - lo] = jobs_f[due[i], 0]
            order = np.argsort(arr, kind="mergesort")
            seg = due[lo:m].copy()
            for i in range(m - lo):
                due[lo + i] = seg[order[i]]
        else:  # insertion sort; strict > keeps equal arrivals in seq order
            for i in range(lo + 1, m):
                slot = due[i]
                a = jobs_f[slot, 0]
                j = i - 1
                while j >= lo and jobs_f[due[j], 0] > a:
                    due[j + 1] = due[j]
                    j -= 1
                due[j + 1] = slot
    nfree = counters[3]
    for i in range(m):
        slot = due[i]
        node = jobs_i[slot, 1]
        start = node_free[node] if node_free[node] > jobs_f[slot, 0] else jobs_f[slot, 0]
        finish = start + jobs_f[slot, 1]
        node_free[node] = finish
        p = jobs_i[slot, 0]
        done = finish + jobs_f[slot, 2]
        if done > done_t[p]:
            done_t[p] = done
        outstanding[p] -= 1
        node_busy[node] += jobs_f[slot, 1]
        touched[n_touched] = p
        n_touched += 1
        free_slots[nfree] = slot
        nfree += 1
    counters[3] = nfree
    counters[1] -= m
    return n_touched


@njit(cache=True, inline="always")
def _earliest_job(t_low, queue):
    """Earliest pending arrival (inf when none): the first non-empty bucket from t_low, a lower bound of every
    pending arrival, holds it."""
    jobs_f, job_next, head, width = queue[0], queue[2], queue[4], queue[6]
    B = head.shape[0]
    b0 = _bucket(t_low, width)
    for step in range(B):
        slot = head[(b0 + step) % B]
        if slot >= 0:
            best = np.inf
            while slot >= 0:
                if jobs_f[slot, 0] < best:
                    best = jobs_f[slot, 0]
                slot = job_next[slot]
            return best
    return np.inf


@njit(cache=True, inline="always")
def _advance(touched, n_touched, n_decided, mark, stamp, outstanding, layer, done_t, pass_end, ended, pass_next,
             pass_request, request_next, request_first_pass, request_arrival, closed, think_s, num_layers, ready_ids,
             ready_t, ready_stage, first_stage, counters):
    """Passes among `touched` (the n_decided passes of the wave's decision, then the passes of the jobs
    served) with no job left finished their layer: next layer, next pass or next request.

    Appended to the ready list in the numpy formulation's order: passes going on (by id), then the next
    passes of the ended ones (by id), then the first passes of closed-loop follow-up requests (by id). Each
    enters at `first_stage`: 0 (its layer's dense work is still to run on the home's backbone) or 1 (ready to
    decide; the dense part is off).
    """
    if n_touched == n_decided:  # no job served: the decided passes in ready-list order (as numpy did)
        fin = touched[:n_touched].copy()
        k = 0
        for i in range(n_touched):
            if outstanding[fin[i]] == 0:
                fin[k] = fin[i]
                k += 1
        fin = fin[:k]
    else:  # by pass id (np.unique of decided + served passes), the finished ones only: fewer to sort
        fin = np.empty(n_touched, _I)
        k = 0
        for i in range(n_touched):
            p = touched[i]
            if mark[p] != stamp:
                mark[p] = stamp
                if outstanding[p] == 0:
                    fin[k] = p
                    k += 1
        fin = np.sort(fin[:k])
    nr = counters[0]
    for i in range(k):
        p = fin[i]
        layer[p] += 1
        if layer[p] < num_layers:
            ready_ids[nr] = p
            ready_t[nr] = done_t[p]
            ready_stage[nr] = first_stage
            nr += 1
    for i in range(k):
        p = fin[i]
        if layer[p] >= num_layers:
            pass_end[p] = done_t[p]
            ended[counters[4]] = p  # the log of ended passes (the ordermoe loop's feedback reads it)
            counters[4] += 1
            if pass_next[p] >= 0:
                ready_ids[nr] = pass_next[p]
                ready_t[nr] = done_t[p]
                ready_stage[nr] = first_stage
                nr += 1
    if closed:
        for i in range(k):
            p = fin[i]
            if layer[p] >= num_layers and pass_next[p] < 0:
                r = request_next[pass_request[p]]
                if r >= 0:
                    arrive = done_t[p] + think_s
                    request_arrival[r] = arrive
                    ready_ids[nr] = request_first_pass[r]
                    ready_t[nr] = arrive
                    ready_stage[nr] = first_stage
                    nr += 1
    counters[0] = nr


@njit(cache=True, inline="always")
def _dense_stage(t0, horizon, windowed, ready_ids, ready_t, ready_stage, nr, layer, pass_begin, pass_home, pass_dense,
                 backbone_free):
    """Serve the ready entries at stage 0 before the horizon (at t0 for window 0) on their homes' backbone
    queues, FIFO in (time, ready-list) order: end = max(backbone free, ready) + the layer's dense seconds. Each
    becomes a stage-1 entry (ready to decide) at its end; a pass's first layer begins at its stage-0 time."""
    m = 0
    for i in range(nr):
        if ready_stage[i] == 0 and ((ready_t[i] < horizon) if windowed else (ready_t[i] <= t0)):
            m += 1
    if m == 0:
        return
    idx = np.empty(m, _I)
    when = np.empty(m)
    q = 0
    for i in range(nr):
        if ready_stage[i] == 0 and ((ready_t[i] < horizon) if windowed else (ready_t[i] <= t0)):
            idx[q] = i
            when[q] = ready_t[i]
            q += 1
    order = np.argsort(when, kind="mergesort")  # stable: equal times in ready-list order
    for j in range(m):
        i = idx[order[j]]
        p = ready_ids[i]
        if layer[p] == 0:
            pass_begin[p] = ready_t[i]
        h = pass_home[p]
        begin = backbone_free[h] if backbone_free[h] > ready_t[i] else ready_t[i]
        backbone_free[h] = begin + pass_dense[p]
        ready_t[i] = backbone_free[h]
        ready_stage[i] = 1


@njit(cache=True, inline="always")
def _pick(window, queue, counters, ready_ids, ready_t, ready_stage, start_t, node_free, load, times, layer, pass_begin,
          pass_home, pass_dense, backbone_free):
    """Next wave: t0 = earliest pending time; serve the dense work due before t0 + window (`_dense_stage`),
    then take the passes ready to decide before t0 + window (at t0 for window 0).

    Returns the picked pass ids (ready-list order) or None when nothing is pending; times <- (t0, horizon).
    """
    nr, nj = counters[0], counters[1]
    if nr == 0 and nj == 0:
        return np.empty(0, _I), False
    t0 = np.inf
    for i in range(nr):
        if ready_t[i] < t0:
            t0 = ready_t[i]
    if nj > 0:  # every pending arrival is >= the last wave's t0
        first = _earliest_job(times[0], queue)
        if first < t0:
            t0 = first
    horizon = t0 + window
    windowed = window > 0
    _dense_stage(t0, horizon, windowed, ready_ids, ready_t, ready_stage, nr, layer, pass_begin, pass_home, pass_dense,
                 backbone_free)
    m = 0
    for i in range(nr):
        if ready_stage[i] == 1 and ((ready_t[i] < horizon) if windowed else (ready_t[i] <= t0)):
            m += 1
    ids = np.empty(m, _I)
    q = 0
    w = 0
    for i in range(nr):
        t = ready_t[i]
        if ready_stage[i] == 1 and ((t < horizon) if windowed else (t <= t0)):
            ids[q] = ready_ids[i]
            start_t[ready_ids[i]] = t
            q += 1
        else:
            ready_ids[w] = ready_ids[i]
            ready_t[w] = t
            ready_stage[w] = ready_stage[i]
            w += 1
    counters[0] = w
    times[0] = t0
    times[1] = horizon
    for n in range(node_free.shape[0]):
        d = node_free[n] - t0
        load[n] = d if d > 0.0 else 0.0
    return ids, True


@njit(cache=True, inline="always")
def _rows(ids, layer, pass_row_start, pass_row_count, row_trace):
    """([Q] rows of the passes `ids` in order, [Q] their pass, [Q] the pass's layer, [Q] trace token)."""
    total = 0
    for i in range(ids.shape[0]):
        total += pass_row_count[ids[i]]
    rows = np.empty(total, _I)
    rpass = np.empty(total, _I)
    rlayer = np.empty(total, _I)
    rtok = np.empty(total, _I)
    q = 0
    for i in range(ids.shape[0]):
        p = ids[i]
        for j in range(pass_row_count[p]):
            r = pass_row_start[p] + j
            rows[q] = r
            rpass[q] = p
            rlayer[q] = layer[p]
            rtok[q] = row_trace[r]
            q += 1
    return rows, rpass, rlayer, rtok


@njit(cache=True, inline="always")
def _wave_step(has_wave, stamp, wave_ids, dec, passes, nodes, scenario, cost):
    """Finish the current wave (jobs of its decision, FIFO service, advance) and pick the next wave with
    decisions; waves without decisions are run through here. Returns (ids, rows, pass, layer, token, stamp,
    more).

    The arrays come in groups (`WaveEngine` builds them): dec (the wave's decision: [T] pass, layer, home,
    [T, K] node, expert, [T] location, next location), passes, nodes, scenario and cost. Grouped, every call
    here has few arguments, so numba inlines it (CPython passes a call of more than 30 arguments as *args,
    which numba's inliner refuses) and a wave pays no per-call reference counting of ~50 arrays.
    """
    dec_pass, dec_layer, dec_home, dec_node, dec_experts, dec_loc, dec_next = dec
    layer, start_t, done_t, outstanding, pass_begin, pass_end, mark, pass_home, pass_dense, ended = passes
    (window, times, first_stage, node_free, node_busy, ready_ids, ready_t, ready_stage, backbone_free, queue, counters,
     load) = nodes
    (pass_next, pass_request, pass_row_start, pass_row_count, request_next, request_first_pass, request_arrival, closed,
     think_s, row_trace) = scenario
    xfer, call1, flops, nbytes, peak, mem_bw, overhead, num_layers = cost
    windowed = window > 0
    if has_wave:
        _push_jobs(dec_pass, dec_layer, dec_home, dec_node, dec_experts, dec_loc, dec_next, start_t, done_t,
                   outstanding, pass_begin, layer, wave_ids, xfer, call1, flops, nbytes, peak, mem_bw, overhead,
                   num_layers, queue, counters)
    ids = wave_ids
    while True:
        if has_wave:
            touched = np.empty(ids.shape[0] + counters[1], _I)  # decided passes + every job's pass
            touched[:ids.shape[0]] = ids
            n_touched = _serve(times[0], times[1], windowed, queue, counters, node_free, node_busy, done_t,
                               outstanding, touched, ids.shape[0])
            stamp += 1
            _advance(touched, n_touched, ids.shape[0], mark, stamp, outstanding, layer, done_t, pass_end, ended, pass_next,
                     pass_request, request_next, request_first_pass, request_arrival, closed, think_s, num_layers,
                     ready_ids, ready_t, ready_stage, first_stage, counters)
        ids, more = _pick(window, queue, counters, ready_ids, ready_t, ready_stage, start_t, node_free, load, times,
                          layer, pass_begin, pass_home, pass_dense, backbone_free)
        if not more:
            e = np.empty(0, _I)
            return ids, e, e, e, e, stamp, False
        if ids.shape[0]:
            rows, rpass, rlayer, rtok = _rows(ids, layer, pass_row_start, pass_row_count, row_trace)
            return ids, rows, rpass, rlayer, rtok, stamp, True
        has_wave = True


@njit(cache=True)
def _wave_call(has_wave, stamp, wave_ids, dec, passes, nodes, scenario, cost):
    """`_wave_step` as a call of its own (the per-wave entry of the numpy policy path)."""
    return _wave_step(has_wave, stamp, wave_ids, dec, passes, nodes, scenario, cost)


class JobQueue:
    """The pending expert jobs of a run: a calendar queue (`_enqueue`, `_serve`, `_earliest_job`).

    Slots: jobs_f [C, 3] (arrival, service, trip back), jobs_i [C, 3] (pass, node, seq), next slot in the
    bucket's list [C], and a stack of free slots (its height in counters[3]). Buckets: a ring of B list heads
    and tails of width w. Every pending arrival lies in [t0, t0 + window + max transfer) (a pass starts
    before its wave's horizon and its calls arrive one transfer later), so B = that span / w + 3 buckets
    never fold two live buckets into one. Width w: about PER_BUCKET jobs a bucket if `in_flight` calls (users x
    K) spread over the span, at most 1/16 of the window (a wave then pops whole buckets but its last), and no
    narrower than span / MAX_BUCKETS (with window 0 a wave pops only its own instant). Narrow buckets keep
    `_serve`'s per-bucket sort an insertion sort; the width changes the speed, never the result.
    """

    MAX_BUCKETS = 1 << 14
    PER_BUCKET = 4

    def __init__(self, window: float, max_xfer: float, in_flight: int, counters: np.ndarray, capacity: int = 1024):
        if not np.isfinite(max_xfer):
            raise ValueError("context xfer_s: every transfer time must be finite (a node pair with no link?)")
        span = window + max_xfer
        crowded = span * self.PER_BUCKET / max(in_flight, 1)
        self.width = max(min(window / 16, crowded), span / (self.MAX_BUCKETS - 3)) or 1.0
        buckets = int(np.ceil(span / self.width)) + 3
        self.head = np.full(buckets, -1, _I)
        self.tail = np.full(buckets, -1, _I)
        self.counters = counters
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
        height = int(self.counters[3])
        free = np.empty(have + more, _I)
        free[:height] = self.free[:height]
        free[height:height + more] = np.arange(have + more - 1, have - 1, -1)
        self.free = free
        self.counters[3] = height + more
        self.due = np.empty(have + more, _I)

    def arrays(self):
        """The queue as the compiled functions take it."""
        return self.jobs_f, self.jobs_i, self.next, self.free, self.head, self.tail, self.width, self.due


class WaveEngine:
    """State of one fast-engine run: pass, job and node arrays (`run` receives pass_begin/end, busy time...).

    Use: `wave = engine.first()`; then, while `wave` is not None, decide its rows and call
    `wave = engine.step(decision, home)`. A wave is (rows, row_pass, row_layer, row_token, load [N]).
    """

    def __init__(self, ctx, sc, run, window_s: float):
        P, N = sc.num_passes, ctx.num_nodes
        self.window = float(window_s)
        self.times = np.zeros(2)
        self.layer = np.zeros(P, _I)
        self.start_t = np.zeros(P)
        self.done_t = np.zeros(P)
        self.outstanding = np.zeros(P, _I)
        self.mark = np.full(P, -1, _I)
        self.stamp = 0
        self.run = run
        self.sc = sc
        self.scenario_args = (
            sc.pass_next.astype(_I), sc.pass_request.astype(_I), sc.pass_row_start.astype(_I),
            sc.pass_row_count.astype(_I), sc.request_next.astype(_I), sc.request_first_pass.astype(_I),
            run.request_arrival, bool(sc.closed), float(sc.think_s), sc.row_trace.astype(_I),
        )
        roofline = (np.ascontiguousarray(ctx.expert_flops, float), np.ascontiguousarray(ctx.expert_bytes, float),
                    np.asarray(ctx.peak_flops, float), np.asarray(ctx.mem_bw_Bps, float), np.asarray(ctx.overhead_s, float))
        self.cost_args = (np.ascontiguousarray(ctx.xfer_s, float), one_token_calls(*roofline), *roofline,
                          int(ctx.num_layers))
        self.node_free = np.zeros(N)
        self.load = np.zeros(N)
        live = np.isfinite(sc.request_arrival)
        self.ready_ids = np.zeros(max(P, 1), _I)
        self.ready_t = np.zeros(max(P, 1))
        # Dense part (docs/runtime.md): a ready pass first runs its layer's dense work on its home's backbone
        # queue (stage 0), then is ready to decide (stage 1); with the dense part off it enters at stage 1.
        from .run import pass_dense_s

        self.first_stage = 0 if ctx.dense_on else 1
        self.ready_stage = np.full(max(P, 1), self.first_stage, _I)
        self.pass_home = np.asarray(ctx.user_home[sc.request_user[sc.pass_request]], _I)
        self.pass_dense = pass_dense_s(ctx, sc)
        self.backbone_free = np.full(N, -np.inf)
        first = sc.request_first_pass[live].astype(_I)
        self.ready_ids[:first.size] = first
        self.ready_t[:first.size] = sc.request_arrival[live]
        # ready passes, pending jobs, next job seq, free job slots, passes ended (`ended` holds them in end order)
        self.counters = np.array([first.size, 0, 0, 0, 0], _I)
        self.ended = np.zeros(max(P, 1), _I)
        in_flight = ctx.num_users * max(ctx.top_k, 1)
        self.queue = JobQueue(self.window, float(ctx.xfer_s.max(initial=0.0)), in_flight, self.counters)
        self.ids = np.zeros(0, _I)
        self._no_rows = np.zeros(0, _I)
        self._no_slots = np.zeros((0, max(ctx.top_k, 1)), _I)

    def first(self):
        return self._step(False, self._no_rows, self._no_rows, self._no_rows, self._no_slots, self._no_slots,
                          self._no_rows, self._no_rows)

    def step(self, row_pass, row_layer, home, dec):
        """Queue the jobs of `dec` (the Decision for the last wave's rows) and run to the next wave."""
        self._job_room(dec.node.size)
        return self._step(True, row_pass, row_layer, home.astype(_I, copy=False), dec.node.astype(_I, copy=False),
                          dec.experts.astype(_I, copy=False), dec.location.astype(_I, copy=False),
                          dec.next_location.astype(_I, copy=False))

    def _job_room(self, new_jobs: int) -> None:
        self.queue.room(int(self.counters[1]) + int(new_jobs))

    def _groups(self):
        """(passes, nodes, scenario, cost): the engine's arrays in `_wave_step`'s groups."""
        run = self.run
        passes = (self.layer, self.start_t, self.done_t, self.outstanding, run.pass_begin, run.pass_end, self.mark,
                  self.pass_home, self.pass_dense, self.ended)
        nodes = (self.window, self.times, self.first_stage, self.node_free, run.node_busy, self.ready_ids, self.ready_t,
                 self.ready_stage, self.backbone_free, self.queue.arrays(), self.counters, self.load)
        return passes, nodes, self.scenario_args, self.cost_args

    def _step(self, has_wave, row_pass, row_layer, home, node, experts, loc, nxt):
        ids, rows, rpass, rlayer, rtok, self.stamp, more = _wave_call(
            has_wave, self.stamp, self.ids, (row_pass, row_layer, home, node, experts, loc, nxt), *self._groups())
        if not more:
            return None
        self.ids = ids
        return rows, rpass, rlayer, rtok, self.load

    def first_wave(self):
        """The run's first wave (rows, pass, layer, token, load), no decisions before it; None: nothing to run."""
        zero = self._no_rows
        return self._step(False, zero, zero, zero, self._no_slots, self._no_slots, zero, zero)

    def run_rule(self, rule: str, ctx, state, trace, count, chunk_rows: int = 1 << 16) -> None:
        """Run the whole simulation with a compiled decision rule (RULES) in place of the policy's `decide`.

        state: the policy's TokenState of every row (location, layer, top-1 updated in place); count(dec,
        topk, layer, home, row_pass) receives the decisions in chunks of >= chunk_rows rows (the last smaller).
        """
        K = ctx.top_k
        wave = self.first_wave()
        if wave is None:
            return
        rows, rpass, rlayer, rtok, _ = wave
        ids = self.ids
        xfer = self.cost_args[0]
        rt = xfer + xfer.T  # the round trip xfer[c, n] + xfer[n, c] of choose_replicas, the same sum
        hold_ptr, hold_node, hold_compute = holder_lists(ctx.hosts, ctx.compute_s)
        # Every node usable (no device nodes): the search runs over per-location candidate lists sorted by
        # static cost (round trip + compute), built on first use, and stops early (`_decide_rows`).
        cand_ptr, cand_node, cand_compute = holder_lists(ctx.hosts, ctx.compute_s,
                                                         ctx.is_cloud if rule == "exact" else None)
        N = ctx.num_nodes
        sorted_on = bool(ctx.usable.all()) and N * max(cand_node.size, 1) <= SORTED_MAX_CELLS
        shape = (N, cand_node.size) if sorted_on else (1, 1)
        tables = (trace.topk, trace.gates, state.user, state.home, state.location, state.layer, state.prev_top1,
                  np.zeros(N), ctx.usable, ctx.hosts, rt, ctx.compute_s, hold_ptr, hold_node, hold_compute,
                  ctx.is_cloud, ctx.mode == "migrate", sorted_on, cand_ptr, cand_node, cand_compute, np.zeros(N, bool),
                  np.zeros(shape), np.zeros(shape, _I))
        cap = 0
        while True:
            if len(rows) > cap or cap == 0:  # decision buffers: a chunk plus the wave that ends it
                cap = max(2 * chunk_rows, 2 * len(rows))
                buf = (np.empty((cap, K), _I), np.empty((cap, K), _I), np.empty(cap, _I), np.empty(cap, _I),
                       np.empty(cap), np.empty((cap, K), _I), np.empty(cap, _I), np.empty(cap, _I), np.empty(cap, _I))
            self._job_room(len(rows) * K)
            ids, rows, rpass, rlayer, rtok, self.stamp, more, b = _drive(
                chunk_rows, RULES[rule], self.stamp, (ids, rows, rpass, rlayer, rtok), tables, buf, *self._groups())
            if b:
                experts, node, loc, nxt, lat, topk, lv, home, row_pass = (a[:b] for a in buf)
                count(Decision(experts=experts, node=node, location=loc, next_location=nxt, quality_cost=np.zeros(b),
                               latency_s=lat), topk, lv, home, row_pass)
            if not more:
                return


# ------------------------------------------------------------------- compiled decisions (exact, slimcaching, drop)
#
# Policies whose decision is a fixed rule of the context (`Policy.compiled_rule`) are decided inside the
# compiled loop too (`_drive`): a whole chunk of waves runs without coming back to Python. The rules repeat
# `edgemoe.runtime.policy`'s arithmetic operation for operation (choose_replicas, branch_ready_s,
# meeting_node), so each row gets the same node, meeting node and latency, bit for bit (tests pin it).

RULES = {"exact": 0, "slimcaching": 1, "drop": 2}  # rule name -> code of `_decide_rows`


SORTED_MAX_CELLS = 1 << 22  # per-location sorted candidate tables: N x candidates cells at most (64 MiB)


def holder_lists(hosts: np.ndarray, compute_s: np.ndarray, is_cloud: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of the nodes holding each (layer, expert): ([L * E + 1] start, [nnz] node, ascending per entry,
    [nnz] the node's compute seconds of that expert, contiguous for the replica search).

    is_cloud: given, the candidates of the "fallback" rule when every node is usable: the non-cloud holders
    if there are any, else the (cloud) holders."""
    N, L, E = hosts.shape
    held = np.moveaxis(np.asarray(hosts, bool), 0, -1).reshape(L * E, N)  # [(l, e), n]
    if is_cloud is not None and is_cloud.any():
        edge = held & ~is_cloud
        held = np.where(edge.any(axis=1, keepdims=True), edge, held)
    ptr = np.zeros(L * E + 1, _I)
    ptr[1:] = np.cumsum(held.sum(axis=1))
    le, node = np.nonzero(held)  # row-major: per (l, e), nodes in ascending order
    return ptr, node.astype(_I), np.moveaxis(compute_s, 0, -1).reshape(L * E, N)[le, node].astype(float)


@njit(cache=True)
def _sort_candidates(loc, rt, cand_ptr, cand_node, cand_compute, srt_static, srt_node):
    """Row `loc` of the sorted search's tables: each (layer, expert)'s candidates by static cost rt[loc, n] +
    compute (the brute force's first sum), ties in ascending node order (stable sort of ascending lists)."""
    for le in range(cand_ptr.shape[0] - 1):
        a, z = cand_ptr[le], cand_ptr[le + 1]
        if z == a:
            continue
        vals = np.empty(z - a)
        for i in range(a, z):
            vals[i - a] = rt[loc, cand_node[i]] + cand_compute[i]
        order = np.argsort(vals, kind="mergesort")
        for j in range(z - a):
            srt_static[loc, a + j] = vals[order[j]]
            srt_node[loc, a + j] = cand_node[a + order[j]]


@njit(cache=True, inline="always")
def _decide_rows(rule, rows, rpass, rlayer, rtok, tables, load, xfer, num_layers, out, b):
    """Decide the T rows of one wave by `rule` (RULES) into the buffers' rows b .. b + T and update the token
    state (location, next layer, top-1) as `Policy.decide` does.

    tables: (trace topk [Q, L, K], gates, token state user, home, location, layer, top-1 [R], [N] zeros (the
    load slimcaching sees), usable [U, N], hosts [N, L, E], rt [N, N] round trip xfer + xfer.T, compute
    [N, L, E], holder lists and their compute seconds (`holder_lists`), is_cloud [N], migrate, then the sorted
    search's parts: on, the rule's candidate lists (`holder_lists`), [N] built, [N, C] static cost and node
    per location); out: the decision buffers. The arithmetic is
    that of `exact_decision` / `DropPolicy.choose`: branch ready = (xfer + load) + compute, meeting node by
    the earliest finish among (token's node, slot nodes) with the trip home after the last layer.
    One of four copies of the layer rule (the others: `edgemoe.runtime.policy`, the reference;
    `plan.ordermoe.runtime_model.PathModel`; `runtime.policies.ordermoe_kernel`); pinned to the policies'
    own `decide` by tests/runtime/sim/test_sim_speed.py (`test_compiled_rule_is_the_policy_call_bit_for_bit`).
    """
    (topk_tab, gates_tab, st_user, st_home, st_loc, st_layer, st_top1, zero_load, usable, hosts, rt, compute, hold_ptr,
     hold_node, hold_compute, is_cloud, migrate, sorted_on, cand_ptr, cand_node, cand_compute, srt_built, srt_static,
     srt_node) = tables
    out_experts, out_node, out_loc, out_next, out_lat, out_topk, out_layer, out_home, out_pass = out
    K = topk_tab.shape[2]
    E = compute.shape[2]
    has_cloud = False
    for n in range(is_cloud.shape[0]):
        if is_cloud[n]:
            has_cloud = True
    seen = zero_load if rule == 1 else load
    ready = np.empty(K)
    for t in range(rows.shape[0]):
        r, lv, tok = rows[t], rlayer[t], rtok[t]
        o = b + t
        loc, home = st_loc[r], st_home[r]
        for k in range(K):
            e = topk_tab[tok, lv, k]
            out_topk[o, k] = e
            if hosts[loc, lv, e]:
                node = loc
            elif rule == 2:
                node = -1
            else:  # choose_replicas: the first holder (ascending index) with the least (round trip + compute) +
                # load among the usable ones; "fallback" (exact): the cloud only when no usable non-cloud node
                # holds it (np.argmin's first-index tie-break). Written out here: an inlined call with array
                # arguments would reference-count them per slot.
                u, le = st_user[r], lv * E + e
                if sorted_on and rule != 2:
                    if not srt_built[loc]:
                        _sort_candidates(loc, rt, cand_ptr, cand_node, cand_compute, srt_static, srt_node)
                        srt_built[loc] = True
                    # ascending static cost s (ties: lower node first); total = s + load >= s, so once s exceeds
                    # the best total no later candidate can reach it; equal totals go to the lower node index
                    best, node = np.inf, -1
                    for i in range(cand_ptr[le], cand_ptr[le + 1]):
                        s = srt_static[loc, i]
                        if s > best:
                            break
                        n = srt_node[loc, i]
                        c = s + seen[n]
                        if c < best or (c == best and n < node):
                            best, node = c, n
                    if node < 0:
                        node = 0
                    out_node[o, k] = node
                    out_experts[o, k] = e
                    ready[k] = (xfer[loc, node] + seen[node]) + compute[node, lv, e]
                    continue
                best_all, arg_all = np.inf, 0
                best_edge, arg_edge = np.inf, -1
                for i in range(hold_ptr[le], hold_ptr[le + 1]):
                    n = hold_node[i]
                    if not usable[u, n]:
                        continue
                    c = rt[loc, n] + hold_compute[i] + seen[n]
                    if c < best_all:
                        best_all, arg_all = c, n
                    if not is_cloud[n] and (arg_edge < 0 or c < best_edge):
                        best_edge, arg_edge = c, n
                node = arg_edge if rule == 0 and has_cloud and arg_edge >= 0 else arg_all
            out_node[o, k] = node
            out_experts[o, k] = e if node >= 0 else -1
            ready[k] = (xfer[loc, node] + seen[node]) + compute[node, lv, e] if node >= 0 else -np.inf
        if not migrate or K == 0:  # outputs return to the token's node
            nxt = loc
            lat = 0.0
            for k in range(K):
                node = out_node[o, k]
                v = ready[k] + (xfer[node, loc] if node >= 0 else 0.0)
                if v > lat:
                    lat = v
        else:  # earliest finish among the token's node and the slot nodes (first wins ties)
            nxt, lat = loc, np.inf
            for g in range(K + 1):
                c = loc if g == 0 else out_node[o, g - 1]
                if c < 0:
                    continue
                done = -np.inf
                for k in range(K):
                    node = out_node[o, k]
                    v = ready[k] + xfer[node if node > 0 else 0, c]
                    if v > done:
                        done = v
                if done < 0.0:  # np.maximum(done, 0.0)
                    done = 0.0
                done = done + (xfer[c, home] if lv == num_layers - 1 else 0.0)
                if done < lat:
                    nxt, lat = c, done
        out_loc[o] = loc
        out_next[o] = nxt
        out_lat[o] = lat
        out_layer[o] = lv
        out_home[o] = home
        out_pass[o] = rpass[t]
        st_loc[r] = nxt
        st_layer[r] += 1
        best = 0
        for k in range(1, K):
            if gates_tab[tok, lv, k] > gates_tab[tok, lv, best]:
                best = k
        st_top1[r] = topk_tab[tok, lv, best] if K else -1


@njit(cache=True)
def _drive(chunk_rows, rule, stamp, wave, tables, out, passes, nodes, scenario, cost):
    """Decide (`_decide_rows`) and run (`_wave_step`) waves, starting from the picked wave (ids, rows, pass,
    layer, token), until the run ends, the decision buffers `out` hold >= chunk_rows rows, or the next wave
    does not fit in them or in the job queue. Returns (next wave's ids, rows, pass, layer, token, stamp, more,
    rows in the buffers); the caller counts the buffered decisions, makes room if needed, and calls again."""
    ids, rows, rpass, rlayer, rtok = wave
    out_experts, out_node, out_loc, out_next, out_lat, out_topk, out_layer, out_home, out_pass = out
    load, jobs_f, counters = nodes[11], nodes[9][0], nodes[10]
    xfer, num_layers = cost[0], cost[7]
    K = tables[0].shape[2]
    b = 0
    more = True
    while True:
        T = rows.shape[0]
        if b + T > out_pass.shape[0] or counters[1] + T * K > jobs_f.shape[0]:
            break
        _decide_rows(rule, rows, rpass, rlayer, rtok, tables, load, xfer, num_layers, out, b)
        e = b + T
        dec = (out_pass[b:e], out_layer[b:e], out_home[b:e], out_node[b:e], out_experts[b:e], out_loc[b:e],
               out_next[b:e])
        ids, rows, rpass, rlayer, rtok, stamp, more = _wave_step(True, stamp, ids, dec, passes, nodes, scenario, cost)
        b = e
        if not more or b >= chunk_rows:
            break
    return ids, rows, rpass, rlayer, rtok, stamp, more, b
