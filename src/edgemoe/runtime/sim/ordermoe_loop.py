"""OrderMoE decided inside the fast engine's compiled wave loop (numba), bit for bit as the per-wave policy call.

`run_ordermoe` drives the simulation as `rules.run_rule` does for exact / slimcaching / drop, with the
whole OrderMoE decision of `edgemoe.runtime.policies.ordermoe` (`layer_options` + `OrderMoEPolicy.choose`) in
the compiled loop (`_decide_ordermoe`): exact's replica choice (rules' `_decide_rows`, rule "exact", run on a
scratch copy of the token state), the stand-in pricing of `edgemoe.plan.ordermoe.standins.choose_stand_ins`,
the budget state, the look-ahead lookup (`LookAhead.stacked`, paced), the steered search of
`ordermoe_kernel._steered_pick` or the unsteered meeting rule (`unsteered_meeting`), the adaptive weights
(alpha from the queue pressure and the per-user latency excess, beta from the per-user quality weight), the
queue-pressure EWMA (`_track`) and the feedback's per-pass estimate and spend (`Feedback.add`).

What stays in Python: `OrderMoEPolicy.observe` (the per-user EWMAs; it calls numpy's exp, whose last bit
the compiled code could not promise to match). The loop leaves the compiled call at exactly the policy
calls where `Feedback.flush` would observe finished passes (every `every`-th wave, when some pass has
finished since), the Python feedback observes them, and the loop goes on with the updated weights. The
decision arrays are counted in the same chunks as `_TallyBuffer` (the tally's quality sum is per chunk).

Same floating-point operations in the same order as the numpy path (sums left to right as numpy reduces
K <= 4 slots, exact maxima and minima, first index on ties); tests/runtime/sim/test_ordermoe_loop.py
compares every decision array with the numpy path, and tests/runtime/sim/test_sim_pinned.py pins the runs.
Configurations outside what it covers (`edgemoe.runtime.policies.ordermoe.compiled_loop_supported`) keep
the per-wave policy call.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgemoe.jit import njit

from ..policy import Decision, replica_shortlist
from .engine import _wave_step
from .jobqueue import C_ENDED, C_PENDING
from .rules import RULE_EXACT, _decide_rows, decision_buffers, rule_tables

_I = np.int64

# entries of `OrderMoETables.flags` (bool), `.ints` and `.params` (float)
F_SUB, F_DROP, F_ZERO, F_POWER2, F_STEER, F_ALL_NODES = range(6)
I_SHORT, I_CELLS, I_LEVELS, I_HORIZON, I_PACE = range(5)
P_QUALITY_PRICE, P_PRESSURE_GAIN, P_EWMA, P_RT_MED, P_STEP, P_EPS = range(6)
# entries of `FeedbackArrays.calls`: policy calls so far, passes ended when the policy last observed
FB_CALLS, FB_ENDED_SEEN = 0, 1


class OrderMoETables(NamedTuple):
    """The policy's own tables and weights as `_decide_ordermoe` reads them (`ordermoe_tables`)."""

    best_sub: np.ndarray  # [N, L, E] stand-in per (node, layer, expert) (-1: none)
    best_sub_err: np.ndarray  # [N, L, E] its error
    subst_err: np.ndarray  # [L, E, E]
    flags: np.ndarray  # F_* (bool)
    short_node: np.ndarray  # [N * L * E, S] the steered search's replica shortlist
    short_static: np.ndarray  # [N * L * E, S] its static cost (inf: padding)
    table: np.ndarray  # the look-ahead's stacked table, flat
    ints: np.ndarray  # I_*
    params: np.ndarray  # P_* (float)
    budget_total: np.ndarray  # [R] token state (`TokenState`); budget_used written in place
    budget_used: np.ndarray
    qpress: np.ndarray  # [1] the policy's queue_pressure (written in place)
    latency_excess: np.ndarray  # [U] the policy's weights (its observe updates them in place)
    quality_weight: np.ndarray  # [U]


class FeedbackArrays(NamedTuple):
    """`Feedback`'s per-pass arrays [P] as the compiled loop fills them."""

    estimate: np.ndarray
    spent: np.ndarray
    dense: np.ndarray
    observed: np.ndarray
    calls: np.ndarray  # [2] FB_*
    pass_end: np.ndarray


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


@njit(cache=True)
def _mean(a):  # pragma: no cover - compiled
    """float(a.mean()), bit for bit (0.0 for an empty array)."""
    if a.shape[0] == 0:
        return 0.0
    return _pairwise_sum(a) / a.shape[0]


@njit(cache=True)
def _work_arrays(K, N, J, G):  # pragma: no cover - compiled
    """The per-row scratch arrays of `_decide_ordermoe` (allocated once per `_drive_ordermoe` call, not per wave)."""
    M = 1 << K
    return (np.empty(K), np.empty(K, _I), np.empty(K), np.empty(K), np.empty((K, K)), np.empty((M, K), _I),
            np.empty((M, K)), np.empty((M, K)), np.empty(M), np.empty(M, np.bool_), np.empty(M, np.bool_), np.empty(M),
            np.empty(M, _I), np.empty(M), np.empty(K), np.empty(K), np.empty(K), np.empty((K, J), _I), np.empty((K, J)),
            np.empty(G, _I), np.empty((K, G)), np.empty((M, G)), np.empty(G), np.zeros(G), np.zeros(G, np.bool_),
            np.full(N, -1, _I), np.empty(K, _I))


@njit(cache=True, inline="always")
def _decide_ordermoe(rows, rpass, rlayer, rtok, ex, ex_scratch, scratch_out, om, work, load, xfer, num_layers, out,
                     extra, b):
    """OrderMoE's decision for the T rows of one wave into the buffers' rows b .. b + T, and the token state
    updated as `Policy.decide` does (location, budget used, layer, top-1), then the queue pressure (`_track`).

    ex / ex_scratch: rules' `_decide_rows` tables (`RuleTables`) on the real token state / on a scratch copy
    of it (exact's replica choice node_x comes from the scratch call into scratch_out); om: `OrderMoETables`;
    out: a `DecisionBuffers`; extra: (quality [B], zeroed [B, K])."""
    (topk_tab, gates_tab, st_user, st_home, st_loc, st_layer, st_top1, zero_load, usable, hosts, rt, compute, hold_ptr,
     hold_node, hold_compute, is_cloud, migrate, sorted_on, cand_ptr, cand_node, cand_compute, srt_built, srt_static,
     srt_node) = ex
    s_loc = ex_scratch.loc
    (best_sub, best_sub_err, subst_err, flags, short_node, short_static, table, ints, params, budget_total, budget_used,
     qpress, latency_excess, quality_weight) = om
    has_sub, has_drop, has_zero = flags[F_SUB], flags[F_DROP], flags[F_ZERO]
    power2, steer, all_nodes = flags[F_POWER2], flags[F_STEER], flags[F_ALL_NODES]
    n_short, C, levels, horizon, pace = ints[I_SHORT], ints[I_CELLS], ints[I_LEVELS], ints[I_HORIZON], ints[I_PACE]
    quality_price, pressure_gain, ewma = params[P_QUALITY_PRICE], params[P_PRESSURE_GAIN], params[P_EWMA]
    rt_med, step, eps = params[P_RT_MED], params[P_STEP], params[P_EPS]
    out_experts, out_node, out_loc, out_next, out_lat, out_topk, out_layer, out_home, out_pass = out
    out_quality, out_zeroed = extra
    x_node = scratch_out.node
    T = rows.shape[0]
    K = topk_tab.shape[2]
    N = xfer.shape[0]
    L = num_layers
    E = compute.shape[2]
    if not steer:  # `choose`: no budget in the wave and no steering -> exactly `exact`
        any_budget = False
        for t in range(T):
            if budget_total[rows[t]] > 0:
                any_budget = True
        if not any_budget:
            _decide_rows(RULE_EXACT, rows, rpass, rlayer, rtok, ex, load, xfer, num_layers, out, b)
            for t in range(T):
                out_quality[b + t] = 0.0
                budget_used[rows[t]] = budget_used[rows[t]] + 0.0
                for k in range(K):
                    out_zeroed[b + t, k] = False
            mean_load = _mean(load)
            qpress[0] += ewma * (mean_load / (mean_load + rt_med) - qpress[0])
            return
    for t in range(T):
        s_loc[rows[t]] = st_loc[rows[t]]
    _decide_rows(RULE_EXACT, rows, rpass, rlayer, rtok, ex_scratch, load, xfer, num_layers, scratch_out, 0)
    M = 1 << K
    J = 1 + n_short
    G = (1 + N if all_nodes else 1 + K * J) if steer else 1
    Cm = C * levels
    (g, sub, q_sub, q_zero, err, kind, p, q_alt, quality, valid, feasible, qterm, part, sub_ready, ready_x, ready_sub, w,
     cand, base, meet, arrive, kept_max, to_meet, home_leg, dup, seen, nodes_m) = work
    for n in range(N):
        seen[n] = -1
    for t in range(T):
        r, lv, tok = rows[t], rlayer[t], rtok[t]
        o = b + t
        loc, home, u = st_loc[r], st_home[r], st_user[r]
        last = lv == L - 1
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
            for j in range(K):
                err[k, j] = subst_err[lv, e, topk_tab[tok, lv, j]]
        drop_on = has_drop and K > 1
        for m in range(M):
            wsum = -0.0
            for j in range(K):
                w[j] = 0.0 if (m >> j) & 1 else g[j]
                wsum += w[j]
            all_gone = K > 0
            for k in range(K):
                qd = np.inf
                if drop_on and wsum > 0:
                    # np.einsum's order for K <= 4 (numpy 2.x, tested): even and odd j summed apart, then added
                    even, odd = 0.0, 0.0
                    for j in range(0, K, 2):
                        even += w[j] * err[k, j]
                    for j in range(1, K, 2):
                        odd += w[j] * err[k, j]
                    qd = g[k] * (even + odd) / wsum
                sub_first = q_sub[k] <= q_zero[k]
                q_sz = q_sub[k] if sub_first else q_zero[k]
                take_drop = (qd < q_sz) or (qd == q_sz and not sub_first)
                kind[m, k] = 1 if take_drop else (0 if sub_first else 2)
                p[m, k] = qd if take_drop else q_sz
                if not ((m >> k) & 1 and kind[m, k] != 0):
                    all_gone = False
            if all_gone:
                for k in range(K):
                    p[m, k] = np.inf
            if power2:
                layer_p = -0.0
                for k in range(K):
                    layer_p += p[m, k] if (m >> k) & 1 else 0.0
                for k in range(K):
                    if (m >> k) & 1:
                        q_alt[m, k] = p[m, k] * layer_p if np.isfinite(layer_p) else np.inf
                    else:
                        q_alt[m, k] = p[m, k] * p[m, k]
            else:
                for k in range(K):
                    q_alt[m, k] = p[m, k]
            ok = True
            qs = -0.0
            for k in range(K):
                if (m >> k) & 1:
                    if x_node[t, k] == loc or not np.isfinite(q_alt[m, k]):
                        ok = False
                    qs += q_alt[m, k] if np.isfinite(q_alt[m, k]) else 0.0
                else:
                    qs += 0.0
            valid[m] = ok
            quality[m] = qs
        # -- budget state, weights, look-ahead index (`choose`)
        total = budget_total[r]
        has_budget = total > 0
        left_b = total - budget_used[r]
        used = budget_used[r] / total if total > 0 else 0.0
        beta = quality_price * quality_weight[u] * used / ((lv + 0.5) / L)
        lx = latency_excess[u]
        alpha = 1.0 + pressure_gain * (qpress[0] + (lx if lx < 1.0 else 1.0))
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
        for m in range(M):
            left = left_b - quality[m]
            feasible[m] = valid[m] and left >= -1e-12 and (m == 0 or has_budget)
            qterm[m] = (beta + eps) * quality[m]
            if horizon > 0:
                ahead = left if left > 0.0 else 0.0
                if pace:
                    ahead = ahead * share
                lvl = np.floor(ahead / step + 1e-9)
                if lvl < 0:
                    lvl = 0
                if lvl > levels - 1:
                    lvl = levels - 1
                part[m] = ((lv + 1) * (N * Cm) + key * levels) + int(lvl)
        for k in range(K):
            n = x_node[t, k]
            e = topk_tab[tok, lv, k]
            ready_x[k] = (xfer[loc, n] + load[n]) + compute[n, lv, e]
            ready_sub[k] = (0.0 + load[loc]) + compute[loc, lv, sub[k] if sub[k] >= 0 else 0]
        for m in range(M):
            v = -np.inf
            for k in range(K):
                if (m >> k) & 1 and kind[m, k] == 0 and ready_sub[k] > v:
                    v = ready_sub[k]
            sub_ready[m] = v
        if not steer:
            # -- unsteered (`unsteered_meeting`), then argmin J over the M subsets
            best_cost, best_m, best_nxt, best_lat = np.inf, 0, loc, np.nan
            for m in range(M):
                if not migrate or K == 0:
                    back = -np.inf
                    for k in range(K):
                        if not (m >> k) & 1:
                            v = ready_x[k] + xfer[x_node[t, k], loc]
                            if v > back:
                                back = v
                    sr = sub_ready[m] + 0.0
                    lat = back if back > sr else sr
                    lat = lat if lat > 0.0 else 0.0
                    nxt = loc
                else:
                    nxt, lat = loc, np.inf
                    for gi in range(K + 1):
                        c = loc if gi == 0 else x_node[t, gi - 1]
                        if gi > 0 and (m >> (gi - 1)) & 1:
                            continue  # a slot not run exactly is no candidate
                        done = -np.inf
                        for k in range(K):
                            if not (m >> k) & 1:
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
                            nxt, lat = c, done
                if m == 0:
                    best_nxt, best_lat = nxt, lat  # numpy's argmin of an all-inf row: action 0
                if not feasible[m]:
                    continue
                seconds = lat + table[part[m] + nxt * Cm] if horizon > 0 else lat
                cost = alpha * seconds + qterm[m]
                if cost < best_cost:
                    best_cost, best_m, best_nxt, best_lat = cost, m, nxt, lat
            m = best_m
            for k in range(K):
                if (m >> k) & 1:
                    nodes_m[k] = loc if kind[m, k] == 0 else -1
                else:
                    nodes_m[k] = x_node[t, k]
            nxt, lat = best_nxt, best_lat
        else:
            # -- steered (`_steered_inputs` + `_steered_pick`)
            for k in range(K):
                e = topk_tab[tok, lv, k]
                flat = (loc * L + lv) * E + e
                for j in range(J):
                    n = x_node[t, k] if j == 0 else short_node[flat, j - 1]
                    ok = (j == 0 or np.isfinite(short_static[flat, j - 1])) and usable[u, n]
                    if not ok:
                        n = x_node[t, k]
                    cand[k, j] = n
                    base[k, j] = xfer[loc, n] + load[n] + compute[n, lv, e] if ok else np.inf
            meet[0] = loc
            if all_nodes:
                for n in range(N):
                    meet[1 + n] = n if usable[u, n] else loc
            else:
                for k in range(K):
                    for j in range(J):
                        meet[1 + k * J + j] = cand[k, j]
            for gi in range(G):
                dup[gi] = seen[meet[gi]] == t
                seen[meet[gi]] = t
                to_meet[gi] = xfer[loc, meet[gi]]
                if last:
                    home_leg[gi] = xfer[meet[gi], home]
            for k in range(K):
                for gi in range(G):
                    if dup[gi]:
                        continue
                    best = np.inf
                    for j in range(J):
                        v = base[k, j] + xfer[cand[k, j], meet[gi]]
                        if v < best:
                            best = v
                    arrive[k, gi] = best
            for gi in range(G):
                kept_max[0, gi] = -np.inf
            for s in range(1, M):
                low = 0
                while not (s >> low) & 1:
                    low += 1
                for gi in range(G):
                    if dup[gi]:
                        continue
                    kept_max[s, gi] = max(kept_max[s & (s - 1), gi], arrive[low, gi])
            best_cost = np.inf
            best_a = 0
            best_lat = np.nan
            for m in range(M):
                if not feasible[m]:
                    continue
                for gi in range(G):
                    if dup[gi]:
                        continue
                    lat = kept_max[M - 1 - m, gi]
                    lat = max(lat, sub_ready[m] + to_meet[gi])
                    lat = max(lat, 0.0)
                    if last:
                        lat = lat + home_leg[gi]
                    cost = alpha * lat + qterm[m]
                    if horizon > 0 and (alpha < 0 or cost < best_cost):
                        cost = alpha * (lat + table[part[m] + meet[gi] * Cm]) + qterm[m]
                    if cost < best_cost:
                        best_cost, best_a, best_lat = cost, m * G + gi, lat
            m, gi = best_a // G, best_a % G
            if best_lat != best_lat:
                lat = -np.inf
                for k in range(K):
                    if not (m >> k) & 1 and arrive[k, gi] > lat:
                        lat = arrive[k, gi]
                lat = max(max(lat, sub_ready[m] + to_meet[gi]), 0.0)
                if last:
                    lat = lat + home_leg[gi]
                best_lat = lat
            for k in range(K):
                if (m >> k) & 1:
                    nodes_m[k] = loc if kind[m, k] == 0 else -1
                    continue
                best = np.inf
                bj = 0
                for j in range(J):
                    v = base[k, j] + xfer[cand[k, j], meet[gi]]
                    if v < best:
                        best, bj = v, j
                nodes_m[k] = cand[k, bj]
            nxt, lat = meet[gi], best_lat
        # -- the decision (`pick_decision`) and the state update (`Policy.decide`)
        for k in range(K):
            e = topk_tab[tok, lv, k]
            out_topk[o, k] = e
            out_node[o, k] = nodes_m[k]
            if (m >> k) & 1:
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
    mean_load = _mean(load)
    qpress[0] += ewma * (mean_load / (mean_load + rt_med) - qpress[0])


@njit(cache=True)
def _drive_ordermoe(chunk_rows, every, stamp, b, wave, ex, ex_scratch, scratch_out, om, fb, out, extra, passes, nodes,
                    scenario, cost):  # pragma: no cover - compiled
    """Decide (`_decide_ordermoe`), feed back (`Feedback.add`) and run (`_wave_step`) waves from the picked
    one until the run ends, the buffers hold >= chunk_rows rows, the policy is due to observe finished
    passes (`Feedback.flush`: every `every`-th wave, when passes ended since the last observation; the
    engine logs ended passes in `ended`), or the next wave does not fit in the buffers or the job queue. fb:
    a `FeedbackArrays`. Returns (next wave's ids, rows, pass, layer, token, stamp, more, rows buffered, observe now)."""
    ids, rows, rpass, rlayer, rtok = wave
    estimate, spent, dense, observed, calls, pass_end = fb
    out_pass, out_lat = out.pass_, out.lat
    out_quality = extra[0]
    load, jobs_f, counters = nodes.load, nodes.queue.jobs_f, nodes.counters
    xfer, num_layers = cost.xfer, cost.num_layers
    K = ex.topk.shape[2]
    N = xfer.shape[0]
    J = 1 + om.ints[I_SHORT]
    steer, all_nodes = om.flags[F_STEER], om.flags[F_ALL_NODES]
    work = _work_arrays(K, N, J, (1 + N if all_nodes else 1 + K * J) if steer else 1)
    more = True
    observe = False
    while True:
        T = rows.shape[0]
        if b + T > out_pass.shape[0] or counters[C_PENDING] + T * K > jobs_f.shape[0] or T > scratch_out.pass_.shape[0]:
            break
        _decide_ordermoe(rows, rpass, rlayer, rtok, ex, ex_scratch, scratch_out, om, work, load, xfer, num_layers, out,
                         extra, b)
        t = 0
        while t < T:  # rows come grouped by pass
            p = rpass[t]
            slowest = 0.0
            q = 0.0
            while t < T and rpass[t] == p:
                v = out_lat[b + t]
                slowest = v if v > slowest or v != v else slowest
                q += out_quality[b + t]
                t += 1
            estimate[p] += slowest + dense[p]
            spent[p] += q
        e = b + T
        dec = (out_pass[b:e], out.layer[b:e], out.home[b:e], out.node[b:e], out.experts[b:e], out.loc[b:e],
               out.next[b:e])
        ids, rows, rpass, rlayer, rtok, stamp, more = _wave_step(True, stamp, ids, dec, passes, nodes, scenario, cost)
        b = e
        calls[FB_CALLS] += 1
        if calls[FB_CALLS] % every == 0 and counters[C_ENDED] > calls[FB_ENDED_SEEN]:  # passes ended since the last observation
            observe = True
        if not more or b >= chunk_rows or observe:
            break
    return ids, rows, rpass, rlayer, rtok, stamp, more, b, observe


def ordermoe_tables(policy, state):
    """The `om` group of `_decide_ordermoe`: the policy's stand-in tables, shortlist, look-ahead and weights.
    The weight arrays are the policy's own (observe updates them in place); qpress holds queue_pressure."""
    ctx = policy.ctx
    kinds = policy.kinds
    steer = bool(policy.steer)
    N = ctx.num_nodes
    if steer:
        short = replica_shortlist(ctx, "fallback")
        short.ensure(np.arange(N))
        size = short.node.shape[-1]
        n_short = min(policy.steer_replicas, size)
        short_node = np.ascontiguousarray(short.node.reshape(-1, size)[:, :n_short])
        short_static = np.ascontiguousarray(short.static.reshape(-1, size)[:, :n_short])
    else:
        n_short = 0
        short_node, short_static = np.zeros((1, 1), _I), np.zeros((1, 1))
    from edgemoe.runtime.policies.ordermoe import EPS_S_PER_Q, STEER_ALL_NODES

    _, _, C, levels = policy.lookahead.stacked.shape
    flags = np.array(["sub" in kinds, "drop" in kinds, "zero" in kinds, policy.power == 2.0, steer,
                      N <= STEER_ALL_NODES])
    ints = np.array([n_short, C, levels, policy.horizon, policy.pace], _I)
    params = np.array([policy.quality_price, policy.pressure_gain, policy.ewma, policy.rt_med, policy.grid.step,
                       EPS_S_PER_Q], float)
    return OrderMoETables(np.ascontiguousarray(ctx.best_sub, _I), np.ascontiguousarray(ctx.best_sub_err, float),
            np.ascontiguousarray(ctx.subst_err, float), flags, short_node, short_static,
            np.ascontiguousarray(policy.lookahead.stacked.reshape(-1)), ints, params, state.budget_total,
            state.budget_used, np.array([policy.queue_pressure]), policy.latency_excess, policy.quality_weight)


def run_ordermoe(engine, policy, state, trace, feedback, count, chunk_rows: int = 1 << 16) -> None:
    """Run the whole simulation of `engine` (a WaveEngine) with `policy` (OrderMoE, `compiled_loop_supported`)
    decided in the compiled loop. state: the policy's TokenState of every row (updated in place); feedback: the run's
    `Feedback` (its estimate, spent and observed arrays are filled here; its `observe` calls happen in
    Python); count(dec, topk, layer, home, row_pass) receives the decisions in `_TallyBuffer`'s chunks (the
    same rows: waves until >= chunk_rows, then the rest), as views of buffers reused afterwards."""
    ctx = policy.ctx
    K = ctx.top_k
    wave = engine.first_wave()
    if wave is None:
        return
    rows, rpass, rlayer, rtok, _ = wave
    ids = engine.ids
    for name in ("location", "layer", "prev_top1", "budget_used"):  # compiled code writes them in place
        setattr(state, name, np.ascontiguousarray(getattr(state, name)).copy())
    ex = rule_tables(ctx, state, trace, "exact")
    R = len(state)
    # the scratch state shares the sorted tables
    ex_scratch = ex._replace(loc=np.zeros(R, _I), layer=np.zeros(R, _I), top1=np.zeros(R, _I))
    om = ordermoe_tables(policy, state)
    qpress = om.qpress
    fb = FeedbackArrays(feedback.estimate, feedback.spent, feedback.dense, feedback.observed,
                        np.array([feedback.calls, 0], _I), engine.run.pass_end)

    def buffers(cap, keep=None, rows_kept=0):
        new = decision_buffers(cap, K)
        new_extra = (np.empty(cap), np.empty((cap, K), bool))
        if keep is not None:
            for a, old in zip(new + new_extra, keep[0] + keep[1], strict=True):
                a[:rows_kept] = old[:rows_kept]
        return new, new_extra

    cap = max(2 * chunk_rows, 2 * len(rows))
    out, extra = buffers(cap)
    scratch_out = buffers(max(len(rows), 1024))[0]
    b = 0
    while True:
        if b + len(rows) > cap:
            cap = max(2 * cap, b + 2 * len(rows))
            out, extra = buffers(cap, (out, extra), b)
        if len(rows) > scratch_out.experts.shape[0]:
            scratch_out = buffers(2 * len(rows))[0]
        engine._job_room(len(rows) * K)
        ids, rows, rpass, rlayer, rtok, engine.stamp, more, b, observe = _drive_ordermoe(
            chunk_rows, feedback.every, engine.stamp, b, (ids, rows, rpass, rlayer, rtok), ex, ex_scratch, scratch_out,
            om, fb, out, extra, *engine._groups())
        if observe:  # exactly where `Feedback.flush` observes, the same passes (ascending, as its flatnonzero)
            n_ended = int(engine.counters[C_ENDED])
            done = np.sort(engine.ended[int(fb.calls[FB_ENDED_SEEN]):n_ended])
            fb.calls[FB_ENDED_SEEN] = n_ended
            feedback.calls = int(fb.calls[FB_CALLS])
            feedback.observe(done)
        if b and (b >= chunk_rows or not more):
            experts, node, loc, nxt, lat, topk, lv, home, row_pass = (a[:b] for a in out)
            quality, zeroed = (a[:b] for a in extra)
            count(Decision(experts=experts, node=node, location=loc, next_location=nxt, quality_cost=quality,
                           latency_s=lat, zeroed=zeroed), topk, lv, home, row_pass)
            b = 0
        if not more:
            break
    feedback.calls = int(fb.calls[FB_CALLS])
    policy.queue_pressure = float(qpress[0])
