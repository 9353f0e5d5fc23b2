"""What both simulator engines share: the finished run's record (`Run`), the policy feedback, the dense
part's per-pass seconds and the jobs one layer's decision creates. The reference engine (`des`) and the
fast one (`engine`, driven by `simulate.run_fast`) import it; it imports neither.
"""

from __future__ import annotations

import numpy as np

from edgemoe.runtime.decision_cost import decision_cost_of
from edgemoe.runtime.metrics import DecisionTally, RunMetrics, latency_summary_ms

from ..context import RuntimeContext
from ..policy import Decision, Policy
from .workload import Scenario


class Run:
    """Mutable bookkeeping of one simulation shared by both engines."""

    def __init__(self, ctx: RuntimeContext, scenario: Scenario):
        P = scenario.num_passes
        self.tally = DecisionTally(ctx.num_layers, ctx.wire_bytes)
        self.pass_begin = np.full(P, np.nan)
        self.pass_end = np.full(P, np.nan)
        self.request_arrival = scenario.request_arrival.copy()
        self.node_busy = np.zeros(ctx.num_nodes)
        self.budget_total = 0.0
        self.user_budget: dict = {}  # per user: spent / granted quality budget (policies with feedback)

    def metrics(self, ctx: RuntimeContext, sc: Scenario, extra: dict) -> RunMetrics:
        prefill = sc.pass_prefill
        decode_latency = (self.pass_end - self.pass_begin)[~prefill]
        first = sc.request_first_pass
        ttft = self.pass_end[first] - self.request_arrival
        start, end = np.nanmin(self.request_arrival), np.nanmax(self.pass_end)
        makespan = max(float(end - start), 1e-12)
        generated = len(sc.request_user) * int(sc.pass_next.size // max(len(sc.request_user), 1))
        t = self.tally
        return RunMetrics(
            latency_ms=latency_summary_ms(decode_latency), ttft_ms=latency_summary_ms(ttft),
            throughput_tokens_per_s=generated / makespan, **t.traffic_per_1k(), **t.ratios(),
            utilisation={n: float(b / makespan) for n, b in zip(ctx.node_names, self.node_busy, strict=True)},
            budget_used=t.quality_cost / max(t.token_layers, 1),
            budget_used_fraction=(t.quality_cost / self.budget_total) if self.budget_total > 0 else None,
            requests=len(sc.request_user), prompt_tokens=t.prefill_tokens, generated_tokens=generated,
            token_layers=t.token_layers, makespan_s=makespan,
            extra={**extra, "latency_quantiles_ms": _quantiles_ms(decode_latency), **self.user_budget},
        )


def _quantiles_ms(seconds: np.ndarray, points: int = 101) -> list[float]:
    """[points] evenly spaced quantiles (0..100%) in ms: enough to draw a CDF from the results file."""
    x = np.asarray(seconds, dtype=float)
    x = x[np.isfinite(x)]
    return (np.percentile(x, np.linspace(0, 100, points)) * 1e3).round(4).tolist() if x.size else []


class Feedback:
    """Feeds `policy.observe` (when the policy wants feedback) with the passes that have finished: per pass the
    user, the measured duration, the policy's own estimate (per layer the slowest row's `latency_s`, summed),
    and the budget the pass's rows spent and were granted. Checked every `every` policy calls (a check scans
    all passes)."""

    def __init__(self, policy: Policy, sc: Scenario, state, run: Run, every: int = 8, dense_s: np.ndarray | None = None):
        self.on = bool(getattr(policy, "wants_feedback", False))
        if not self.on:
            return
        P = sc.num_passes
        self.policy, self.run, self.every, self.calls = policy, run, int(every), 0
        # the estimate includes each layer's dense work (known, no queueing): the policy prices only experts
        self.dense = np.zeros(P) if dense_s is None else np.asarray(dense_s, float)
        self.estimate = np.zeros(P)
        self.spent = np.zeros(P)
        self.granted = np.bincount(sc.row_pass, state.budget_total, minlength=P)
        self.pass_user = sc.request_user[sc.pass_request]
        self.observed = np.zeros(P, bool)
        self.num_users = int(state.user.max()) + 1 if len(state) else 0

    def add(self, row_pass: np.ndarray, dec: Decision) -> None:
        if not self.on or not len(row_pass):
            return
        passes, inverse = np.unique(row_pass, return_inverse=True)
        slowest = np.zeros(len(passes))
        np.maximum.at(slowest, inverse, dec.latency_s)
        self.estimate[passes] += slowest + self.dense[passes]
        self.spent[passes] += np.bincount(inverse, dec.quality_cost, minlength=len(passes))

    def observe(self, done: np.ndarray) -> None:
        """`policy.observe` of the finished passes `done` (ascending ids, none observed before)."""
        if done.size:
            self.observed[done] = True
            self.policy.observe(self.pass_user[done], self.run.pass_end[done] - self.run.pass_begin[done],
                                self.estimate[done], self.spent[done], self.granted[done])

    def flush(self, force: bool = False) -> None:
        if not self.on:
            return
        self.calls += 1
        if not force and self.calls % self.every:
            return
        self.observe(np.flatnonzero(~self.observed & np.isfinite(self.run.pass_end)))
        if force:
            U = max(self.num_users, int(self.pass_user.max()) + 1 if self.pass_user.size else 0)
            self.run.user_budget = {
                "budget_spent_by_user": np.bincount(self.pass_user, self.spent, minlength=U).tolist(),
                "budget_granted_by_user": np.bincount(self.pass_user, self.granted, minlength=U).tolist()}


def pass_dense_s(ctx: RuntimeContext, sc: Scenario) -> np.ndarray:
    """[P] nominal seconds of one MoE layer's dense work of each pass on its home's hardware (rows batched;
    docs/runtime.md, "Dense part"); zeros when the context's dense part is off."""
    home = ctx.user_home[sc.request_user[sc.pass_request]]
    return np.asarray(ctx.dense_s(home, sc.pass_row_count), float)


def pass_stage_s(ctx: RuntimeContext, sc: Scenario, policy: Policy | None) -> tuple[np.ndarray, bool]:
    """([P] seconds one layer of each pass spends on its home's backbone before its expert calls, whether
    that stage runs at all): the dense work, plus the policy's decision of the pass's rows when its decisions
    are charged (`edgemoe.runtime.decision_cost`; the decision follows the dense work, in the same stage).
    Without the charge: the dense seconds, and the stage runs when the dense part is on (as before it)."""
    dense = pass_dense_s(ctx, sc)
    cost = decision_cost_of(policy) if policy is not None else None
    if cost is None:
        return dense, ctx.dense_on
    return dense + cost.seconds(sc.pass_row_count), True


def make_jobs(ctx: RuntimeContext, layer, dec, row_pass: np.ndarray, row_start: np.ndarray, home: np.ndarray):
    """Jobs of one layer's decision for T rows, and each row's completion when it runs no job.

    layer: int or [T]; row_pass: [T] pass of each row; row_start: [T] layer start time; home: [T].
    Returns (job_pass, job_node, job_arrival, job_service, job_back) [J] and row_floor [T].
    back = transfer from the job's node to the meeting node (+ the trip home after the last layer).
    """
    N, E = ctx.num_nodes, ctx.num_experts
    ran = dec.node >= 0
    t_idx, k_idx = np.nonzero(ran)
    node = dec.node[t_idx, k_idx]
    expert = dec.experts[t_idx, k_idx]
    loc, nxt = dec.location[t_idx], dec.next_location[t_idx]
    layer = np.broadcast_to(np.asarray(layer, dtype=np.int64), home.shape)
    trip_home = np.where(layer == ctx.num_layers - 1, ctx.xfer_s[dec.next_location, home], 0.0)
    jpass = row_pass[t_idx]
    # A pass's slots for the same expert on the same node share one batched call (prefill): split its time.
    key = (jpass.astype(np.int64) * N + node) * E + expert
    _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    count = counts[inverse.ravel()]
    service = ctx.call_s(node, layer[t_idx], expert, count) / count
    arrival = row_start[t_idx] + ctx.xfer_s[loc, node]
    back = ctx.xfer_s[node, nxt] + trip_home[t_idx]
    return jpass, node, arrival, service, back, row_start + trip_home
