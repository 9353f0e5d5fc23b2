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
- `engine="reference"` (`edgemoe.runtime.sim.des`): an exact heapq event loop, one decision / job at a time;
- `engine="fast"` (default): windowed waves. Each wave takes the earliest pending time t0, decides every
  pass whose layer starts before t0 + window (one vectorised policy call, rows at different layers), and
  serves every job arriving before t0 + window in per-node FIFO order. The bookkeeping of a wave (jobs,
  queues, passes) is one compiled call (`edgemoe.runtime.sim.engine`); the policy call stays numpy, except for
  policies with a compiled rule (`Policy.compiled_rule`: exact, slimcaching, drop in `edgemoe.runtime.sim.rules`,
  ordermoe in `edgemoe.runtime.sim.ordermoe_loop`), decided inside the compiled loop with the same arithmetic,
  bit for bit (tests/runtime/sim/test_sim_pinned.py). With window 0
  it is the reference's event order and arithmetic (tested equal); a window w lets jobs arriving within w of
  each other be served out of arrival order, so waits can be off by about w (tested against the reference).
"""

from __future__ import annotations

import numpy as np

from edgemoe.errors import EdgeMoEError, require_in_range
from edgemoe.jit import HAVE_NUMBA
from edgemoe.runtime.metrics import RunMetrics

from ..context import RuntimeContext
from ..policy import Decision, Policy
from .engine import WaveEngine
from .rules import RULES, run_rule
from .run import Feedback, Run
from .workload import Scenario, Trace, Workload, build_scenario

DEFAULT_WINDOW_S = 1e-4  # fast engine's wave width: about the compute time of one expert call (`bench.studies.window_error`)


def _check_trace(ctx: RuntimeContext, trace: Trace) -> None:
    """Raise EdgeMoEError unless `trace` fits `ctx`: (L, K) its shape, expert ids in [0, E), finite gates (the
    compiled engines index their tables by the ids unchecked: an id out of range would read outside them)."""
    if trace.topk.shape[1:] != (ctx.num_layers, ctx.top_k):
        raise EdgeMoEError(f"trace has (L, K) = {trace.topk.shape[1:]}, context has {(ctx.num_layers, ctx.top_k)}")
    require_in_range(trace.topk, 0, ctx.num_experts, "trace.topk must hold expert ids")
    if not np.isfinite(trace.gates).all():
        raise EdgeMoEError("trace.gates holds NaN or infinite values")


def simulate(ctx: RuntimeContext, policy: Policy, trace: Trace, workload: Workload, engine: str = "fast",
             window_s: float = DEFAULT_WINDOW_S) -> RunMetrics:
    """Simulate `workload` with `policy` on `ctx`, replaying routing from `trace`; deterministic for the seed."""
    scenario = build_scenario(ctx.user_weight, ctx.user_domain, trace, workload)
    return simulate_scenario(ctx, policy, trace, scenario, engine, window_s)


def simulate_scenario(ctx: RuntimeContext, policy: Policy, trace: Trace, scenario: Scenario, engine: str = "fast",
                      window_s: float = DEFAULT_WINDOW_S) -> RunMetrics:
    """Simulate an explicit Scenario (requests, passes and rows already drawn; see `build_scenario`). The trace
    and the scenario's users and trace rows are checked against `ctx` here (`simulate` comes through here too)."""
    _check_trace(ctx, trace)
    for name, hi in (("request_user", ctx.num_users), ("row_user", ctx.num_users), ("row_trace", len(trace.topk))):
        require_in_range(getattr(scenario, name), 0, hi, f"scenario.{name} must hold indices")
    if engine == "reference":
        from .des import run_reference

        run = run_reference(ctx, policy, trace, scenario)
    elif engine == "fast":
        if not 0 <= window_s < np.inf:
            raise EdgeMoEError(f"window_s must be finite and >= 0, got {window_s}")
        run = run_fast(ctx, policy, trace, scenario, window_s)
    else:
        raise EdgeMoEError(f"engine={engine!r}; expected 'fast' or 'reference'")
    return run.metrics(ctx, scenario, extra={"engine": engine, "window_s": window_s if engine == "fast" else 0.0,
                                             "mode": ctx.mode})


# ------------------------------------------------------------------------------------------- fast engine


def run_fast(ctx: RuntimeContext, policy: Policy, trace: Trace, sc: Scenario, window_s: float,
             compiled: bool = True) -> Run:
    """Windowed-wave engine (see the module docstring): per wave one policy call (numpy) for all its rows
    and one compiled call (`edgemoe.runtime.sim.engine`) for the jobs, the FIFO queues and the bookkeeping.

    A policy with a compiled rule (`Policy.compiled_rule`: exact, slimcaching, drop) is decided inside the
    compiled loop instead, many waves per call (the same decisions, bit for bit); compiled=False forces the
    per-wave policy call (tests compare the two)."""
    run = Run(ctx, sc)
    state = policy.start(sc.row_user, tokens=sc.row_trace)
    run.budget_total = float(state.budget_total.sum())
    engine = WaveEngine(ctx, sc, run, window_s, policy)
    rule = compiled_rule(policy) if compiled else None
    if rule == "ordermoe":
        from .ordermoe_loop import run_ordermoe

        feedback = Feedback(policy, sc, state, run, dense_s=engine.pass_dense)
        prefill = sc.pass_prefill
        run_ordermoe(engine, policy, state, trace, feedback,
                     lambda dec, topk, layer, home, row_pass: run.tally.add(dec, topk, layer, home, prefill[row_pass]))
        feedback.flush(force=True)
        return run
    if rule is not None:
        prefill = sc.pass_prefill
        run_rule(engine, rule, ctx, state, trace,
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
    """The policy's compiled decision rule (`edgemoe.runtime.sim.rules.RULES`) when the fast engine can use it:
    numba present, the policy names a known rule and wants no feedback (the compiled loop of exact, slimcaching
    and drop gives none; "ordermoe"'s, `edgemoe.runtime.sim.ordermoe_loop`, gives the policy its own)."""
    rule = policy.compiled_rule()
    if rule is None or not HAVE_NUMBA:
        return None
    if rule == "ordermoe":
        return rule
    if getattr(policy, "wants_feedback", False):
        return None
    if rule not in RULES:
        raise EdgeMoEError(f"{type(policy).__name__}.compiled_rule() = {rule!r}; expected one of "
                           f"{sorted([*RULES, 'ordermoe'])} or None")
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
