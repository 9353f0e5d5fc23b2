"""OrderMoE decided inside the fast engine's compiled wave loop (numba), bit for bit as the per-wave policy call.

`run_ordermoe` drives the simulation as `rules.run_rule` does for exact / slimcaching / drop, with the
whole OrderMoE decision of `edgemoe.runtime.policies.ordermoe` (`layer_options` + `OrderMoEPolicy.choose`) in
the compiled loop (`ordermoe_kernel._decide_ordermoe`, the per-row decision the policy's own decode path
also runs): exact's replica choice (rules' `_decide_rows`, rule "exact", run on a
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

from ..policies.ordermoe_kernel import (
    F_ALL_NODES,
    F_STEER,
    I_SHORT,
    _decide_ordermoe,
    _work_arrays,
    ordermoe_tables,
)
from ..policy import Decision
from .engine import _wave_step
from .jobqueue import C_ENDED, C_PENDING
from .rules import decision_buffers, rule_tables

_I = np.int64

# entries of `FeedbackArrays.calls`: policy calls so far, passes ended when the policy last observed
FB_CALLS, FB_ENDED_SEEN = 0, 1


class FeedbackArrays(NamedTuple):
    """`Feedback`'s per-pass arrays [P] as the compiled loop fills them."""

    estimate: np.ndarray
    spent: np.ndarray
    dense: np.ndarray
    observed: np.ndarray
    calls: np.ndarray  # [2] FB_*
    pass_end: np.ndarray


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
    from edgemoe.runtime.policies.ordermoe import EPS_S_PER_Q, STEER_ALL_NODES

    om = ordermoe_tables(policy, state.budget_total, state.budget_used, EPS_S_PER_Q, STEER_ALL_NODES)
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
