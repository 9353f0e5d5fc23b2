"""OrderMoE decided inside the fast engine's compiled wave loop (numba), bit for bit as the per-wave policy call.

`run_ordermoe` drives the simulation as `rules.run_rule` does for exact / slimcaching / drop, with the
whole OrderMoE decision of `edgemoe.runtime.policies.ordermoe` (`layer_options` + `OrderMoEPolicy.choose`) in
the compiled loop (`ordermoe_kernel._decide_ordermoe`, the per-row decision the policy's own decode path
also runs): exact's replica choice (rules' `_decide_rows`, rule "exact", nodes only), the stand-in pricing of `edgemoe.plan.ordermoe.standins.choose_stand_ins`,
the budget state, the look-ahead lookup (`LookAhead.stacked`, paced), the steered search of
`ordermoe_kernel._steered_pick` or the unsteered meeting rule (`unsteered_meeting`), the adaptive weights
(alpha from the queue pressure and the per-user latency excess, beta from the per-user quality weight), the
queue-pressure EWMA (`OrderMoEPolicy.pressures`) and the feedback's per-pass estimate and spend (`Feedback.add`).

The feedback too: at exactly the policy calls where `Feedback.flush` would observe finished passes (every
`every`-th wave, when some pass has finished since), the compiled `_observe_ended` does `Feedback.observe` +
`OrderMoEPolicy.observe` (the per-user latency excess and spend rate, the EWMA weights from a table of
numpy's own powers, the quality weights' step `ordermoe_kernel.weight_step`, whose exp is the C library's
on both paths), and the loop goes on with the updated weights. It returns to Python only when its decision
buffers are full or the run ends. Every table the loop reads travels in one `LoopTables` StructRef (one
argument: numba's dispatcher type-checks each array argument of a call, ~150 of them here). The decision
arrays are counted in the same chunks as `_TallyBuffer` (the tally's quality sum is per chunk).

Same floating-point operations in the same order as the numpy path (sums over the K slots in numpy's
pairwise order, np.einsum's order in the drop price, exact maxima and minima, first index on ties; all
2^K subsets or the K + 1 prefixes); tests/runtime/sim/test_ordermoe_loop.py
compares every decision array with the numpy path, and tests/runtime/sim/test_sim_pinned.py pins the runs.
Configurations outside what it covers (`edgemoe.runtime.policies.ordermoe.compiled_loop_supported`) keep
the per-wave policy call.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgemoe.jit import HAVE_NUMBA, njit

from ..policies.ordermoe_kernel import (
    F_ALL_NODES,
    F_STEER,
    I_ENUM,
    I_SHORT,
    _decide_ordermoe,
    _exact_only,
    _mean,
    _work_arrays,
    action_count,
    kernel_tables,
    ordermoe_tables,
    weight_step,
)
from ..policy import Decision
from .engine import _rows_into, _wave_step
from .jobqueue import C_ENDED, C_PENDING
from .rules import RULE_EXACT, _decide_rows, decision_buffers, rule_tables

_I = np.int64

# entries of `FeedbackArrays.calls`: policy calls so far, passes ended when the policy last observed
FB_CALLS, FB_ENDED_SEEN = 0, 1
# entries of `ObserveArrays.consts`: `OrderMoEPolicy.adapt_gain`, `.spend_target`
OB_ADAPT_GAIN, OB_SPEND_TARGET = 0, 1


class FeedbackArrays(NamedTuple):
    """`Feedback`'s per-pass arrays [P] as the compiled loop fills them."""

    estimate: np.ndarray
    spent: np.ndarray
    dense: np.ndarray
    observed: np.ndarray
    calls: np.ndarray  # [2] FB_*
    pass_end: np.ndarray


class ObserveArrays(NamedTuple):
    """What `_observe_ended` reads and writes: the feedback's per-pass user and grant, the policy's per-user
    EWMAs and quality weights (its own arrays, updated in place), the powers of its EWMA keep-factor and
    per-user scratch."""

    pass_user: np.ndarray  # [P] `Feedback.pass_user`
    granted: np.ndarray  # [P] `Feedback.granted`
    latency_excess: np.ndarray  # [U] `OrderMoEPolicy.latency_excess`
    spend_rate: np.ndarray  # [U] `OrderMoEPolicy.spend_rate`
    quality_weight: np.ndarray  # [U] `OrderMoEPolicy.quality_weight`
    keep_pow: np.ndarray  # [n_max + 1] (1 - ewma) ** n by numpy (`observe`'s EWMA weight of n observations)
    consts: np.ndarray  # OB_*
    count: np.ndarray  # [U] scratch: passes of the user in this observation
    excess_sum: np.ndarray  # [U] scratch sums (numpy's bincount: in pass order, from 0.0)
    granted_sum: np.ndarray
    spent_sum: np.ndarray
    users: np.ndarray  # [U] scratch: the users of this observation


def observe_arrays(policy, feedback) -> ObserveArrays:
    """`ObserveArrays` of an OrderMoE policy and its run's `Feedback`."""
    U = len(policy.latency_excess)
    n_max = int(np.bincount(feedback.pass_user).max()) if feedback.pass_user.size else 0
    # the same expression as `observe`'s (1.0 - ewma) ** n: numpy's power, element by element
    keep_pow = (1.0 - policy.ewma) ** np.arange(n_max + 1, dtype=float)
    z = lambda dtype=float: np.zeros(U, dtype)  # noqa: E731
    return ObserveArrays(np.ascontiguousarray(feedback.pass_user, _I), np.ascontiguousarray(feedback.granted, float),
                         policy.latency_excess, policy.spend_rate, policy.quality_weight, keep_pow,
                         np.array([policy.adapt_gain, policy.spend_target], float), z(_I), z(), z(), z(), z(_I))


@njit(cache=True, inline="always")
def _observe_ended(fb, ob, pass_begin, ended, n_ended):  # pragma: no cover - compiled
    """`Feedback.observe` + `OrderMoEPolicy.observe` of the passes ended since the last observation (ascending
    ids, as `Feedback.flush`'s flatnonzero gives them): each seen user's latency excess, and each user with a
    grant its spend rate and quality weight. The same operations as numpy's (bincount's sums in pass order from
    0.0, np.maximum's NaN, the EWMA weight from numpy's powers, `weight_step`)."""
    estimate, spent, observed, calls, pass_end = fb.estimate, fb.spent, fb.observed, fb.calls, fb.pass_end
    (pass_user, granted, latency_excess, spend_rate, quality_weight, keep_pow, consts, count, excess_sum, granted_sum,
     spent_sum, users) = ob
    done = np.sort(ended[calls[FB_ENDED_SEEN]:n_ended])
    calls[FB_ENDED_SEEN] = n_ended
    for i in range(done.shape[0]):
        u = pass_user[done[i]]
        count[u] = 0
        excess_sum[u] = 0.0
        granted_sum[u] = 0.0
        spent_sum[u] = 0.0
    n_users = 0
    for i in range(done.shape[0]):
        p = done[i]
        observed[p] = True
        u = pass_user[p]
        if count[u] == 0:
            users[n_users] = u
            n_users += 1
        count[u] += 1
        est = estimate[p]
        est = est if (est > 1e-12 or est != est) else 1e-12  # np.maximum(estimate, 1e-12)
        ratio = (pass_end[p] - pass_begin[p]) / est - 1.0
        excess_sum[u] += ratio if (ratio > 0.0 or ratio != ratio) else 0.0
        granted_sum[u] += granted[p]
        spent_sum[u] += spent[p]
    gain, target = consts[OB_ADAPT_GAIN], consts[OB_SPEND_TARGET]
    for i in range(n_users):
        u = users[i]
        n = float(count[u])
        a = 1.0 - keep_pow[count[u]]
        latency_excess[u] = latency_excess[u] + a * (excess_sum[u] / n - latency_excess[u])
        has = granted_sum[u]
        if has > 0:
            rate = spent_sum[u] / has
            spend_rate[u] = spend_rate[u] + a * (rate - spend_rate[u])
            quality_weight[u] = weight_step(quality_weight[u], gain * a * (rate - target) / target)


@njit(cache=True)
def _drive_ordermoe(tab, chunk_rows, every, stamp, b, n_ids, n_rows):  # pragma: no cover - compiled
    """Decide (`_decide_ordermoe`), feed back (`Feedback.add`, and `Feedback.flush`'s observations: every
    `every`-th wave, when passes ended since the last observation, `_observe_ended` observes them; the engine
    logs ended passes in `ended`) and run (`_wave_step`) waves from the picked one until the run ends, the
    buffers hold >= chunk_rows rows, or the next wave does not fit in the buffers or the job queue. tab: a
    `LoopTables`. The picked wave is the engine's scratch: its n_ids passes in `passes.ids` and n_rows rows in
    `scenario.wave_rows`, counts in and out, no arrays (a returned array costs a box and its next call's
    unbox). Returns (next wave's n_ids, n_rows, stamp, more, rows buffered). It calls the engine's `_wave_step` and the kernel's
    `_decide_ordermoe` once per wave (functions of their own: compiled once, shared with the other loops and
    the decode path); numba's disk cache of this function checks only this file, so after a change to either, clear the
    cache (see `rules._drive`)."""
    kt, fb, ob = tab.kt, tab.fb, tab.ob
    ex, scratch_out, om, out, extra = kt.ex, kt.scratch_out, kt.om, kt.out, kt.extra
    passes, nodes, scenario, cost = tab.passes, tab.nodes, tab.scenario, tab.cost
    estimate, spent, dense, calls = fb.estimate, fb.spent, fb.dense, fb.calls
    out_pass, out_lat = out.pass_, out.lat
    out_quality = extra[0]
    load, jobs_f, counters = nodes.load, nodes.queue.jobs_f, nodes.counters
    xfer, num_layers = cost.xfer, cost.num_layers
    K = ex.topk.shape[2]
    om_flags, budget_total = om.flags, om.budget_total
    layer, row_start, row_count, row_trace = passes.layer, scenario.pass_row_start, scenario.pass_row_count, scenario.row_trace
    rows_buf, rpass_buf, rlayer_buf, rtok_buf = scenario.wave_rows
    ids = passes.ids[:n_ids]
    rows, rpass, rlayer, rtok = rows_buf[:n_rows], rpass_buf[:n_rows], rlayer_buf[:n_rows], rtok_buf[:n_rows]
    more = True
    while True:
        T = rows.shape[0]
        if b + T > out_pass.shape[0] or counters[C_PENDING] + T * K > jobs_f.shape[0] or T > scratch_out.pass_.shape[0]:
            break
        # exact's rule first, as `_decide_ordermoe` asks: the wave's decision when `_exact_only`, else its replica
        # choice alone (np.int64(...), np.bool_(...): a plain constant would compile `_decide_rows` again)
        if _exact_only(rows, om_flags, budget_total):
            _decide_rows(np.int64(RULE_EXACT), rows, rpass, rlayer, rtok, ex, load, xfer, num_layers, out, b,
                         np.bool_(False))
        else:
            _decide_rows(np.int64(RULE_EXACT), rows, rpass, rlayer, rtok, ex, load, xfer, num_layers, scratch_out,
                         np.int64(0), np.bool_(True))
        _decide_ordermoe(rows, rpass, rlayer, rtok, kt, load, xfer, num_layers, b, _mean(load))
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
        # np.bool_(True): the type a Python bool has (a literal True would make numba compile `_wave_step` again)
        ids, stamp, more = _wave_step(np.bool_(True), stamp, ids, dec, passes, nodes, scenario, cost)
        # the next wave's rows, into the scratch `wave_rows` (views valid until the next wave's)
        q = _rows_into(ids, layer, row_start, row_count, row_trace, rows_buf, rpass_buf, rlayer_buf, rtok_buf)
        rows, rpass, rlayer, rtok = rows_buf[:q], rpass_buf[:q], rlayer_buf[:q], rtok_buf[:q]
        b = e
        calls[FB_CALLS] += 1
        if calls[FB_CALLS] % every == 0 and counters[C_ENDED] > calls[FB_ENDED_SEEN]:  # passes ended since the last observation
            _observe_ended(fb, ob, passes.pass_begin, passes.ended, counters[C_ENDED])
        if not more or b >= chunk_rows:
            break
    return ids.shape[0], rows.shape[0], stamp, more, b


if HAVE_NUMBA:
    # The loop's tables as one numba StructRef: one argument whose type numba reads off the object, where
    # the ~150 arrays of the groups passed as tuples cost the dispatcher a type check each, every call.
    from numba.experimental import structref as _structref

    from edgemoe.jit import UnliteralStructRef

    @_structref.register
    class LoopTablesType(UnliteralStructRef):
        pass

    class LoopTables(_structref.StructRefProxy):
        """kt (the kernel's `KernelTables`: ex, scratch_out, om, work, out, extra), fb (`FeedbackArrays`), ob
        (`ObserveArrays`), and the engine's groups passes, nodes, scenario, cost (`WaveEngine._groups`)."""

    _structref.define_proxy(LoopTables, LoopTablesType,
                            ["kt", "fb", "ob", "passes", "nodes", "scenario", "cost"])


@njit(cache=True)
def _loop_tables(kt, fb, ob, passes, nodes, scenario, cost):  # pragma: no cover - compiled
    """A `LoopTables` made in compiled code: cached on disk, where the proxy's own constructor compiles anew in
    every process."""
    return LoopTables(kt, fb, ob, passes, nodes, scenario, cost)


def run_ordermoe(engine, policy, state, trace, feedback, count, chunk_rows: int = 1 << 16) -> None:
    """Run the whole simulation of `engine` (a WaveEngine) with `policy` (OrderMoE, `compiled_loop_supported`)
    decided in the compiled loop. state: the policy's TokenState of every row (updated in place); feedback: the run's
    `Feedback` (its estimate, spent and observed arrays are filled here, its observations made by
    `_observe_ended`); count(dec, topk, layer, home, row_pass) receives the
    decisions in `_TallyBuffer`'s chunks (the same rows: waves until >= chunk_rows, then the rest), as views
    of buffers reused afterwards."""
    ctx = policy.ctx
    K, N = ctx.top_k, ctx.num_nodes
    wave = engine.first_wave()
    if wave is None:
        return
    rows, rpass, rlayer, rtok, _ = wave
    for buf, a in zip(engine.scenario_args.wave_rows, (rows, rpass, rlayer, rtok), strict=True):
        buf[:len(a)] = a  # the first wave into the scratch the compiled loop reads its waves from
    n_ids, n_rows = len(engine.ids), len(rows)
    for name in ("location", "layer", "prev_top1", "budget_used"):  # compiled code writes them in place
        setattr(state, name, np.ascontiguousarray(getattr(state, name)).copy())
    ex = rule_tables(ctx, state, trace, "exact")
    from edgemoe.runtime.policies.ordermoe import EPS_S_PER_Q, STEER_ALL_NODES

    om = ordermoe_tables(policy, state.budget_total, state.budget_used, EPS_S_PER_Q, STEER_ALL_NODES)
    J = 1 + int(om.ints[I_SHORT])
    work = _work_arrays(K, N, J, (1 + N if om.flags[F_ALL_NODES] else 1 + K * J) if om.flags[F_STEER] else 1,
                        action_count(K, int(om.ints[I_ENUM])))
    fb = FeedbackArrays(feedback.estimate, feedback.spent, feedback.dense, feedback.observed,
                        np.array([feedback.calls, 0], _I), engine.run.pass_end)
    ob = observe_arrays(policy, feedback)

    def buffers(cap, keep=None, rows_kept=0):
        new = decision_buffers(cap, K)
        new_extra = (np.empty(cap), np.empty((cap, K), bool))
        if keep is not None:
            for a, old in zip(new + new_extra, keep[0] + keep[1], strict=True):
                a[:rows_kept] = old[:rows_kept]
        return new, new_extra

    cap = max(2 * chunk_rows, 2 * n_rows)
    out, extra = buffers(cap)
    scratch_out = buffers(max(n_rows, 1024))[0]
    tab, tab_jobs = None, None
    b = 0
    while True:
        if b + n_rows > cap:
            cap = max(2 * cap, b + 2 * n_rows)
            out, extra = buffers(cap, (out, extra), b)
            tab = None
        if n_rows > scratch_out.experts.shape[0]:
            scratch_out = buffers(2 * n_rows)[0]
            tab = None
        engine._job_room(n_rows * K)
        if tab is None or engine.queue.jobs_f is not tab_jobs:  # (re)built when a buffer or the job queue grew
            tab = _loop_tables(kernel_tables(ex, scratch_out, om, work, out, extra), fb, ob, *engine._groups())
            tab_jobs = engine.queue.jobs_f
        n_ids, n_rows, engine.stamp, more, b = _drive_ordermoe(
            tab, chunk_rows, feedback.every, engine.stamp, b, n_ids, n_rows)
        if b and (b >= chunk_rows or not more):
            experts, node, loc, nxt, lat, topk, lv, home, row_pass = (a[:b] for a in out)
            quality, zeroed = (a[:b] for a in extra)
            count(Decision(experts=experts, node=node, location=loc, next_location=nxt, quality_cost=quality,
                           latency_s=lat, zeroed=zeroed), topk, lv, home, row_pass)
            b = 0
        if not more:
            break
    feedback.calls = int(fb.calls[FB_CALLS])
    policy.queue_pressure = float(om.qpress[0])
