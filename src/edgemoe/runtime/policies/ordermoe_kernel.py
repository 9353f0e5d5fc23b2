"""OrderMoE's decision, compiled: the steered search over (stand-in subset, meeting node) actions
(`_steered_pick`), the whole per-row decision (`_decide_ordermoe`, which the simulator's compiled loop,
`edgemoe.runtime.sim.ordermoe_loop`, runs in its waves) and `decide` in one compiled call (`DecodePath`).

At 64 rows per call the numpy form of the steered decision spends its time on the [R, K, J, G] arrival times
and the [R, M, G] latency, look-ahead and cost arrays, a few dozen small array operations per call; this
kernel walks the same actions row by row without materialising them (ALGORITHMS.md §3.4.4),
and `steered_inputs` builds the candidates and meeting nodes it reads in one call instead of ~15.
It does the same floating-point operations in the same order as `layer_options` + `OrderMoEPolicy.choose`
(sums, exact maxima and minima, first index on ties), so it picks the same action and reports the same
bits; tests/runtime/policies/test_ordermoe_kernel.py checks that against the numpy path, which stays the reference
and the fallback without numba (`edgemoe.jit.HAVE_NUMBA`). One of four copies of the layer rule (the others:
`edgemoe.runtime.policy`, the reference; `runtime.sim.rules._decide_rows`; `plan.ordermoe.runtime_model.PathModel`).

`_decide_ordermoe` and `DecodePath` do the numpy path's operations in the same order too
(tests/runtime/sim/test_ordermoe_loop.py, tests/runtime/policies/test_ordermoe_kernel.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from edgemoe.jit import HAVE_NUMBA, njit, prefetch

from ..policy import _out_of_range, replica_shortlist
from ..sim.rules import RULE_EXACT, _decide_rows

_I = np.int64

# entries of `OrderMoETables.flags` (bool), `.ints` and `.params` (float)
F_SUB, F_DROP, F_ZERO, F_POWER2, F_STEER, F_ALL_NODES, F_BACKLOG, F_BACKLOG_MEAN, F_ALL_USABLE = range(9)
I_SHORT, I_CELLS, I_LEVELS, I_HORIZON, I_PACE, I_HOMES, I_ENUM = range(7)
P_QUALITY_PRICE, P_PRESSURE_GAIN, P_EWMA, P_RT_MED, P_STEP, P_EPS = range(6)


class OrderMoETables(NamedTuple):
    """The policy's own tables and weights as `_decide_ordermoe` reads them (`ordermoe_tables`)."""

    best_sub: np.ndarray  # [N, L, E] stand-in per (node, layer, expert) (-1: none)
    best_sub_err: np.ndarray  # [N, L, E] its error
    subst_err: np.ndarray  # [L, E, E]
    flags: np.ndarray  # F_* (bool)
    short_node: np.ndarray  # [N * L * E, S] int32 the steered search's replica shortlist (-1: padding)
    # the look-ahead's tables, flat (`LookAhead.flat`): `stacked` [L+1, N, C, m], then the per-home layers
    # `home` [D, Nh, N, C, m] (home_trip)
    table: np.ndarray
    ints: np.ndarray  # I_*
    params: np.ndarray  # P_* (float)
    budget_total: np.ndarray  # [R] token state (`TokenState`); budget_used written in place
    budget_used: np.ndarray
    qpress: np.ndarray  # [1] the policy's queue_pressure (written in place)
    latency_excess: np.ndarray  # [U] the policy's weights (its observe updates them in place)
    quality_weight: np.ndarray  # [U]
    # the look-ahead's exposure rows (`exposure.Exposure`; F_BACKLOG): entries span[2 row] .. span[2 row + 1] of node and
    # val, row expo_base[l] + (h' * N + g) * C + key with h' the home's row where expo_homes[l] > 1, else 0
    expo_val: np.ndarray
    expo_node: np.ndarray
    expo_span: np.ndarray  # [2 rows] flat (start, stop) of each row's entries (`exposure.Exposure.span`)
    expo_base: np.ndarray  # [L+2]
    expo_homes: np.ndarray  # [L+1]
    node_wait: np.ndarray  # [N] the policy's EWMA of each node's wait (F_BACKLOG_MEAN; updated in place)
    home_index: np.ndarray  # [N] each home node's row in the per-home tables (I_HOMES rows; zeros without home_trip)
    # [L+1] layer l's slot among the per-home layers (`LookAhead.home_slot`: the windows that reach the last layer
    # with home_trip), -1 where its table is the home-free stacked[l]
    home_slot: np.ndarray


@njit(cache=True)
def _steered_inputs(layer, location, topk, node_x, short, real, usable, xfer, load, comp, is_sub, ready_sub,
                    all_nodes):  # pragma: no cover - compiled (the numpy twin is tested)
    """`layer_options`' steered candidates, their ready times and the meeting nodes, in one call (the same
    values: the same sums in the same order).

    layer, location: [R]; topk, node_x: [R, K]; short, real: [R, K, S] shortlisted replicas; usable: [R, N];
    xfer [N, N]; load [N]; comp [N, L, E]; is_sub [R, M, K]; ready_sub [R, K]; all_nodes: meet at any usable
    node (else at the token's node or a candidate). Returns (cand, base [R, K, 1 + S], meet [R, G], sub_first [R, M])."""
    R, K, S = short.shape
    J = S + 1
    N = xfer.shape[0]
    M = is_sub.shape[1]
    G = 1 + N if all_nodes else 1 + K * J
    cand = np.empty((R, K, J), np.int64)
    base = np.empty((R, K, J))
    meet = np.empty((R, G), np.int64)
    sub_first = np.empty((R, M))
    for r in range(R):
        c, lr = location[r], layer[r]
        for k in range(K):
            for j in range(J):
                n = node_x[r, k] if j == 0 else short[r, k, j - 1]
                ok = (j == 0 or real[r, k, j - 1]) and usable[r, n]  # exact's own choice first
                if not ok:
                    n = node_x[r, k]
                cand[r, k, j] = n
                base[r, k, j] = xfer[c, n] + load[n] + comp[n, lr, topk[r, k]] if ok else np.inf
        meet[r, 0] = c
        if all_nodes:
            for n in range(N):
                meet[r, 1 + n] = n if usable[r, n] else c
        else:
            for k in range(K):
                for j in range(J):
                    meet[r, 1 + k * J + j] = cand[r, k, j]
        for m in range(M):
            v = -np.inf
            for k in range(K):
                if is_sub[r, m, k] and ready_sub[r, k] > v:
                    v = ready_sub[r, k]
            sub_first[r, m] = v
    return cand, base, meet, sub_first


def _read_only(a, dtype=None) -> np.ndarray:
    """`a` as a C-contiguous array of `dtype`, viewed read-only (no copy unless the layout or dtype differs).

    Why: numba compiles a function once per distinct argument signature, and read-only is part of an array's
    type; callers pass some arrays writable and others read-only (a context's tables are read-only, a view of a
    caller's work array is not), so the numpy path's compiled helpers take every input read-only and compile
    once."""
    view = np.ascontiguousarray(a, dtype).view()
    view.flags.writeable = False
    return view


def steered_inputs(layer, location, topk, node_x, short, real, usable, xfer, load, comp, is_sub, ready_sub,
                   all_nodes: bool):
    """(cand [R, K, J], base [R, K, J], meet [R, G], sub_first [R, M]): see `_steered_inputs`."""
    c = _read_only
    return _steered_inputs(c(layer, np.int64), c(location, np.int64), c(topk, np.int64), c(node_x, np.int64),
                           c(short, np.int64), c(real), c(usable), c(xfer, float), c(load, float), c(comp, float),
                           c(is_sub), c(ready_sub, float), bool(all_nodes))


@njit(cache=True, inline="always")
def _kept_max(kept_max, arrive, dup, M, G):  # pragma: no cover - compiled
    """kept_max[s, g] <- the latest arrival at meeting choice g over the slots in bit set s (all 2^K sets,
    M = 1 << K; -inf for the empty set), each set from the one without its lowest slot, as `max_over_kept`
    builds them; choices g marked in dup [G] are skipped. arrive: [K, G]; kept_max: [M, G]."""
    for g in range(G):
        kept_max[0, g] = -np.inf
    for s in range(1, M):
        low = 0
        while not (s >> low) & 1:
            low += 1
        for g in range(G):
            if dup[g]:
                continue
            kept_max[s, g] = max(kept_max[s & (s - 1), g], arrive[low, g])


@njit(cache=True)
def _steered_pick(base, cand, meet, xfer, mask, stand_node, sub_ready, location, home, last, feasible, qterm, alpha,
                  part, stride, table, use_table, wait, use_wait):  # pragma: no cover - compiled (the numpy twin is tested)
    """Per row r: the action a = m * G + g of least cost, its layer seconds and the node of each slot.

    base, cand [R, K, J]: when each candidate replica's output exists, and the replica; meet [R, G]; xfer [N, N];
    mask [R, M, K] slot replaced; stand_node [R, M, K] where a replaced slot runs (-1: not run); sub_ready
    [R, M] latest substitute ready time (-inf: none); location, home [R]; last [R] bool: last layer (add the
    trip home); feasible [R, M]; qterm [R, M] (beta + eps) x quality; alpha [R]; part [R, M] and stride:
    look-ahead flat index part + meet * stride into table (use_table False: no look-ahead); wait [R, G]: the
    meeting node's expected queue wait (`LookAhead.backlog_s`), added after the table (use_wait False: none).
    Returns (pick [R], latency [R], node [R, K])."""
    R, K, J = base.shape
    M = mask.shape[1]
    G = meet.shape[1]
    pick = np.zeros(R, np.int64)
    lat_out = np.empty(R)
    node = np.empty((R, K), np.int64)
    arrive = np.empty((K, G))
    # all 2^K subsets (`subset_bits`; the only mask with 2^K actions, prefixes included when K <= 1): the max
    # over every kept set built one slot at a time, as `max_over_kept` does; action m keeps the complement of m
    enumerated = M == 1 << K
    kept_max = np.empty((M, G))
    to_meet = np.empty(G)  # xfer[c, g]: a substitute's output to the meeting node
    home_leg = np.zeros(G)  # the trip home after the last layer
    # a meeting node named twice (the token's node, exact's choice among the shortlisted replicas) gives
    # equal costs, so its later copy never wins the first-index argmin: it is skipped
    dup = np.zeros(G, np.bool_)
    seen = np.full(xfer.shape[0], -1, np.int64)  # row that last named each node
    for r in range(R):
        c = location[r]
        for g in range(G):
            dup[g] = seen[meet[r, g]] == r
            seen[meet[r, g]] = r
            to_meet[g] = xfer[c, meet[r, g]]
            if last[r]:
                home_leg[g] = xfer[meet[r, g], home[r]]
        # each exact slot on the candidate whose output reaches g first (numpy: min over J of the sums)
        for k in range(K):
            for g in range(G):
                if dup[g]:
                    continue
                best = np.inf
                for j in range(J):
                    v = base[r, k, j] + xfer[cand[r, k, j], meet[r, g]]
                    if v < best:
                        best = v
                arrive[k, g] = best
        if enumerated:
            _kept_max(kept_max, arrive, dup, M, G)
        best_cost = np.inf
        best_a = 0  # numpy's argmin of an all-inf row
        best_lat = np.nan
        for m in range(M):
            if not feasible[r, m]:
                continue
            for g in range(G):
                if dup[g]:
                    continue
                if enumerated:
                    lat = kept_max[M - 1 - m, g]
                else:
                    lat = -np.inf
                    for k in range(K):
                        if not mask[r, m, k] and arrive[k, g] > lat:
                            lat = arrive[k, g]
                lat = max(lat, sub_ready[r, m] + to_meet[g])
                lat = max(lat, 0.0)
                if last[r]:
                    lat = lat + home_leg[g]
                # the look-ahead (and the wait) is >= 0 and rounding is monotone: an action whose cost without
                # it is no better than the best so far cannot win (skips the table read, changes no pick)
                cost = alpha[r] * lat + qterm[r, m]
                if use_table and (alpha[r] < 0 or cost < best_cost):
                    ahead = lat + table[part[r, m] + meet[r, g] * stride]
                    if use_wait:
                        ahead = ahead + wait[r, g]
                    cost = alpha[r] * ahead + qterm[r, m]
                if cost < best_cost:
                    best_cost, best_a, best_lat = cost, m * G + g, lat
        m, g = best_a // G, best_a % G
        if best_lat != best_lat:  # nothing finite: action best_a's latency all the same (numpy reports it)
            lat = -np.inf
            for k in range(K):
                if not mask[r, m, k] and arrive[k, g] > lat:
                    lat = arrive[k, g]
            lat = max(max(lat, sub_ready[r, m] + to_meet[g]), 0.0)
            if last[r]:
                lat = lat + home_leg[g]
            best_lat = lat
        pick[r], lat_out[r] = best_a, best_lat
        # each slot's node: a replaced slot's stand-in node, else the candidate that reaches g first (first on ties)
        for k in range(K):
            if mask[r, m, k]:
                node[r, k] = stand_node[r, m, k]
                continue
            best = np.inf
            bj = 0
            for j in range(J):
                v = base[r, k, j] + xfer[cand[r, k, j], meet[r, g]]
                if v < best:
                    best, bj = v, j
            node[r, k] = cand[r, k, bj]
    return pick, lat_out, node


def steered_pick(opt, part: np.ndarray | None, stride: int, table: np.ndarray, location: np.ndarray, home: np.ndarray,
                 last: np.ndarray, feasible: np.ndarray, qterm: np.ndarray, alpha: np.ndarray,
                 wait: np.ndarray | None = None):
    """(pick [T], latency [T], node [T, K]) for a steered `Options` built without its [T, M, G] latency
    (`layer_options(..., steered_latency=False)`): see `_steered_pick`. part: [T, M] look-ahead index or None (H = 0);
    wait: [T, G] the meeting nodes' expected queue waits or None."""
    use_table = part is not None
    if part is None:
        part = np.zeros(feasible.shape, np.int64)
    use_wait = wait is not None
    if wait is None:
        wait = np.zeros((1, 1))
    c = _read_only
    return _steered_pick(c(opt.cand_ready), c(opt.cand), c(opt.meet), c(opt.xfer_s), c(opt.mask), c(opt.node_m),
                         c(opt.sub_ready, float), c(location, np.int64), c(home, np.int64), c(last), c(feasible),
                         c(qterm, float), c(alpha, float), c(part, np.int64), int(stride), c(table), use_table,
                         c(wait, float), use_wait)


# ----------------------------------------------------------- the whole decision, row by row (`_decide_ordermoe`)


@njit(cache=True, inline="always")
def _block_sum(a, lo, n):  # pragma: no cover - compiled
    """numpy's pairwise sum of a block of n <= 128 values (8 accumulators from n = 8 on)."""
    if n < 8:
        res = -0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r = np.empty(8)
    for j in range(8):
        r[j] = a[lo + j]
    i = 8
    while i < n - n % 8:
        for j in range(8):
            r[j] += a[lo + i + j]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@njit(cache=True)
def _pairwise_sum(a):  # pragma: no cover - compiled
    """numpy's float64 sum of a (pairwise: halves of a multiple of 8 down to blocks of <= 128), the same
    additions in the same order; the recursion is walked with a stack (numba's cache breaks recursive functions)."""
    n = a.shape[0]
    if n <= 128:
        return _block_sum(a, 0, n)
    depth = 64
    s_lo, s_n, s_state = np.empty(depth, _I), np.empty(depth, _I), np.empty(depth, _I)
    vals = np.empty(depth)
    sp, vp = 1, 0
    s_lo[0], s_n[0], s_state[0] = 0, n, 0
    while sp > 0:
        lo, m, state = s_lo[sp - 1], s_n[sp - 1], s_state[sp - 1]
        if m <= 128:
            sp -= 1
            vals[vp] = _block_sum(a, lo, m)
            vp += 1
            continue
        half = m // 2
        half -= half % 8
        if state == 0:  # left half first
            s_state[sp - 1] = 1
            s_lo[sp], s_n[sp], s_state[sp] = lo, half, 0
            sp += 1
        elif state == 1:
            s_state[sp - 1] = 2
            s_lo[sp], s_n[sp], s_state[sp] = lo + half, m - half, 0
            sp += 1
        else:  # both halves done: left + right
            sp -= 1
            vals[vp - 2] = vals[vp - 2] + vals[vp - 1]
            vp -= 1
    return vals[0]


@njit(cache=True, inline="always")
def _sum8(a, n):  # pragma: no cover - compiled
    """numpy's sum of a[:n], 8 <= n <= 128 (`_block_sum` with its 8 accumulators as scalars: no allocation)."""
    r0, r1, r2, r3, r4, r5, r6, r7 = a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]
    i = 8
    while i < n - n % 8:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[i]
        i += 1
    return res


@njit(cache=True)
def _mean(a):  # pragma: no cover - compiled
    """float(a.mean()), bit for bit (0.0 for an empty array)."""
    if a.shape[0] == 0:
        return 0.0
    return _pairwise_sum(a) / a.shape[0]


@njit(cache=True, inline="always")
def weight_step(weight, step):  # pragma: no cover - compiled
    """The quality weight's multiplicative step of `OrderMoEPolicy.observe`: clip(weight x exp(step), 1e-3,
    1e3), NaN staying NaN. exp is the C library's (`math.exp`, what compiled code calls), not numpy's: numpy's
    float64 exp has its own AVX-512 code whose last bit differs from libm's on ~5% of arguments, so numpy's
    result would depend on the CPU, and the simulator's compiled loop could not take the step without leaving
    to Python. From 709 up the product is inf (libm's exp overflows at ~709.8; the clip gives 1e3 either way)."""
    v = weight * (math.inf if step > 709.0 else math.exp(step))  # (a NaN step gives NaN, as numpy's)
    if v < 1e-3:
        v = 1e-3
    if v > 1e3:
        v = 1e3
    return v


@njit(cache=True)
def weight_steps(weights, steps):  # pragma: no cover - compiled
    """`weight_step` of each (weight, step) pair [n], as a new array."""
    out = np.empty(weights.shape[0])
    for i in range(weights.shape[0]):
        out[i] = weight_step(weights[i], steps[i])
    return out


def action_count(K: int, max_enum_k: int) -> int:
    """M, the stand-in subsets `_decide_ordermoe` walks per row: all 2^K for K <= max_enum_k, else the K + 1 prefixes."""
    return 1 << K if K <= max_enum_k else K + 1


@njit(cache=True)
def _work_arrays(K, N, J, G, M):  # pragma: no cover - compiled
    """The per-row scratch arrays of `_decide_ordermoe` (allocated once per `_drive_ordermoe` call, not per wave);
    M: `action_count`."""
    return (np.empty(K), np.empty(K, _I), np.empty(K), np.empty(K), np.empty((K, K)), np.empty((M, K), _I),
            np.empty((M, K)), np.empty((M, K)), np.empty(M), np.empty(M, np.bool_), np.empty(M, np.bool_), np.empty(M),
            np.empty(M, _I), np.empty(M), np.empty(K), np.empty(K), np.empty(K), np.empty((K, J), _I), np.empty((K, J)),
            np.empty(G, _I), np.empty((K, G)), np.empty((M, G)), np.empty(G), np.zeros(G), np.full(N, -1, _I),
            np.empty(K, _I), np.empty(max(G, K + 1)), np.zeros(K, _I), np.zeros(M, _I), np.empty(K, _I),
            np.empty(K))


@njit(cache=True, inline="always")
def _backlog_s(expo_val, expo_node, expo_span, row, load, dev, keep, mean):  # pragma: no cover - compiled
    """`LookAhead.backlog_s` of one exposure row (`exposure.Exposure.rows`; in `_decide_ordermoe`, expo_row0 +
    g * C for a row meeting at g): its entries . waits, in node order from 0.0, where the waits are `load`, or
    with `mean` the row's own EWMA load + keep x dev (dev = node_wait - load), the numpy path's [T, N] matrix
    entry by entry, read where needed rather than filled per row."""
    s = 0.0
    for i in range(expo_span[2 * row], expo_span[2 * row + 1]):
        n = expo_node[i]
        s += expo_val[i] * ((load[n] + keep * dev[n]) if mean else load[n])
    return s


@njit(cache=True, inline="always")
def _exact_only(rows, flags, budget_total):  # pragma: no cover - compiled
    """`choose`'s shortcut: no steering and no row of the wave with a budget -> the wave is exactly `exact`'s.
    (One return: inlined, an early one would keep the reference counts of `_decide_ordermoe`'s arguments.)"""
    only = not flags[F_STEER]
    for t in range(rows.shape[0]):
        if budget_total[rows[t]] > 0:
            only = False
    return only


if HAVE_NUMBA:
    # The kernel's tables as one numba StructRef, passed by one pointer. numba passes an array argument as its
    # 7 to 11 machine words and a tuple of arrays as all of theirs, so handing `_decide_ordermoe` its ~100
    # arrays one by one made its caller copy ~780 words onto the stack every wave (perf: ~14% of the ordermoe
    # simulator's CPU at edge8, where a wave is ~3 rows). The kernel reads the fields once, at its top, and
    # LLVM prunes the reference counts of those reads as it does an argument's.
    from numba.experimental import structref as _structref

    from edgemoe.jit import UnliteralStructRef

    @_structref.register
    class KernelTablesType(UnliteralStructRef):
        pass

    class KernelTables(_structref.StructRefProxy):
        """ex (`RuleTables`), scratch_out (`DecisionBuffers`), om (`OrderMoETables`), work (`_work_arrays`), out
        (`DecisionBuffers`), extra (quality [B], zeroed [B, K]): what `_decide_ordermoe` reads and writes."""

    _structref.define_proxy(KernelTables, KernelTablesType, ["ex", "scratch_out", "om", "work", "out", "extra"])


@njit(cache=True)
def kernel_tables(ex, scratch_out, om, work, out, extra):  # pragma: no cover - compiled
    """A `KernelTables` made in compiled code: cached on disk, where the proxy's own constructor compiles anew in
    every process."""
    return KernelTables(ex, scratch_out, om, work, out, extra)


@njit(cache=True, error_model="numpy")
def _decide_ordermoe(rows, rpass, rlayer, rtok, kt, load, xfer, num_layers, b, mean_load):
    """OrderMoE's decision for the T rows of one wave into the buffers' rows b .. b + T, and the token state
    updated as `Policy.decide` does (location, budget used, layer, top-1), then the queue pressure.

    The caller first runs exact's rule (`rules._decide_rows`, RULE_EXACT) on the wave and passes mean_load =
    `_mean(load)`: when `_exact_only`, as the decision itself (into out at b, the state updated), and this
    kernel adds the rest (no quality spent, the EWMAs' steps); otherwise for its replica choice alone
    (x_node: nodes_only, into scratch_out at 0, the state untouched). It is the callers' (`_drive_ordermoe`,
    `_decode_call`) because a function that calls another compiled function or allocates an array keeps
    numba's reference counting of its array arguments (about 100 here, an atomic add and subtract each, every
    call), which LLVM's pruning drops only from a function that does neither and has one way out; so this one
    does neither, and takes numpy's error model (no exception exits). tests/runtime/sim/test_kernel_refcounts.py
    holds it to that: with the counts kept, those of the three per-wave calls (this one, `_decide_rows`,
    `engine._wave_step`) took 28% of the ordermoe simulator's CPU time.

    A function of its own, called once per wave (not inlined): `_drive_ordermoe` and `_decode_call` call
    the same compiled code, and each compiles in about half the CPU time it took with this body inlined
    into it (LLVM's cost grows faster than the function's size).

    kt: a `KernelTables`: ex, rules' `_decide_rows` tables (`RuleTables`) on the token state; om: `OrderMoETables`;
    work: `_work_arrays`; out: a `DecisionBuffers`; extra: (quality [B], zeroed [B, K]). Its fields are read here,
    once, before anything else (a read in a branch would keep its reference count)."""
    ex, scratch_out, om, work, out, extra = kt.ex, kt.scratch_out, kt.om, kt.work, kt.out, kt.extra
    (topk_tab, gates_tab, st_user, st_home, st_loc, st_layer, st_top1, usable, hosts, rt, compute, hold_ptr,
     hold_node, hold_compute, is_cloud, migrate, sorted_on, cand_ptr, cand_node, cand_compute, srt_built, srt_static,
     srt_node, _ready) = ex
    (best_sub, best_sub_err, subst_err, flags, short_node, table, ints, params, budget_total, budget_used,
     qpress, latency_excess, quality_weight, expo_val, expo_node, expo_span, expo_base, expo_homes, node_wait, home_index,
     home_slot) = om
    (g, sub, q_sub, q_zero, err, kind, p, q_alt, quality, valid, feasible, qterm, part, sub_ready, ready_x, ready_sub, w,
     cand, base, meet, arrive, kept_max, to_meet, home_leg, seen, nodes_m, wait, nv, mbits, rank, vals) = work
    has_sub, has_drop, has_zero = flags[F_SUB], flags[F_DROP], flags[F_ZERO]
    power2, steer, all_nodes = flags[F_POWER2], flags[F_STEER], flags[F_ALL_NODES]
    all_usable = flags[F_ALL_USABLE]  # every node usable by every user (no devices): the steered search skips the test
    backlog = flags[F_BACKLOG] and ints[I_HORIZON] > 0
    # `OrderMoEPolicy.mean_waits`: one EWMA step per row, row t pricing load + keep_t x dev with keep_t the running
    # product of (1 - ewma); node_wait holds dev = node_wait - load during the call, and the EWMA after its last
    # row at the end
    mean = backlog and flags[F_BACKLOG_MEAN] and rows.shape[0] > 0
    keep_c, keep = 1.0 - params[P_EWMA], 1.0  # keep: (1 - ewma)^(t+1) at row t, for both EWMAs
    if mean:
        for n in range(load.shape[0]):
            node_wait[n] = node_wait[n] - load[n]
    n_short, C, levels, horizon, pace = ints[I_SHORT], ints[I_CELLS], ints[I_LEVELS], ints[I_HORIZON], ints[I_PACE]
    homes = ints[I_HOMES]
    quality_price, pressure_gain = params[P_QUALITY_PRICE], params[P_PRESSURE_GAIN]
    rt_med, step, eps = params[P_RT_MED], params[P_STEP], params[P_EPS]
    # `OrderMoEPolicy.pressures`: the queue pressure, one EWMA step per row toward press_x, row t pricing
    # press_x + keep_t x (press_0 - press_x)
    press_x, press_0 = mean_load / (mean_load + rt_med), qpress[0]
    out_experts, out_node, out_loc, out_next, out_lat, out_topk, out_layer, out_home, out_pass = out
    out_quality, out_zeroed = extra
    x_node = scratch_out.node
    T = rows.shape[0]
    K = topk_tab.shape[2]
    N = xfer.shape[0]
    L = num_layers
    E = compute.shape[2]
    exact_only = _exact_only(rows, flags, budget_total)
    if exact_only:  # the caller's exact rule decided the wave: the rest of `choose` (the row loop below is skipped)
        for t in range(T):
            out_quality[b + t] = 0.0
            budget_used[rows[t]] = budget_used[rows[t]] + 0.0
            for k in range(K):
                out_zeroed[b + t, k] = False
            keep = keep * keep_c
    # The wave's rows lie scattered over the token state, and each row reads its state at its start, in its middle
    # and at its end: one cache miss after another. Their lines are asked for first, for the whole wave, so that the
    # misses overlap each other and the work (exact's replica choice below reads the location first)
    for t in range(T):
        r = rows[t]
        prefetch(st_loc, r)
        prefetch(st_home, r)
        prefetch(st_user, r)
        prefetch(budget_total, r)
        prefetch(budget_used, r)
        prefetch(st_layer, r)
        prefetch(st_top1, r)
    enumerated = K <= ints[I_ENUM]
    M = (1 << K) if enumerated else K + 1  # `action_count`
    full = (1 << K) - 1
    J = 1 + n_short
    Cm = C * levels
    for n in range(N):
        seen[n] = -1
    if enumerated:  # action m replaces the slots of its bits (`subset_bits`); prefixes: set per row
        for m in range(M):
            mbits[m] = m
    for t in range(0 if exact_only else T):
        keep = keep * keep_c  # this row's EWMAs: load + keep x dev, press_x + keep x (press_0 - press_x)
        r, lv, tok = rows[t], rlayer[t], rtok[t]
        o = b + t
        loc, home, u = st_loc[r], st_home[r], st_user[r]
        last = lv == L - 1
        # when each exact branch is ready where exact runs it (`branch_ready_s`)
        for k in range(K):
            n = x_node[t, k]
            ready_x[k] = (xfer[loc, n] + load[n]) + compute[n, lv, topk_tab[tok, lv, k]]
        if not enumerated:
            # the K + 1 prefixes (`prefix_masks`): prefix j replaces the j slots of least rank, the replaceable
            # (non-local) slots by decreasing ready time, then the others, each group in slot order (a stable sort)
            for k in range(K):
                rk = 0
                rep_k = x_node[t, k] != loc
                for k2 in range(K):
                    rep_2 = x_node[t, k2] != loc
                    if rep_2 and (not rep_k or ready_x[k2] > ready_x[k] or (ready_x[k2] == ready_x[k] and k2 < k)):
                        rk += 1
                    elif not rep_2 and not rep_k and k2 < k:
                        rk += 1
                rank[k] = rk
            for j in range(M):
                bits = 0
                for k in range(K):
                    if rank[k] < j:
                        bits |= 1 << k
                mbits[j] = bits
        # -- stand-ins (`stand_in_costs` -> `choose_stand_ins`)
        for k in range(K):
            e = topk_tab[tok, lv, k]
            g[k] = abs(gates_tab[tok, lv, k])
            if has_sub:
                sub[k] = best_sub[loc, lv, e]
                q_sub[k] = g[k] * best_sub_err[loc, lv, e] if sub[k] >= 0 else np.inf
            else:
                sub[k] = -1
                q_sub[k] = np.inf
            q_zero[k] = g[k] if has_zero else np.inf
        drop_on = has_drop and K > 1
        if drop_on:
            for k in range(K):
                e = topk_tab[tok, lv, k]
                for j in range(K):
                    err[k, j] = subst_err[lv, e, topk_tab[tok, lv, j]]
        for m in range(M):
            bm = mbits[m]  # the slots action m replaces
            wsum = -0.0
            if drop_on and bm:
                for j in range(K):
                    w[j] = 0.0 if (bm >> j) & 1 else g[j]
                if K < 8:
                    for j in range(K):
                        wsum += w[j]
                else:  # numpy's pairwise sum from 8 values on (`_block_sum`)
                    wsum = _sum8(w, K)
            # only the replaced slots (the bits of bm) are priced: a kept slot's kind, p and q_alt are never read;
            # every slot replaced and none by a substitute: the layer has no expert output left
            all_gone = bm == full and K > 0
            for k in range(K):
                if not (bm >> k) & 1:
                    continue
                qd = np.inf
                if drop_on and wsum > 0:
                    # np.einsum's order (numpy 2.x, two float64 lanes, tested for K = 1..19): even and odd j summed
                    # apart, each block of 8 from its last pair to its first, then the pairs left; the lanes added
                    even, odd = 0.0, 0.0
                    j = 0
                    while K - j >= 8:
                        e3 = w[j + 6] * err[k, j + 6] + even
                        o3 = w[j + 7] * err[k, j + 7] + odd
                        e2 = w[j + 4] * err[k, j + 4] + e3
                        o2 = w[j + 5] * err[k, j + 5] + o3
                        e1 = w[j + 2] * err[k, j + 2] + e2
                        o1 = w[j + 3] * err[k, j + 3] + o2
                        even = w[j] * err[k, j] + e1
                        odd = w[j + 1] * err[k, j + 1] + o1
                        j += 8
                    for i in range(j, K, 2):
                        even += w[i] * err[k, i]
                    for i in range(j + 1, K, 2):
                        odd += w[i] * err[k, i]
                    qd = g[k] * (even + odd) / wsum
                sub_first = q_sub[k] <= q_zero[k]
                q_sz = q_sub[k] if sub_first else q_zero[k]
                take_drop = (qd < q_sz) or (qd == q_sz and not sub_first)
                kind[m, k] = 1 if take_drop else (0 if sub_first else 2)
                p[m, k] = qd if take_drop else q_sz
                if kind[m, k] == 0:
                    all_gone = False
            if all_gone:
                for k in range(K):
                    p[m, k] = np.inf
            if power2:
                if K < 8:
                    layer_p = -0.0
                    for k in range(K):
                        layer_p += p[m, k] if (bm >> k) & 1 else 0.0
                else:
                    for k in range(K):
                        vals[k] = p[m, k] if (bm >> k) & 1 else 0.0
                    layer_p = _sum8(vals, K)
                for k in range(K):
                    if (bm >> k) & 1:
                        q_alt[m, k] = p[m, k] * layer_p if np.isfinite(layer_p) else np.inf
            else:
                for k in range(K):
                    if (bm >> k) & 1:
                        q_alt[m, k] = p[m, k]
            ok = True
            qs = -0.0
            for k in range(K):
                if (bm >> k) & 1:
                    if x_node[t, k] == loc or not np.isfinite(q_alt[m, k]):
                        ok = False
                    vals[k] = q_alt[m, k] if np.isfinite(q_alt[m, k]) else 0.0
                else:
                    vals[k] = 0.0
                qs += vals[k]
            if K >= 8:
                qs = _sum8(vals, K)
            valid[m] = ok
            quality[m] = qs
        # -- budget state, weights, look-ahead index (`choose`)
        total = budget_total[r]
        has_budget = total > 0
        left_b = total - budget_used[r]
        used = budget_used[r] / total if total > 0 else 0.0
        beta = quality_price * quality_weight[u] * used / ((lv + 0.5) / L)
        lx = latency_excess[u]
        alpha = 1.0 + pressure_gain * ((press_x + keep * (press_0 - press_x)) + (lx if lx < 1.0 else 1.0))
        share = 1.0
        if pace:
            rest = L - 1 - lv
            if rest < 1:
                rest = 1
            share = horizon / rest
            if share > 1.0:
                share = 1.0
        bk = 0  # the look-ahead key: the row's top-1 expert (`RoutingKeys` without set keys)
        for k in range(1, K):
            if gates_tab[tok, lv, k] > gates_tab[tok, lv, bk]:
                bk = k
        key = topk_tab[tok, lv, bk]
        # (`LookAhead.flat_index`) into the home's row of the per-home tables where layer lv + 1's table depends on
        # the home, else into the home-free stacked[lv + 1]
        slot = home_slot[lv + 1]
        hx = home_index[home]  # the home's row of the per-home tables (0 without home_trip: one row)
        expo_row0 = 0  # the exposure row (`Exposure.rows`) of this row meeting at node g is expo_row0 + g * C
        if backlog:
            expo_row0 = expo_base[lv + 1] + (hx if expo_homes[lv + 1] > 1 else 0) * N * C + key
        if slot >= 0:
            part0 = ((L + 1) + slot * homes + hx) * (N * Cm) + key * levels
        else:
            part0 = (lv + 1) * (N * Cm) + key * levels
        for m in range(M):
            left = left_b - quality[m]
            feasible[m] = valid[m] and left >= -1e-12 and (mbits[m] == 0 or has_budget)
            qterm[m] = (beta + eps) * quality[m]
            if horizon > 0 and feasible[m]:  # an infeasible action's look-ahead is never read
                ahead = left if left > 0.0 else 0.0
                if pace:
                    ahead = ahead * share
                lvl = np.floor(ahead / step + 1e-9)
                if lvl < 0:
                    lvl = 0
                if lvl > levels - 1:
                    lvl = levels - 1
                part[m] = part0 + int(lvl)
        for k in range(K):
            ready_sub[k] = (0.0 + load[loc]) + compute[loc, lv, sub[k] if sub[k] >= 0 else 0]
        for m in range(M):
            bm = mbits[m]
            v = -np.inf
            for k in range(K):
                if (bm >> k) & 1 and kind[m, k] == 0 and ready_sub[k] > v:
                    v = ready_sub[k]
            sub_ready[m] = v
        if not steer:
            # -- unsteered (`unsteered_meeting`), then argmin J over the M subsets
            if backlog:  # each candidate meeting node's expected queue wait (`LookAhead.backlog_s`)
                for gi in range(K + 1 if migrate else 1):
                    wait[gi] = _backlog_s(expo_val, expo_node, expo_span,
                                          expo_row0 + (loc if gi == 0 else x_node[t, gi - 1]) * C, load,
                                          node_wait, keep, mean)
            best_cost, best_m, best_nxt, best_lat = np.inf, 0, loc, np.nan
            for m in range(M):
                bm = mbits[m]
                if not migrate or K == 0:
                    back = -np.inf
                    for k in range(K):
                        if not (bm >> k) & 1:
                            v = ready_x[k] + xfer[x_node[t, k], loc]
                            if v > back:
                                back = v
                    sr = sub_ready[m] + 0.0
                    lat = back if back > sr else sr
                    lat = lat if lat > 0.0 else 0.0
                    nxt = loc
                    nxt_i = 0
                else:
                    nxt, lat, nxt_i = loc, np.inf, 0
                    for gi in range(K + 1):
                        c = loc if gi == 0 else x_node[t, gi - 1]
                        if gi > 0 and (bm >> (gi - 1)) & 1:
                            continue  # a slot not run exactly is no candidate
                        done = -np.inf
                        for k in range(K):
                            if not (bm >> k) & 1:
                                v = ready_x[k] + xfer[x_node[t, k], c]
                                if v > done:
                                    done = v
                        v = sub_ready[m] + xfer[loc, c]
                        if v > done:
                            done = v
                        if done < 0.0:
                            done = 0.0
                        done = done + (xfer[c, home] if last else 0.0)
                        if done < lat:
                            nxt, lat, nxt_i = c, done, gi
                if m == 0:
                    best_nxt, best_lat = nxt, lat  # numpy's argmin of an all-inf row: action 0
                if not feasible[m]:
                    continue
                if horizon > 0:
                    ix = part[m] + nxt * Cm
                    seconds = lat + table[ix]
                else:
                    seconds = lat
                if backlog:
                    seconds = seconds + wait[nxt_i]
                cost = alpha * seconds + qterm[m]
                if cost < best_cost:
                    best_cost, best_m, best_nxt, best_lat = cost, m, nxt, lat
            m = best_m
            for k in range(K):
                if (mbits[m] >> k) & 1:
                    nodes_m[k] = loc if kind[m, k] == 0 else -1
                else:
                    nodes_m[k] = x_node[t, k]
            nxt, lat = best_nxt, best_lat
        else:
            # -- steered (`_steered_inputs` + `_steered_pick`)
            # each slot's candidates (exact's choice, then its shortlisted replicas) that can run it, each node
            # once, in order: cand[k, :nv[k]], base[k, :nv[k]] when its output exists. An unusable one (whose
            # cost is infinite) or a node named again (the same sums) never reaches a meeting node strictly first
            for k in range(K):
                e = topk_tab[tok, lv, k]
                flat = (loc * L + lv) * E + e
                nk = 0
                for j in range(J):
                    n = x_node[t, k] if j == 0 else short_node[flat, j - 1]
                    if not ((j == 0 or n >= 0) and (all_usable or usable[u, n])):
                        continue
                    fresh = True
                    for i in range(nk):
                        if cand[k, i] == n:
                            fresh = False
                    if fresh:
                        cand[k, nk] = n
                        base[k, nk] = xfer[loc, n] + load[n] + compute[n, lv, e]
                        nk += 1
                nv[k] = nk
            # the meeting choices: the token's node, then every usable node, or each slot's exact choice and its
            # candidates (a candidate it cannot use is named as exact's choice), each node once, in the order
            # first named. A node named again gives the same costs, so its later copy never wins the
            # first-index argmin, and leaving it out changes no pick (about two in three of the 1 + K x J
            # choices at steer_replicas 4, K = 2: the shortlists name the same nodes)
            # Named first into meet[:nn] (at most 1 + K x J: exact's choice is named apart only when it is not its
            # slot's first candidate), then compacted in place (the kept index never passes the read one)
            meet[0] = loc
            nn = 1
            if all_nodes:
                for n in range(N):
                    meet[nn] = n if usable[u, n] else loc
                    nn += 1
            else:
                for k in range(K):
                    if nv[k] == 0 or cand[k, 0] != x_node[t, k]:
                        meet[nn] = x_node[t, k]
                        nn += 1
                    for i in range(nv[k]):
                        meet[nn] = cand[k, i]
                        nn += 1
            Gd = 0
            for gi in range(nn):
                n = meet[gi]
                if seen[n] == t:
                    continue
                seen[n] = t
                meet[Gd] = n
                to_meet[Gd] = xfer[loc, n]
                if last:
                    home_leg[Gd] = xfer[n, home]
                if backlog:
                    wait[Gd] = np.nan  # (read below only where an action there can still win: then computed once)
                Gd += 1
            # The look-ahead cells the action walk below may read, asked for before the arrivals are computed: the
            # table is large (its per-home layers take 201 MB at 256 servers) and each cell a cache miss, which the walk,
            # reading a cell only when the action can still win, would otherwise take one after another
            if horizon > 0:
                for m in range(M):
                    if feasible[m]:
                        for gi in range(Gd):
                            ix = part[m] + meet[gi] * Cm
                            prefetch(table, ix)
            if backlog:  # the same for the exposure rows: their offsets now, their entries once these are in
                for gi in range(Gd):
                    prefetch(expo_span, 2 * (expo_row0 + meet[gi] * C))
            # the least over a slot's candidates, one candidate (one row of xfer) at a time: the same minimum
            for k in range(K):
                for gi in range(Gd):
                    arrive[k, gi] = np.inf
                for i in range(nv[k]):
                    c, bv = cand[k, i], base[k, i]
                    for gi in range(Gd):
                        v = bv + xfer[c, meet[gi]]
                        if v < arrive[k, gi]:
                            arrive[k, gi] = v
            if enumerated:
                # `_kept_max` written out: an inlined call with array arguments reference-counts them every row
                for gi in range(Gd):
                    kept_max[0, gi] = -np.inf
                for s in range(1, M):
                    low = 0
                    while not (s >> low) & 1:
                        low += 1
                    for gi in range(Gd):
                        kept_max[s, gi] = max(kept_max[s & (s - 1), gi], arrive[low, gi])
            else:  # prefixes: action m's kept slots' latest arrival in row M - 1 - m, as the enumeration has it
                for m in range(M):
                    bm = mbits[m]
                    for gi in range(Gd):
                        v = -np.inf
                        for k in range(K):
                            if not (bm >> k) & 1 and arrive[k, gi] > v:
                                v = arrive[k, gi]
                        kept_max[M - 1 - m, gi] = v
            if backlog:
                for gi in range(Gd):
                    lo = expo_span[2 * (expo_row0 + meet[gi] * C)]
                    if lo < len(expo_val):  # (an empty last row points past the end)
                        prefetch(expo_val, lo)
                        prefetch(expo_node, lo)
            best_cost = np.inf
            best_a = 0
            best_lat = np.nan
            for m in range(M):
                if not feasible[m]:
                    continue
                for gi in range(Gd):
                    lat = kept_max[M - 1 - m, gi]
                    lat = max(lat, sub_ready[m] + to_meet[gi])
                    lat = max(lat, 0.0)
                    if last:
                        lat = lat + home_leg[gi]
                    cost = alpha * lat + qterm[m]
                    if horizon > 0 and (alpha < 0 or cost < best_cost):
                        ix = part[m] + meet[gi] * Cm
                        ahead = lat + table[ix]
                        # the wait (>= 0) only where the action can still win with the table's seconds added
                        if backlog and (alpha < 0 or alpha * ahead + qterm[m] < best_cost):
                            if wait[gi] != wait[gi]:
                                wait[gi] = _backlog_s(expo_val, expo_node, expo_span, expo_row0 + meet[gi] * C,
                                                      load, node_wait, keep, mean)
                            ahead = ahead + wait[gi]
                        cost = alpha * ahead + qterm[m]
                    if cost < best_cost:
                        best_cost, best_a, best_lat = cost, m * Gd + gi, lat
            m, gi = best_a // Gd, best_a % Gd
            if best_lat != best_lat:
                lat = -np.inf
                for k in range(K):
                    if not (mbits[m] >> k) & 1 and arrive[k, gi] > lat:
                        lat = arrive[k, gi]
                lat = max(max(lat, sub_ready[m] + to_meet[gi]), 0.0)
                if last:
                    lat = lat + home_leg[gi]
                best_lat = lat
            for k in range(K):
                if (mbits[m] >> k) & 1:
                    nodes_m[k] = loc if kind[m, k] == 0 else -1
                    continue
                best = np.inf
                node_k = x_node[t, k]  # (numpy: the first candidate, exact's choice, when none is finite)
                for i in range(nv[k]):
                    v = base[k, i] + xfer[cand[k, i], meet[gi]]
                    if v < best:
                        best, node_k = v, cand[k, i]
                nodes_m[k] = node_k
            nxt, lat = meet[gi], best_lat
        # -- the decision (`pick_decision`) and the state update (`Policy.decide`)
        for k in range(K):
            e = topk_tab[tok, lv, k]
            out_topk[o, k] = e
            out_node[o, k] = nodes_m[k]
            if (mbits[m] >> k) & 1:
                out_experts[o, k] = sub[k] if kind[m, k] == 0 else -1
                out_zeroed[o, k] = kind[m, k] == 2
            else:
                out_experts[o, k] = e
                out_zeroed[o, k] = False
        out_loc[o] = loc
        out_next[o] = nxt
        out_lat[o] = lat
        out_quality[o] = quality[m]
        out_layer[o] = lv
        out_home[o] = home
        out_pass[o] = rpass[t]
        st_loc[r] = nxt
        budget_used[r] = budget_used[r] + quality[m]
        st_layer[r] += 1
        st_top1[r] = topk_tab[tok, lv, bk] if K else -1
    if mean:  # node_wait (holding dev) <- the EWMA after the call's last row, load + keep x dev
        for n in range(N):
            node_wait[n] = load[n] + keep * node_wait[n]
    if T > 0:
        qpress[0] = press_x + keep * (press_0 - press_x)


def ordermoe_tables(policy, budget_total, budget_used, eps_s_per_q: float, steer_all_nodes: int) -> OrderMoETables:
    """The `om` group of `_decide_ordermoe`: the policy's stand-in tables, shortlist, look-ahead and weights,
    and the token state's budget arrays [R] (budget_used written in place). The weight arrays are the policy's
    own (observe updates them in place); qpress holds queue_pressure. eps_s_per_q, steer_all_nodes: the
    policy module's EPS_S_PER_Q and STEER_ALL_NODES (passed in: this module imports nothing of it)."""
    ctx = policy.ctx
    kinds = policy.kinds
    steer = bool(policy.steer)
    N = ctx.num_nodes
    if steer:
        short = replica_shortlist(ctx, "fallback")
        short.ensure(np.arange(N))
        size = short.node.shape[-1]
        n_short = min(policy.steer_replicas, size)
        # one int32 array (a padding entry, of infinite static cost, as -1): the kernel reads a quarter of the
        # bytes of the node and cost arrays, which at hundreds of nodes do not stay in cache
        short_node = np.where(np.isfinite(short.static.reshape(-1, size)[:, :n_short]),
                              short.node.reshape(-1, size)[:, :n_short], -1).astype(np.int32)
    else:
        n_short = 0
        short_node = np.zeros((1, 1), np.int32)
    _, _, C, levels = policy.lookahead.stacked.shape
    backlog = getattr(policy, "backlog", "off")
    flags = np.array(["sub" in kinds, "drop" in kinds, "zero" in kinds, policy.power == 2.0, steer,
                      N <= steer_all_nodes, backlog != "off", backlog == "mean",
                      bool(np.asarray(ctx.usable).all())])  # in F_* order
    la = policy.lookahead
    homes = len(la.homes) if la.home_trip else 1
    # (the horizon as at most L: the kernel reads it only as H > 0 and in the pace share min(1, H / rest), rest
    # <= L - 1, which is 1 from H = L - 1 on; an int64 holds any such value)
    ints = np.array([n_short, C, levels, min(policy.horizon, ctx.num_layers), policy.pace, homes, policy.max_enum_k],
                    _I)  # I_* order
    params = np.array([policy.quality_price, policy.pressure_gain, policy.ewma, policy.rt_med, policy.grid.step,
                       eps_s_per_q], float)  # P_* order
    return OrderMoETables(np.ascontiguousarray(ctx.best_sub, _I), np.ascontiguousarray(ctx.best_sub_err, float),
                          np.ascontiguousarray(ctx.subst_err, float), flags, short_node,
                          la.flat, ints, params,
                          budget_total,
                          budget_used, np.array([policy.queue_pressure]), policy.latency_excess, policy.quality_weight,
                          *_exposure_arrays(la), policy.node_wait,
                          np.ascontiguousarray(np.maximum(la.home_index, 0) if la.home_trip else np.zeros(N, _I), _I),
                          np.ascontiguousarray(la.home_slot, _I))


def _exposure_arrays(la) -> tuple[np.ndarray, ...]:
    """(val, node, span, base, homes) of the look-ahead's exposure rows, contiguous, as `_backlog_s` reads them,
    span flat ([2 rows]: row r's entries span[2r] .. span[2r + 1]); one-entry placeholders without `backlog`
    (F_BACKLOG is then off and nothing reads them)."""
    x = la.expo
    if x is None:
        return np.zeros(1), np.zeros(1, _I), np.zeros(2, np.int32), np.zeros(1, _I), np.zeros(1, _I)
    return (np.ascontiguousarray(x.val, float), np.ascontiguousarray(x.node, _I), np.ascontiguousarray(x.span).reshape(-1),
            np.ascontiguousarray(x.base, _I), np.ascontiguousarray(x.homes, _I))


# ---------------------------------------------------------------- decode: one `decide` call, one compiled call


if HAVE_NUMBA:
    # A `DecodePath`'s tables as one numba StructRef: one argument whose type numba reads off the object,
    # where the ~70 arrays of the tables passed as tuples cost the dispatcher a type check each, every call.
    from numba.experimental import structref as _structref

    from edgemoe.jit import UnliteralStructRef

    @_structref.register
    class DecodeTablesType(UnliteralStructRef):
        pass

    class DecodeTables(_structref.StructRefProxy):
        """kt (`KernelTables`), rows (0..cap-1), xfer [N, N], num_layers."""

    _structref.define_proxy(DecodeTables, DecodeTablesType, ["kt", "rows", "xfer", "num_layers"])


@njit(cache=True)
def _decode_tables(kt, rows, xfer, num_layers):  # pragma: no cover
    """A `DecodeTables` made in compiled code: cached on disk, where the proxy's own constructor compiles
    anew in every process (seconds)."""
    return DecodeTables(kt, rows, xfer, num_layers)


@njit(cache=True)
def _decode_call(tab, layer, topk, gates, load, user, home, location, state_layer, budget_total,
                 budget_used):  # pragma: no cover - compiled (tested against the numpy path)
    """`Policy.decide` + `OrderMoEPolicy.choose` for T rows at `layer`: the rows are copied into the tables'
    scratch state and routing, decided by `_decide_ordermoe` (the simulator loop's per-row decision), and
    the decision and the new state come back as fresh arrays.

    topk, gates [T, K]; load [N]; user, home, location, state_layer [T] int; budget_total, budget_used [T].
    Returns (ok: every row at `layer` and every input in range, experts [T, K], node [T, K], location [T] (a
    copy), next [T], quality [T], latency [T], zeroed [T, K], any zeroed, budget used [T], next layer [T],
    top-1 [T]). Not ok: nothing decided (`Policy.decide`'s checks then name what is wrong); the ranges are
    checked here because compiled code reads its tables unchecked: an expert id, user or node out of range
    would read outside them."""
    T, K = topk.shape
    kt = tab.kt
    ex, om, out, extra = kt.ex, kt.om, kt.out, kt.extra
    # (lower-case names: tests/test_numba_calls.py takes an upper-case argument for a module constant)
    n_nodes, n_users, n_experts = tab.xfer.shape[0], ex.usable.shape[0], ex.compute.shape[2]
    ok = load.shape[0] == n_nodes and user.shape[0] == T and home.shape[0] == T and location.shape[0] == T
    ok = ok and state_layer.shape[0] == T and budget_total.shape[0] == T and budget_used.shape[0] == T
    # `Policy.decide`'s range checks
    ok = ok and _out_of_range(topk, n_experts, load, user, n_users, home, location, n_nodes) < 0
    if ok:
        for t in range(T):
            if state_layer[t] != layer:
                ok = False
    if not ok:
        e2, e1, f1 = np.empty((0, K), np.int64), np.empty(0, np.int64), np.empty(0)
        return (False, e2, e2, e1, e1, f1, f1, np.empty((0, K), np.bool_), False, f1, e1, e1)
    for t in range(T):
        ex.user[t], ex.home[t], ex.loc[t], ex.layer[t] = user[t], home[t], location[t], layer
        om.budget_total[t], om.budget_used[t] = budget_total[t], budget_used[t]
        for k in range(K):
            ex.topk[t, layer, k] = topk[t, k]
            ex.gates[t, layer, k] = gates[t, k]
    rows = tab.rows[:T]
    rlayer = np.full(T, layer, np.int64)
    b0 = 0 * T  # an int64, not the literal 0: the simulator loop's compiled `_decide_ordermoe`, not a second one
    scratch_out, xfer, num_layers = kt.scratch_out, tab.xfer, tab.num_layers
    # exact's rule first, as `_decide_ordermoe` asks (the same lines as `_drive_ordermoe`'s)
    if _exact_only(rows, om.flags, om.budget_total):
        _decide_rows(np.int64(RULE_EXACT), rows, rows, rlayer, rows, ex, load, xfer, num_layers, out, b0,
                     np.bool_(False))
    else:
        _decide_rows(np.int64(RULE_EXACT), rows, rows, rlayer, rows, ex, load, xfer, num_layers, scratch_out,
                     np.int64(0), np.bool_(True))
    _decide_ordermoe(rows, rows, rlayer, rows, kt, load, xfer, num_layers, b0, _mean(load))
    zeroed = extra[1][:T].copy()
    any_zeroed = False
    for t in range(T):
        for k in range(K):
            if zeroed[t, k]:
                any_zeroed = True
    loc = np.empty(T, np.int64)
    loc[:] = location
    return (True, out.experts[:T].copy(), out.node[:T].copy(), loc, out.next[:T].copy(),
            extra[0][:T].copy(), out.lat[:T].copy(), zeroed, any_zeroed, om.budget_used[:T].copy(),
            ex.layer[:T].copy(), ex.top1[:T].copy())


_STATE_DTYPES = (("user", np.int64), ("home", np.int64), ("location", np.int64), ("layer", np.int64),
                 ("budget_total", np.float64), ("budget_used", np.float64))  # `DecodePath`: the fields it reads


class DecodePath:
    """OrderMoE's `decide` in one compiled call (`_decode_call`), for the backends that call the policy per
    layer (the local backend, the Ray actors, serving; decode at 1 row per call is the edge's common case).

    The per-row decision is the simulator loop's (`_decide_ordermoe`), so the picks, latencies and state
    updates are those of the numpy path bit for bit (tests/runtime/policies/test_ordermoe_kernel.py). The
    tables are built once, at the policy's first `decide`, from the policy as it is then (its parameters
    are fixed at construction; its adaptive weights are read in place on every call); `__call__` returns
    None where it does not apply (a [T] layer argument, no rows, shapes `decide` refuses, rows out of
    order), and `Policy.decide` then takes its own path, which raises the errors.
    """

    def __init__(self, policy, eps_s_per_q: float, steer_all_nodes: int, rows: int = 64):
        # the policy is not kept (it is passed to every call): `Policy.decide` keeps this path in a weak map
        # keyed by the policy, which a reference back would keep alive for ever
        self.eps, self.steer_all_nodes = float(eps_s_per_q), int(steer_all_nodes)
        ctx = policy.ctx
        self.K, self.L, self.N = ctx.top_k, ctx.num_layers, ctx.num_nodes
        self.zero_load = np.zeros(self.N)
        self._build(policy, max(int(rows), 1))

    def _build(self, pol, cap: int) -> None:
        """Tables of policy `pol` for calls of up to `cap` rows."""
        from types import SimpleNamespace

        from ..sim.rules import decision_buffers, rule_tables

        ctx, K, L, N = pol.ctx, self.K, self.L, self.N
        zi = lambda: np.zeros(cap, _I)  # noqa: E731 - scratch token-state columns
        state = SimpleNamespace(user=zi(), home=zi(), location=zi(), layer=zi(), prev_top1=zi())
        trace = SimpleNamespace(topk=np.zeros((cap, L, K), _I), gates=np.zeros((cap, L, K)))  # one layer filled a call
        ex = rule_tables(ctx, state, trace, "exact")
        om = ordermoe_tables(pol, np.zeros(cap), np.zeros(cap), self.eps, self.steer_all_nodes)
        J = 1 + int(om.ints[I_SHORT])
        G = (1 + N if om.flags[F_ALL_NODES] else 1 + K * J) if om.flags[F_STEER] else 1
        self.cap, self.om = cap, om
        work = _work_arrays(K, N, J, G, action_count(K, int(om.ints[I_ENUM])))
        # (ex, scratch_out, om, work, out, extra, rows, xfer, num_layers): kept as a tuple too, for the tests that
        # compile the kernels afresh with these argument types (tests/runtime/sim/test_kernel_refcounts.py)
        self.tables = (ex, decision_buffers(cap, K), om, work, decision_buffers(cap, K),
                       (np.empty(cap), np.empty((cap, K), np.bool_)), np.arange(cap, dtype=_I),
                       np.array(ctx.xfer_s, float), int(L))
        self.kt = kernel_tables(*self.tables[:6])
        self.tab = _decode_tables(self.kt, *self.tables[6:])

    def __call__(self, pol, layer, topk, gates, state, load_s):
        from ..policy import Decision

        om = self.om
        # the state's arrays as `Policy.start` makes them (another dtype would compile `_decode_call` anew, and a
        # field that is not an array has no dtype): anything else goes to `decide`'s own path and its checks
        for f, d in _STATE_DTYPES:
            a = getattr(state, f, None)
            if not isinstance(a, np.ndarray) or a.dtype != d or a.ndim != 1:
                return None
        T = state.user.shape[0]
        if not isinstance(layer, int | np.integer) or T == 0 or not 0 <= layer < self.L:
            return None
        # contiguous: one compiled signature for every caller (a column slice of a [T, L, K] trace would
        # otherwise compile a second, minutes on a busy host before numba's disk cache holds it)
        topk = np.ascontiguousarray(topk, dtype=_I)
        gates = np.ascontiguousarray(gates, dtype=float)
        if topk.shape != (T, self.K) or gates.shape != topk.shape:
            return None
        if T > self.cap or pol.latency_excess is not om.latency_excess or pol.quality_weight is not om.quality_weight:
            self._build(pol, max(T, self.cap))  # more rows than the tables hold, or the weights replaced
            om = self.om
        try:
            load = self.zero_load if load_s is None else np.asarray(load_s, dtype=float)
        except (TypeError, ValueError):
            return None
        if load.ndim != 1:
            return None
        om.qpress[0] = pol.queue_pressure
        (ok, experts, node, location, nxt, quality, lat, zeroed, any_zeroed, used, next_layer,
         top1) = _decode_call(self.tab, int(layer), topk, gates, load, state.user, state.home, state.location,
                              state.layer, state.budget_total, state.budget_used)
        if not ok:
            return None  # rows out of order or an input out of range: `decide`'s checks say which
        pol.queue_pressure = float(om.qpress[0])
        state.location, state.budget_used, state.layer, state.prev_top1 = nxt.copy(), used, next_layer, top1
        return Decision(experts=experts, node=node, location=location, next_location=nxt, quality_cost=quality,
                        latency_s=lat, zeroed=zeroed if any_zeroed else None)
