"""The simulator's fast engine: one run's pass, job and node arrays, advanced one wave at a time (numba; a
plain-Python fallback without it).

`WaveEngine` keeps the arrays of one run and advances it one wave at a time in a single compiled call
(`_wave_step`): it turns the wave's decision into jobs, serves the jobs that arrive within the wave in
per-node FIFO order (the calendar queue of `edgemoe.runtime.sim.jobqueue`), moves finished passes on, and
picks the passes the next wave decides. The policy call in between stays in numpy
(`edgemoe.runtime.sim.simulate.run_fast`), except for policies with a compiled rule (`Policy.compiled_rule`),
which `edgemoe.runtime.sim.rules` (exact, slimcaching, drop) and `edgemoe.runtime.sim.ordermoe_loop` decide
in the compiled loop too, a chunk of waves per call. The model and the wave rule are those of the module
docstring of `edgemoe.runtime.sim.simulate`; this module only makes them cheap.

Speed notes (measured with perf): numba reference-counts every array argument of a real call and of an
inlined call (an atomic add on entry, a subtract on exit), so the per-wave parts take grouped arrays (the
NamedTuples `Passes`, `Nodes`, `ScenarioArrays`, `Cost`), and the hot inner loops call nothing with array
arguments. LLVM's pruning removes those counts only from a function that calls no other compiled function,
allocates no array (the scratch arrays of `Passes` and `QueueArrays` instead), raises nothing (numpy's error
model), has one return, and whose inlined helpers' array arguments are not read in one branch alone; so
`_wave_step` (like the decision kernels `rules._decide_rows` and `ordermoe_kernel._decide_ordermoe`) is written
so, and tests/runtime/sim/test_kernel_refcounts.py reads their LLVM IR to hold them to it. With the counts
kept, they were 28% of the ordermoe simulator's CPU time at the 0.1 ms wave. CPython passes a call of more than 30
arguments as *args, which numba cannot inline: keep calls between compiled functions under that. `_wave_step`
itself is a call of its own, once per wave (not inlined): what runs it (`WaveEngine` from Python, `rules._drive`,
`ordermoe_loop._drive_ordermoe`) then shares one compiled copy, where each wave loop inlining its own took a
third of a cold start's compile time. A call is not free, though: numba passes an array argument as its 7 to 11
machine words and a NamedTuple of arrays as all of theirs, which the caller copies onto the stack every call;
for `_wave_step` (~470 words) that was 4% of the ordermoe simulator's CPU at edge8 (perf), where a wave holds ~3
rows. `ordermoe_kernel._decide_ordermoe` (~780 words, 7%) therefore takes its tables as one StructRef pointer
(`ordermoe_kernel.KernelTables`), read once at its top, where LLVM prunes the reads' reference counts as an
argument's.

Numbers: the event order is that of the earlier numpy formulation (same waves, same ready-list order, same
job seq), and the FIFO recursion is the reference engine's sequential `finish = max(free, arrival) +
service`, so with window 0 every pass ends exactly when the reference says. Busy time is summed per node in
service order, which can differ from creation order in the last bit (utilisation to ~1e-16).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgemoe.jit import njit

from .jobqueue import (
    C_ENDED,
    C_PENDING,
    C_READY,
    C_SEQ,
    JF_ARRIVAL,
    JF_BACK,
    JF_SERVICE,
    JI_NODE,
    JI_PASS,
    JI_SEQ,
    NUM_COUNTERS,
    JobQueue,
    QueueArrays,
    _earliest_job,
    _enqueue,
    _serve_due,
    _stable_sort,
)
from .run import pass_stage_s

_I = np.int64

T0, HORIZON = 0, 1  # entries of `Nodes.times`: the current wave's earliest time and its horizon (t0 + window)


class Passes(NamedTuple):
    """Per-pass arrays [P] of a run."""

    layer: np.ndarray  # the layer the pass is at (L: done)
    start_t: np.ndarray  # when its current layer's decision starts
    done_t: np.ndarray  # when its current layer ends (so far)
    outstanding: np.ndarray  # its jobs of the current layer not yet served
    pass_begin: np.ndarray  # `Run.pass_begin`
    pass_end: np.ndarray  # `Run.pass_end`
    mark: np.ndarray  # scratch: the stamp of the wave that last saw it
    pass_home: np.ndarray  # its user's home node
    pass_dense: np.ndarray  # one layer's backbone-stage seconds: dense (+ decision when charged; `pass_stage_s`)
    ended: np.ndarray  # log of ended passes, in end order (counters[C_ENDED] of them)
    # scratch [P] of `_wave_step`, which allocates nothing (see the module's speed notes)
    ids: np.ndarray  # the wave's picked passes (`_wave_step` returns a view of the first ones)
    fin: np.ndarray  # passes that finished their layer (`_advance`)
    order: np.ndarray  # ready-list positions to serve (`_dense_stage`)
    tmp: np.ndarray  # a merge sort's buffer


class Nodes(NamedTuple):
    """The wave rule, the per-node queues and the run's counters."""

    window: float
    times: np.ndarray  # [2] (T0, HORIZON) of the current wave
    first_stage: int  # 0: a ready pass runs its dense work first; 1: the dense part is off
    node_free: np.ndarray  # [N] when each node's expert queue is free
    node_busy: np.ndarray  # [N] `Run.node_busy`
    ready_ids: np.ndarray  # ready list: pass ids, ready times and stages (counters[C_READY] entries)
    ready_t: np.ndarray
    ready_stage: np.ndarray
    backbone_free: np.ndarray  # [N] when each home's backbone (dense work) is free
    queue: QueueArrays
    counters: np.ndarray  # the C_* entries of `edgemoe.runtime.sim.jobqueue`
    load: np.ndarray  # [N] the queue backlog the wave's decision sees: max(node_free - t0, 0)


class ScenarioArrays(NamedTuple):
    """The workload's passes and requests (`Scenario`) as the compiled code takes them."""

    pass_next: np.ndarray
    pass_request: np.ndarray
    pass_row_start: np.ndarray
    pass_row_count: np.ndarray
    request_next: np.ndarray
    request_first_pass: np.ndarray
    request_arrival: np.ndarray  # `Run.request_arrival` (closed-loop follow-ups written here)
    closed: bool
    think_s: float
    row_trace: np.ndarray
    wave_rows: tuple  # 4 x [R] scratch: a wave's rows, their pass, layer and token (`_rows_into`)


class Cost(NamedTuple):
    """The cost model's arrays: transfers and the roofline of expert calls."""

    xfer: np.ndarray  # [N, N] seconds
    call1: np.ndarray  # [N * L * E] one-token call seconds (`one_token_calls`)
    flops: np.ndarray  # [L, E]
    nbytes: np.ndarray  # [L, E]
    peak: np.ndarray  # [N]
    mem_bw: np.ndarray  # [N]
    overhead: np.ndarray  # [N]
    num_layers: int


@njit(cache=True, inline="always")
def _push_jobs(dec_pass, dec_layer, dec_home, dec_node, dec_experts, dec_loc, dec_next, start_t, done_t,
               outstanding, pass_begin, layer, wave_ids, n_ids, xfer, call1, flops, nbytes, peak, mem_bw, overhead,
               num_layers, queue, counters):
    """Jobs of one wave's decision (T rows, K slots; rows grouped by pass) added to the pending queue
    (`_enqueue`), each with arrival, service, trip back (jobs_f) and pass, node, seq (jobs_i). A pass's slots for
    the same expert on the same node share one batched call: each is charged roofline(count) / count.
    """
    T, K = dec_node.shape
    E = flops.shape[1]
    for i in range(n_ids):
        p = wave_ids[i]
        if layer[p] == 0 and not (pass_begin[p] == pass_begin[p]):  # nan: not begun at a dense stage
            pass_begin[p] = start_t[p]
        done_t[p] = start_t[p]
        outstanding[p] = 0
    new_f, new_i, keys, starts = queue.new_f, queue.new_i, queue.keys, queue.starts  # [T x K] jobs, [T + 1] passes
    n_pass = 0
    n = 0
    seq = counters[C_SEQ]
    r = 0
    while r < T:  # one pass (a run of rows with the same pass) at a time
        p = dec_pass[r]
        r_end = r
        while r_end < T and dec_pass[r_end] == p:
            r_end += 1
        first_job = n
        starts[n_pass] = n
        n_pass += 1
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
                new_i[n, JI_PASS] = p
                new_i[n, JI_NODE] = node
                new_i[n, JI_SEQ] = seq
                new_f[n, JF_ARRIVAL] = start + xfer[dec_loc[t], node]
                new_f[n, JF_BACK] = xfer[node, dec_next[t]] + trip_home
                new_f[n, JF_SERVICE] = dec_layer[t] * E + dec_experts[t, k]  # (layer, expert) key; priced below
                seq += 1
                n += 1
        outstanding[p] += n - first_job
        r = r_end
    starts[n_pass] = n
    _price_calls(new_f, new_i, starts, n_pass, keys, queue.order, queue.tmp, call1, flops, nbytes, peak, mem_bw,
                 overhead)
    counters[C_SEQ] = seq
    _enqueue(queue, counters, new_f, new_i, n)


@njit(cache=True, inline="always")  # once per wave: numba reference-counts an inlined call's array arguments too
def _price_calls(jobs_f, jobs_i, starts, n_pass, keys, order, tmp, call1, flops, nbytes, peak, mem_bw, overhead):
    """Service seconds of the jobs of each pass q (starts[q] .. starts[q + 1]): roofline(count) / count per
    (node, layer, expert).

    On entry jobs_f[j, JF_SERVICE] holds the job's layer * E + expert; on exit its service seconds. keys, order, tmp:
    scratch [>= m];
    call1 [N * L * E]: `_call_s` of one-token calls, precomputed (`one_token_calls`).
    """
    for q in range(n_pass):
        lo, hi = starts[q], starts[q + 1]
        m = hi - lo
        if m == 0:
            continue
        for j in range(m):
            keys[j] = jobs_i[lo + j, JI_NODE] * flops.size + int(jobs_f[lo + j, JF_SERVICE])
        if m <= 16:  # a decode pass (K jobs): count equal keys pairwise rather than sort
            for j in range(m):
                count = 0
                for i in range(m):
                    if keys[i] == keys[j]:
                        count += 1
                if count == 1:
                    jobs_f[lo + j, JF_SERVICE] = call1[keys[j]]
                else:
                    jobs_f[lo + j, JF_SERVICE] = _call_s(keys[j], count, flops, nbytes, peak, mem_bw, overhead)
            continue
        for j in range(m):
            order[j] = j
        _stable_sort(order, 0, m, keys, tmp, False)  # np.argsort(keys[:m], kind="mergesort")
        a = 0
        while a < m:
            b = a
            while b < m and keys[order[b]] == keys[order[a]]:
                b += 1
            service = _call_s(keys[order[a]], b - a, flops, nbytes, peak, mem_bw, overhead)
            for c in range(a, b):
                jobs_f[lo + order[c], JF_SERVICE] = service
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
def _advance(touched, n_touched, n_decided, mark, stamp, outstanding, layer, done_t, pass_end, ended, pass_next,
             pass_request, request_next, request_first_pass, request_arrival, closed, think_s, num_layers, ready_ids,
             ready_t, ready_stage, first_stage, counters, fin, tmp):
    """Passes among `touched` (the n_decided passes of the wave's decision, then the passes of the jobs
    served) with no job left finished their layer: next layer, next pass or next request.

    Appended to the ready list in the numpy formulation's order: passes going on (by id), then the next
    passes of the ended ones (by id), then the first passes of closed-loop follow-up requests (by id). Each
    enters at `first_stage`: 0 (its layer's dense work is still to run on the home's backbone) or 1 (ready to
    decide; the dense part is off).
    """
    k = 0  # fin[:k]: the finished passes (scratch [P]), each once, in touched order
    for i in range(n_touched):
        p = touched[i]
        if mark[p] != stamp:
            mark[p] = stamp
            if outstanding[p] == 0:
                fin[k] = p
                k += 1
    # No job served: the decided passes in ready-list order (as numpy did); else by pass id (np.unique of decided
    # + served passes). One sort for both (an empty range for the first), outside any branch: a branch would
    # keep the reference counts of `_wave_step`'s arguments (see the comment at `_pick`)
    served = n_touched != n_decided
    _stable_sort(fin, 0, k if served else 0, fin, tmp, True)
    nr = counters[C_READY]
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
            ended[counters[C_ENDED]] = p  # the log of ended passes (the ordermoe loop's feedback reads it)
            counters[C_ENDED] += 1
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
    counters[C_READY] = nr


@njit(cache=True, inline="always")
def _dense_stage(t0, horizon, windowed, ready_ids, ready_t, ready_stage, nr, layer, pass_begin, pass_home, pass_dense,
                 backbone_free, order, tmp):
    """Serve the ready entries at stage 0 before the horizon (at t0 for window 0) on their homes' backbone
    queues, FIFO in (time, ready-list) order: end = max(backbone free, ready) + the layer's dense seconds. Each
    becomes a stage-1 entry (ready to decide) at its end; a pass's first layer begins at its stage-0 time.
    order, tmp: scratch [>= nr]."""
    m = 0
    for i in range(nr):
        if ready_stage[i] == 0 and ((ready_t[i] < horizon) if windowed else (ready_t[i] <= t0)):
            order[m] = i
            m += 1
    _stable_sort(order, 0, m, ready_t, tmp, False)  # by time; equal times in ready-list order
    for j in range(m):
        i = order[j]
        p = ready_ids[i]
        if layer[p] == 0:
            pass_begin[p] = ready_t[i]
        h = pass_home[p]
        begin = backbone_free[h] if backbone_free[h] > ready_t[i] else ready_t[i]
        backbone_free[h] = begin + pass_dense[p]
        ready_t[i] = backbone_free[h]
        ready_stage[i] = 1


@njit(cache=True, inline="always")
def _pick(window, first_job, counters, ready_ids, ready_t, ready_stage, start_t, node_free, load, times, layer,
          pass_begin, pass_home, pass_dense, backbone_free, ids, order, tmp):
    """Next wave: t0 = earliest pending time (the ready passes' and first_job, the earliest pending job's
    arrival, `_earliest_job`); serve the dense work due before t0 + window (`_dense_stage`), then take the passes
    ready to decide before t0 + window (at t0 for window 0).

    Called with something pending (a ready pass or a job). Writes the picked pass ids to ids[:m] (ready-list
    order) and returns m; times <- (t0, horizon). order, tmp: scratch for `_dense_stage`.
    """
    nr = counters[C_READY]
    t0 = first_job
    for i in range(nr):
        if ready_t[i] < t0:
            t0 = ready_t[i]
    horizon = t0 + window
    windowed = window > 0
    _dense_stage(t0, horizon, windowed, ready_ids, ready_t, ready_stage, nr, layer, pass_begin, pass_home, pass_dense,
                 backbone_free, order, tmp)
    m = 0
    w = 0
    for i in range(nr):
        t = ready_t[i]
        if ready_stage[i] == 1 and ((t < horizon) if windowed else (t <= t0)):
            ids[m] = ready_ids[i]
            start_t[ready_ids[i]] = t
            m += 1
        else:
            ready_ids[w] = ready_ids[i]
            ready_t[w] = t
            ready_stage[w] = ready_stage[i]
            w += 1
    counters[C_READY] = w
    times[T0] = t0
    times[HORIZON] = horizon
    for n in range(node_free.shape[0]):
        d = node_free[n] - t0
        load[n] = d if d > 0.0 else 0.0
    return m


@njit(cache=True, error_model="numpy")
def _rows_into(ids, layer, pass_row_start, pass_row_count, row_trace, rows, rpass, rlayer, rtok):
    """The rows of the passes `ids`, in order, into rows[:Q] with their pass, the pass's layer and the trace
    token (rpass, rlayer, rtok); returns Q. Each row is one pass's, so Q <= R, the buffers' length. A call of its
    own that allocates nothing: numba then keeps no reference counts of its arguments (see the speed notes),
    where an inlined copy in the wave loops would count them every wave."""
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
    return q


@njit(cache=True)
def wave_rows(ids, layer, pass_row_start, pass_row_count, row_trace):
    """The rows of the passes `ids` as fresh arrays (rows, pass, layer, token), for the Python side
    (`WaveEngine`), whose policy call and tallies may keep them."""
    Q = 0
    for i in range(ids.shape[0]):
        Q += pass_row_count[ids[i]]
    rows, rpass, rlayer, rtok = np.empty(Q, _I), np.empty(Q, _I), np.empty(Q, _I), np.empty(Q, _I)
    _rows_into(ids, layer, pass_row_start, pass_row_count, row_trace, rows, rpass, rlayer, rtok)
    return rows, rpass, rlayer, rtok


@njit(cache=True, error_model="numpy")
def _wave_step(has_wave, stamp, wave_ids, dec, passes, nodes, scenario, cost):
    """Finish the current wave (jobs of its decision, FIFO service, advance) and pick the next wave with
    decisions; waves without decisions are run through here. Returns (ids, stamp, more): the picked passes (a
    view of the scratch `passes.ids`, valid until the next call; their rows: `_rows_into`, or `wave_rows` from Python).

    The arrays come in groups (`WaveEngine` builds them): dec (the wave's decision: [T] pass, layer, home,
    [T, K] node, expert, [T] location, next location), passes, nodes, scenario and cost. Grouped, every call
    here has few arguments (CPython passes a call of more than 30 arguments as *args, which numba's inliner
    refuses). Called once per wave, not inlined: see the module's speed notes, and why it allocates nothing,
    calls no other compiled function, has one return, raises nothing (numpy's error model) and reassigns no
    array variable.
    """
    (layer, start_t, done_t, outstanding, pass_begin, pass_end, mark, pass_home, pass_dense, ended, ids, fin, order,
     tmp) = passes
    (window, times, first_stage, node_free, node_busy, ready_ids, ready_t, ready_stage, backbone_free, queue, counters,
     load) = nodes
    (pass_next, pass_request, pass_row_start, pass_row_count, request_next, request_first_pass, request_arrival, closed,
     think_s, row_trace, _wave_rows) = scenario
    dec_pass, dec_layer, dec_home, dec_node, dec_experts, dec_loc, dec_next = dec
    xfer, call1, flops, nbytes, peak, mem_bw, overhead, num_layers = cost
    windowed = window > 0
    n_ids = wave_ids.shape[0]
    for i in range(n_ids):  # (wave_ids is mostly the last call's view of ids: the same entries)
        ids[i] = wave_ids[i]
    # The jobs of the wave's decision; without one (has_wave False: no ids, no rows) a no-op. Not under `if
    # has_wave`: an argument read only in a branch keeps numba's reference counts (see the comment at `_pick`)
    _push_jobs(dec_pass, dec_layer, dec_home, dec_node, dec_experts, dec_loc, dec_next, start_t, done_t, outstanding,
               pass_begin, layer, ids, n_ids, xfer, call1, flops, nbytes, peak, mem_bw, overhead, num_layers, queue,
               counters)
    more = True
    go = True
    while go:
        if has_wave:
            touched = queue.touched  # decided passes + every served job's pass
            for i in range(n_ids):
                touched[i] = ids[i]
            # (with no job pending it only walks the wave's empty buckets; the test `_serve` makes first would be a
            # branch that keeps the reference counts, see the comment at `_pick`)
            n_touched = _serve_due(times[T0], times[HORIZON], windowed, queue, counters, node_free, node_busy, done_t,
                                   outstanding, touched, n_ids)
            stamp += 1
            _advance(touched, n_touched, n_ids, mark, stamp, outstanding, layer, done_t, pass_end, ended, pass_next,
                     pass_request, request_next, request_first_pass, request_arrival, closed, think_s, num_layers,
                     ready_ids, ready_t, ready_stage, first_stage, counters, fin, tmp)
        # (the tests of pending work here, not inside the inlined `_pick` and `_serve_due`: numba's reference
        # counting of an inlined call's arguments is pruned when the call sits in a branch, not when a branch of
        # its body is all that reads an argument)
        more = counters[C_READY] > 0 or counters[C_PENDING] > 0
        first_job = np.inf
        if counters[C_PENDING] > 0:  # every pending arrival is >= the last wave's t0
            first_job = _earliest_job(times[T0], queue)
        n_ids = 0
        if more:
            n_ids = _pick(window, first_job, counters, ready_ids, ready_t, ready_stage, start_t, node_free, load,
                          times, layer, pass_begin, pass_home, pass_dense, backbone_free, ids, order, tmp)
        go = more and n_ids == 0
        has_wave = True
    return ids[:n_ids], stamp, more


class WaveEngine:
    """State of one fast-engine run: pass, job and node arrays (`run` receives pass_begin/end, busy time...).

    Use: `wave = engine.first()`; then, while `wave` is not None, decide its rows and call
    `wave = engine.step(decision, home)`. A wave is (rows, row_pass, row_layer, row_token, load [N]).
    """

    def __init__(self, ctx, sc, run, window_s: float, policy=None):
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
        self.scenario_args = ScenarioArrays(
            sc.pass_next.astype(_I), sc.pass_request.astype(_I), sc.pass_row_start.astype(_I),
            sc.pass_row_count.astype(_I), sc.request_next.astype(_I), sc.request_first_pass.astype(_I),
            run.request_arrival, bool(sc.closed), float(sc.think_s), sc.row_trace.astype(_I),
            tuple(np.empty(max(sc.row_trace.size, 1), _I) for _ in range(4)),
        )
        roofline = (np.ascontiguousarray(ctx.expert_flops, float), np.ascontiguousarray(ctx.expert_bytes, float),
                    np.asarray(ctx.peak_flops, float), np.asarray(ctx.mem_bw_Bps, float), np.asarray(ctx.overhead_s, float))
        # xfer_s as a writable copy: make_context's is read-only and distributed/measure's writable, and numba
        # compiles the wave loops once per distinct signature (read-only is part of an array's type)
        self.cost_args = Cost(np.array(ctx.xfer_s, float), one_token_calls(*roofline), *roofline,
                              int(ctx.num_layers))
        self.node_free = np.zeros(N)
        self.load = np.zeros(N)
        live = np.isfinite(sc.request_arrival)
        self.ready_ids = np.zeros(max(P, 1), _I)
        self.ready_t = np.zeros(max(P, 1))
        # Dense part (docs/runtime.md): a ready pass first runs its layer's dense work (and, when the policy's
        # decisions are charged, its decision) on its home's backbone queue (stage 0), then is ready to decide
        # (stage 1); with neither it enters at stage 1.
        self.pass_dense, staged = pass_stage_s(ctx, sc, policy)
        self.first_stage = 0 if staged else 1
        self.ready_stage = np.full(max(P, 1), self.first_stage, _I)
        self.pass_home = np.asarray(ctx.user_home[sc.request_user[sc.pass_request]], _I)
        self.backbone_free = np.full(N, -np.inf)
        first = sc.request_first_pass[live].astype(_I)
        self.ready_ids[:first.size] = first
        self.ready_t[:first.size] = sc.request_arrival[live]
        self.counters = np.zeros(NUM_COUNTERS, _I)  # the C_* entries (`edgemoe.runtime.sim.jobqueue`)
        self.counters[C_READY] = first.size
        self.ended = np.zeros(max(P, 1), _I)
        in_flight = ctx.num_users * max(ctx.top_k, 1)
        self.queue = JobQueue(self.window, float(ctx.xfer_s.max(initial=0.0)), in_flight, self.counters, passes=P)
        self.scratch = tuple(np.zeros(max(P, 1), _I) for _ in range(4))  # `Passes`' ids, fin, order, tmp
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
        """Room in the job queue (and its scratch) for the pending jobs and new_jobs more."""
        self.queue.room(int(self.counters[C_PENDING]) + int(new_jobs))

    def _groups(self) -> tuple[Passes, Nodes, ScenarioArrays, Cost]:
        """(passes, nodes, scenario, cost): the engine's arrays in `_wave_step`'s groups."""
        run = self.run
        passes = Passes(self.layer, self.start_t, self.done_t, self.outstanding, run.pass_begin, run.pass_end,
                        self.mark, self.pass_home, self.pass_dense, self.ended, *self.scratch)
        nodes = Nodes(self.window, self.times, self.first_stage, self.node_free, run.node_busy, self.ready_ids,
                      self.ready_t, self.ready_stage, self.backbone_free, self.queue.arrays(), self.counters, self.load)
        return passes, nodes, self.scenario_args, self.cost_args

    def _step(self, has_wave, row_pass, row_layer, home, node, experts, loc, nxt):
        ids, self.stamp, more = _wave_step(
            has_wave, self.stamp, self.ids, (row_pass, row_layer, home, node, experts, loc, nxt), *self._groups())
        if not more:
            return None
        self.ids = ids  # (a view of the scratch `Passes.ids`, which the next call reads first)
        sa = self.scenario_args
        return (*wave_rows(ids, self.layer, sa.pass_row_start, sa.pass_row_count, sa.row_trace), self.load)

    def first_wave(self):
        """The run's first wave (rows, pass, layer, token, load), no decisions before it; None: nothing to run."""
        zero = self._no_rows
        return self._step(False, zero, zero, zero, self._no_slots, self._no_slots, zero, zero)
