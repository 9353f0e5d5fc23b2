"""The `simulate` backend: trace-driven discrete-event simulation over the cost model (pure numpy).

Event model (docs/runtime.md, "Simulator"): a pass (a request's prompt rows, or one decode row) goes through
the L MoE layers in order. At each layer the policy decides for the pass's rows; every slot that runs
becomes a job: its hidden state travels from the token's node to the slot's node (`xfer_s`), waits in that
node's FIFO queue, is served (roofline time; a prefill pass's slots for the same expert on the same node
share one batched call), and its output travels to the meeting node. The layer ends when its slowest job's
output has arrived (and, after the last layer in `migrate` mode, the token is back home). A decode pass
starts when the previous one ends; the next request of a closed-loop user `think_s` after the last ends.

Two engines give the same model:
- `engine="reference"` (`edgemoe.runtime.des`): an exact heapq event loop, one decision / job at a time;
- `engine="fast"` (default): windowed waves. Each wave takes the earliest pending time t0, decides every
  pass whose layer starts before t0 + window (one vectorised policy call per layer), and serves every job
  arriving before t0 + window with a vectorised per-node FIFO (Lindley) recursion. With window 0 it is the
  reference's event order; a window w lets jobs arriving within w of each other be served out of arrival
  order, so waits can be off by about w (tested against the reference).
"""

from __future__ import annotations

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.eval.metrics import DecisionTally, RunMetrics, latency_summary_ms

from .context import RuntimeContext
from .policy import Policy
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
            extra={**extra, "latency_quantiles_ms": _quantiles_ms(decode_latency)},
        )


def _quantiles_ms(seconds: np.ndarray, points: int = 101) -> list[float]:
    """[points] evenly spaced quantiles (0..100%) in ms: enough to draw a CDF from the results file."""
    x = np.asarray(seconds, dtype=float)
    x = x[np.isfinite(x)]
    return (np.percentile(x, np.linspace(0, 100, points)) * 1e3).round(4).tolist() if x.size else []


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


def fifo_finish(node: np.ndarray, arrival: np.ndarray, service: np.ndarray, seq: np.ndarray,
                node_free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Serve jobs FIFO per node (by arrival, then seq): ([J] finish times, order). Updates node_free [N].

    Segmented Lindley recursion: finish_i = max(free, max_{j<=i} (a_j - C_{j-1})) + C_i with C the running
    service sum within the node's segment; the segmented running max uses a per-segment offset.
    """
    order = np.lexsort((seq, arrival, node))
    n, a, s = node[order], arrival[order], service[order]
    J = len(order)
    new_seg = np.ones(J, bool)
    new_seg[1:] = n[1:] != n[:-1]
    seg_id = np.cumsum(new_seg) - 1
    first = np.flatnonzero(new_seg)[seg_id]
    cs = np.cumsum(s)
    c_incl = cs - (cs[first] - s[first])
    v = a - (c_incl - s)
    span = float(v.max() - v.min()) + 1.0
    running = np.maximum.accumulate(v + seg_id * span) - seg_id * span
    fin = np.maximum(node_free[n], running) + c_incl
    last = np.append(np.flatnonzero(new_seg[1:]), J - 1)
    node_free[n[last]] = fin[last]
    finish = np.empty(J)
    finish[order] = fin
    return finish, order


# ------------------------------------------------------------------------------------------- fast engine


def run_fast(ctx: RuntimeContext, policy: Policy, trace: Trace, sc: Scenario, window_s: float) -> Run:
    """Windowed-wave engine (see the module docstring)."""
    P, L, N = sc.num_passes, ctx.num_layers, ctx.num_nodes
    run = Run(ctx, sc)
    state = policy.start(sc.row_user)
    run.budget_total = float(state.budget_total.sum())
    layer = np.zeros(P, np.int64)
    start_t = np.zeros(P)
    done_t = np.zeros(P)
    outstanding = np.zeros(P, np.int64)
    node_free = np.zeros(N)
    first = sc.request_first_pass[np.isfinite(sc.request_arrival)]
    ready_ids, ready_t = first.copy(), sc.request_arrival[np.isfinite(sc.request_arrival)].copy()
    jobs = _Jobs()
    while ready_ids.size or jobs.size:
        t0 = min(ready_t.min() if ready_ids.size else np.inf, jobs.arrival.min() if jobs.size else np.inf)
        horizon = t0 + window_s
        pick = (ready_t < horizon) if window_s > 0 else (ready_t <= t0)
        ids, t_ids = ready_ids[pick], ready_t[pick]
        ready_ids, ready_t = ready_ids[~pick], ready_t[~pick]
        start_t[ids] = t_ids
        if ids.size:
            load = np.maximum(node_free - t0, 0.0)
            _decide(ctx, policy, trace, sc, run, state, layer, ids, start_t, done_t, outstanding, load, jobs)
        take = (jobs.arrival < horizon) if window_s > 0 else (jobs.arrival <= t0)
        committed = jobs.pop(take)
        if committed is not None:
            jpass, node, arrival, service, back, seq = committed
            finish, _ = fifo_finish(node, arrival, service, seq, node_free)
            np.add.at(run.node_busy, node, service)
            np.maximum.at(done_t, jpass, finish + back)
            np.subtract.at(outstanding, jpass, 1)
            touched = np.unique(np.concatenate([ids, jpass]))
        else:
            touched = ids
        finished = touched[outstanding[touched] == 0]
        new_ids, new_t = _advance(sc, run, layer, done_t, finished, L)
        ready_ids = np.concatenate([ready_ids, new_ids])
        ready_t = np.concatenate([ready_t, new_t])
    return run


def _decide(ctx, policy, trace, sc, run, state, layer, pids, start_t, done_t, outstanding, load, jobs) -> None:
    """One policy call for the passes `pids`, each at its own next layer; queue their jobs."""
    rows = sc.rows_of(pids)
    part = state.take(rows)
    tok = sc.row_trace[rows]
    row_pass = sc.row_pass[rows]
    lv = layer[row_pass]
    topk, gates = trace.topk[tok, lv], trace.gates[tok, lv]
    dec = policy.decide(lv, topk, gates, part, load)
    state.put(rows, part)
    run.tally.add(dec, topk, lv, part.home, sc.pass_prefill[sc.row_pass[rows]])
    begin = pids[layer[pids] == 0]
    run.pass_begin[begin] = start_t[begin]
    jpass, node, arrival, service, back, floor = make_jobs(ctx, lv, dec, row_pass, start_t[row_pass], part.home)
    done_t[pids] = start_t[pids]
    np.maximum.at(done_t, row_pass, floor)
    outstanding[pids] = 0
    np.add.at(outstanding, jpass, 1)
    jobs.push(jpass, node, arrival, service, back)


def _advance(sc: Scenario, run: Run, layer: np.ndarray, done_t: np.ndarray, finished: np.ndarray, L: int):
    """Passes in `finished` completed their layer at done_t: next layer, next pass or next request."""
    layer[finished] += 1
    going = finished[layer[finished] < L]
    ended = finished[layer[finished] >= L]
    run.pass_end[ended] = done_t[ended]
    nxt = sc.pass_next[ended]
    has_next = nxt >= 0
    ids = [going, nxt[has_next]]
    ts = [done_t[going], done_t[ended[has_next]]]
    if sc.closed:
        last = ended[~has_next]
        req_next = sc.request_next[sc.pass_request[last]]
        ok = req_next >= 0
        arrive = done_t[last[ok]] + sc.think_s
        run.request_arrival[req_next[ok]] = arrive
        ids.append(sc.request_first_pass[req_next[ok]])
        ts.append(arrive)
    return np.concatenate(ids).astype(np.int64), np.concatenate(ts)


class _Jobs:
    """Pending jobs (decided, not yet served) as parallel arrays; seq = creation order (FIFO tie-break)."""

    def __init__(self):
        self.fields = [np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0),
                       np.zeros(0, np.int64)]
        self.next_seq = 0

    @property
    def size(self) -> int:
        return int(self.fields[0].shape[0])

    @property
    def arrival(self) -> np.ndarray:
        return self.fields[2]

    def push(self, jpass, node, arrival, service, back) -> None:
        seq = self.next_seq + np.arange(len(jpass))
        self.next_seq += len(jpass)
        new = [jpass, node, arrival, service, back, seq]
        self.fields = [np.concatenate([old, n]) for old, n in zip(self.fields, new, strict=True)]

    def pop(self, mask: np.ndarray):
        if not mask.any():
            return None
        out = [f[mask] for f in self.fields]
        self.fields = [f[~mask] for f in self.fields]
        return out
