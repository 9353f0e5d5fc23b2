"""The `simulate` backend: trace-driven discrete-event simulation over the cost model (pure numpy).

Event model (docs/runtime.md, "Simulator"): a pass (a request's prompt rows, or one decode row) goes through
the L MoE layers in order. At each layer the pass first runs the layer's dense work (`ctx.dense_s`) on its
home's backbone queue (FIFO, one layer of one pass at a time; "Dense part"), then the policy decides for the
pass's rows; every slot that runs
becomes a job: its hidden state travels from the token's node to the slot's node (`xfer_s`), waits in that
node's FIFO queue, is served (roofline time; a prefill pass's slots for the same expert on the same node
share one batched call), and its output travels to the meeting node. The layer ends when its slowest job's
output has arrived (and, after the last layer in `migrate` mode, the token is back home). A decode pass
starts when the previous one ends; the next request of a closed-loop user `think_s` after the last ends.

Two engines give the same model:
- `engine="reference"` (`edgemoe.runtime.des`): an exact heapq event loop, one decision / job at a time;
- `engine="fast"` (default): windowed waves. Each wave takes the earliest pending time t0, decides every
  pass whose layer starts before t0 + window (one vectorised policy call, rows at different layers), and
  serves every job arriving before t0 + window in per-node FIFO order. The bookkeeping of a wave (jobs,
  queues, passes) is one compiled call (`edgemoe.runtime.waves`); the policy call stays numpy, except for
  policies with a compiled rule (exact, slimcaching, drop: `Policy.compiled_rule`), decided inside the
  compiled loop with the same arithmetic, bit for bit (tests/runtime/test_sim_pinned.py). With window 0
  it is the reference's event order and arithmetic (tested equal); a window w lets jobs arriving within w of
  each other be served out of arrival order, so waits can be off by about w (tested against the reference).
"""

from __future__ import annotations

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.eval.metrics import DecisionTally, RunMetrics, latency_summary_ms
from edgemoe.jit import HAVE_NUMBA

from .context import RuntimeContext
from .policy import Decision, Policy
from .waves import RULES, WaveEngine
from .workload import Scenario, Trace, Workload, build_scenario

DEFAULT_WINDOW_S = 1e-3  # fast engine's wave width: about the compute time of a few expert calls


def simulate(ctx: RuntimeContext, policy: Policy, trace: Trace, workload: Workload, engine: str = "fast",
             window_s: float = DEFAULT_WINDOW_S) -> RunMetrics:
    """Simulate `workload` with `policy` on `ctx`, replaying routing from `trace`; deterministic for the seed."""
    if trace.topk.shape[1:] != (ctx.num_layers, ctx.top_k):
        raise EdgeMoEError(f"trace has (L, K) = {trace.topk.shape[1:]}, context has {(ctx.num_layers, ctx.top_k)}")
    scenario = build_scenario(ctx.user_weight, ctx.user_domain, trace, workload)
    return simulate_scenario(ctx, policy, trace, scenario, engine, window_s)


def simulate_scenario(ctx: RuntimeContext, policy: Policy, trace: Trace, scenario: Scenario, engine: str = "fast",
                      window_s: float = DEFAULT_WINDOW_S) -> RunMetrics:
    """Simulate an explicit Scenario (requests, passes and rows already drawn; see `build_scenario`)."""
    if engine == "reference":
        from .des import run_reference

        run = run_reference(ctx, policy, trace, scenario)
    elif engine == "fast":
        if window_s < 0:
            raise EdgeMoEError(f"window_s must be >= 0, got {window_s}")
        run = run_fast(ctx, policy, trace, scenario, window_s)
    else:
        raise EdgeMoEError(f"engine={engine!r}; expected 'fast' or 'reference'")
    return run.metrics(ctx, scenario, extra={"engine": engine, "window_s": window_s if engine == "fast" else 0.0,
                                             "mode": ctx.mode})


# ------------------------------------------------------------------------------------------ shared parts


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

    def flush(self, force: bool = False) -> None:
        if not self.on:
            return
        self.calls += 1
        if not force and self.calls % self.every:
            return
        done = np.flatnonzero(~self.observed & np.isfinite(self.run.pass_end))
        if done.size:
            self.observed[done] = True
            self.policy.observe(self.pass_user[done], self.run.pass_end[done] - self.run.pass_begin[done],
                                self.estimate[done], self.spent[done], self.granted[done])
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


# ------------------------------------------------------------------------------------------- fast engine


def run_fast(ctx: RuntimeContext, policy: Policy, trace: Trace, sc: Scenario, window_s: float,
             compiled: bool = True) -> Run:
    """Windowed-wave engine (see the module docstring): per wave one policy call (numpy) for all its rows
    and one compiled call (`edgemoe.runtime.waves`) for the jobs, the FIFO queues and the bookkeeping.

    A policy with a compiled rule (`Policy.compiled_rule`: exact, slimcaching, drop) is decided inside the
    compiled loop instead, many waves per call (the same decisions, bit for bit); compiled=False forces the
    per-wave policy call (tests compare the two)."""
    run = Run(ctx, sc)
    state = policy.start(sc.row_user, tokens=sc.row_trace)
    run.budget_total = float(state.budget_total.sum())
    engine = WaveEngine(ctx, sc, run, window_s)
    rule = compiled_rule(policy) if compiled else None
    if rule is not None:
        prefill = sc.pass_prefill
        engine.run_rule(rule, ctx, state, trace,
                        lambda dec, topk, layer, home, row_pass: run.tally.add(dec, topk, layer, home, prefill[row_pass]))
        return run
    feedback = Feedback(policy, sc, state, run, dense_s=engine.pass_dense)
    tally = _TallyBuffer(run.tally, sc.pass_prefill)
    wave = engine.first()
    while wave is not None:
        rows, row_pass, lv, tok, load = wave
        part = state.take(rows)
        topk, gates = trace.topk[tok, lv], trace.gates[tok, lv]
        dec = policy.decide(lv, topk, gates, part, load)
        state.put(rows, part)
        tally.add(dec, topk, lv, part.home, row_pass)
        feedback.add(row_pass, dec)
        wave = engine.step(row_pass, lv, part.home, dec)
        feedback.flush()
    tally.flush()
    feedback.flush(force=True)
    return run


def compiled_rule(policy: Policy) -> str | None:
    """The policy's compiled decision rule (`edgemoe.runtime.waves.RULES`) when the fast engine can use it:
    numba present, the policy names a known rule and wants no feedback (the compiled loop gives none)."""
    rule = policy.compiled_rule()
    if rule is None or not HAVE_NUMBA or getattr(policy, "wants_feedback", False):
        return None
    if rule not in RULES:
        raise EdgeMoEError(f"{type(policy).__name__}.compiled_rule() = {rule!r}; expected one of {sorted(RULES)} or None")
    return rule


class _TallyBuffer:
    """Feeds a DecisionTally in chunks of many waves (its per-call cost is fixed; the counts are sums)."""

    def __init__(self, tally, pass_prefill: np.ndarray, chunk_rows: int = 1 << 16):
        self.tally, self.pass_prefill, self.chunk_rows = tally, pass_prefill, chunk_rows
        self.parts: list = []
        self.rows = 0

    def add(self, dec, topk, layer, home, row_pass) -> None:
        self.parts.append((dec.experts, dec.node, dec.location, dec.next_location, dec.quality_cost, dec.latency_s,
                           dec.zero_mask, topk, layer, home, row_pass))
        self.rows += len(layer)
        if self.rows >= self.chunk_rows:
            self.flush()

    def flush(self) -> None:
        if not self.parts:
            return
        cols = [np.concatenate(c) for c in zip(*self.parts, strict=True)]
        experts, node, location, next_location, quality, latency, zeroed, topk, layer, home, row_pass = cols
        dec = Decision(experts=experts, node=node, location=location, next_location=next_location,
                       quality_cost=quality, latency_s=latency, zeroed=zeroed)
        self.tally.add(dec, topk, layer, home, self.pass_prefill[row_pass])
        self.parts, self.rows = [], 0
