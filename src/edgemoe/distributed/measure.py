"""Measured metrics of a distributed run, and the simulator's prediction for the same run (pure numpy).

Measured (nominal seconds: wall / dilation, links.Clock): per-token latency = each decode pass on the home,
from its start to its end as the home's clock saw it (never earlier than the emulated deadline, later when
the host ran late); TTFT = submission to the end of the prefill pass; throughput = generated tokens /
makespan (driver's clock); traffic = bytes that crossed an emulated link; remote ratio = remote slots /
slots that ran, after any repair; utilisation = each node's emulated accelerator seconds / makespan;
lateness = how much later than their deadlines a decode pass's layers started and the pass ended, summed
(the host's own delay, what dilation shrinks); late_share = lateness / latency over all decode passes.
Predicted: the simulator replays the very same requests (the routing each row really had, each request
arriving when it was really submitted) through `simulate_scenario` with the same policy, so the two
differ only by what the emulation does not reproduce: host lateness, the order in which concurrent calls
reach a server, and the load each home sees (replies, not the simulator's global view).
"""

from __future__ import annotations

import numpy as np

from edgemoe.runtime.metrics import latency_summary_ms


def measured_metrics(records, makespan_s: float, ctx) -> dict:
    """records: LoadRecords (or anything with .result: GenerateResult)."""
    results = [r.result for r in records]
    if not results:
        return {"requests": 0}
    counts = {k: sum(float(r.counts.get(k, 0)) for r in results) for k in results[0].counts}
    decode = np.concatenate([r.decode_s for r in results]) if results else np.zeros(0)
    ttft = np.array([r.queued_s + r.prefill_s for r in results])
    gen = sum(len(r.tokens) for r in results)
    rows = sum(r.topk.shape[0] for r in results)
    ran = max(counts["slots"] - counts["dropped"], 1)
    late = np.concatenate([(r.pass_end_s - r.pass_deadline_s)[1:] for r in results if r.pass_end_s is not None]
                          or [np.zeros(0)])
    busy = np.sum([r.node_busy_s for r in results if r.node_busy_s is not None], axis=0)
    return {
        "requests": len(results), "generated_tokens": gen, "token_rows": rows,
        "latency_ms": latency_summary_ms(decode), "ttft_ms": latency_summary_ms(ttft),
        "throughput_tokens_per_s": gen / makespan_s if makespan_s > 0 else float("nan"),
        "traffic_bytes_per_1k_tokens": 1000.0 * counts["link_bytes"] / rows,
        "predicted_traffic_bytes_per_1k_tokens": 1000.0 * counts["predicted_bytes"] / rows,
        "process_bytes_per_1k_tokens": 1000.0 * counts["process_bytes"] / rows,
        "remote_ratio": counts["remote"] / ran, "substitution_ratio": counts["substituted"] / max(counts["slots"], 1),
        "drop_ratio": counts["dropped"] / max(counts["slots"], 1),
        "calls": int(counts["calls"]), "failed_calls": int(counts["failed_calls"]), "repaired_slots": int(counts["repaired"]),
        "makespan_s": makespan_s,
        "latency_quantiles_ms": quantiles_ms(decode),
        "utilisation": {n: float(b / makespan_s) for n, b in zip(ctx.node_names, np.atleast_1d(busy), strict=False)}
        if makespan_s > 0 and np.ndim(busy) else {},
        "lateness_ms": latency_summary_ms(late),
        "late_share": float(late.sum() / max(decode.sum(), 1e-12)) if late.size and decode.size else float("nan"),
    }


def quantiles_ms(seconds, points: int = 101) -> list[float]:
    """[points] evenly spaced quantiles (0..100%) in ms, to draw a CDF from the results file."""
    x = np.asarray(seconds, dtype=float)
    x = x[np.isfinite(x)]
    return (np.percentile(x, np.linspace(0, 100, points)) * 1e3).round(4).tolist() if x.size else []


def replay_scenario(records, num_layers: int):
    """(Trace, Scenario) of the requests in `records` as they really ran: their routing and submit times."""
    from edgemoe.runtime.sim.workload import Scenario, Trace

    records = sorted(records, key=lambda r: r.submitted_s)
    res = [r.result for r in records]
    topk = np.concatenate([r.topk for r in res])
    gates = np.concatenate([r.gates for r in res])
    trace = Trace(topk=topk, gates=gates, domain=np.zeros(len(topk), np.int64))
    prompt_rows = np.array([r.topk.shape[0] - (len(r.tokens) - 1) for r in res])
    passes = np.array([len(r.tokens) for r in res])  # one prefill + G-1 decode passes
    R, P = len(res), int(passes.sum())
    first_pass = np.concatenate([[0], np.cumsum(passes)[:-1]])
    pass_request = np.repeat(np.arange(R), passes)
    k = np.arange(P) - first_pass[pass_request]
    prefill = k == 0
    count = np.where(prefill, prompt_rows[pass_request], 1)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    rows = int(count.sum())
    return trace, Scenario(
        request_user=np.array([r.user for r in res]), request_arrival=np.array([r.submitted_s for r in records]),
        request_first_pass=first_pass, request_next=np.full(R, -1), pass_request=pass_request, pass_prefill=prefill,
        pass_row_start=start, pass_row_count=count, pass_next=np.where(k < passes[pass_request] - 1, np.arange(P) + 1, -1),
        row_trace=np.arange(rows), row_user=np.repeat(np.array([r.user for r in res])[pass_request], count),
        row_pass=np.repeat(np.arange(P), count), closed=False, think_s=0.0,
    )


def with_wire_bytes(ctx, wire_bytes: int):
    """`ctx` with hidden states of `wire_bytes` on the wire (the transfer table follows)."""
    from dataclasses import replace

    from edgemoe.cluster.cost import transfer_s

    if int(wire_bytes) == ctx.wire_bytes:
        return ctx
    xfer = transfer_s(int(wire_bytes), ctx.lat_s, ctx.bw_Bps)
    np.fill_diagonal(xfer, 0.0)
    return replace(ctx, wire_bytes=int(wire_bytes), xfer_s=xfer)


def _policy(ctx, policy: str, params: dict, decision_cost):
    """The run's policy for the simulator's replay, its decisions charged as the homes charged them
    (`ServerConfig.decision_cost`; None: not charged)."""
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.decision_cost import charge_decisions

    return charge_decisions(make_policy(policy, ctx, **params), decision_cost)


def predicted_metrics(ctx, policy: str, params: dict, records, wire_bytes: int | None = None,
                      decision_cost=None) -> dict:
    """The simulator's metrics for the same requests (fast engine, default window); wire_bytes: the bytes
    one hidden state really took on the wire in the run (default: the context's); decision_cost: the run's
    `ServerConfig.decision_cost` (a DecisionCost or None)."""
    from edgemoe.runtime.sim.simulate import simulate_scenario

    if wire_bytes is not None:
        ctx = with_wire_bytes(ctx, wire_bytes)
    trace, scenario = replay_scenario(records, ctx.num_layers)
    m = simulate_scenario(ctx, _policy(ctx, policy, params, decision_cost), trace, scenario)
    return {"latency_ms": m.latency_ms, "ttft_ms": m.ttft_ms, "throughput_tokens_per_s": m.throughput_tokens_per_s,
            "traffic_bytes_per_1k_tokens": m.traffic_bytes_per_1k_tokens, "remote_ratio": m.remote_ratio,
            "substitution_ratio": m.substitution_ratio, "drop_ratio": m.drop_ratio, "makespan_s": m.makespan_s,
            "latency_quantiles_ms": m.extra.get("latency_quantiles_ms", []), "utilisation": m.utilisation,
            "requests": m.requests, "generated_tokens": m.generated_tokens}


def compare(measured: dict, predicted: dict) -> dict:
    """Relative error (measured - predicted) / predicted of the headline numbers."""
    def rel(a, b):
        return float((a - b) / b) if b else float("nan")

    return {
        "latency_mean": rel(measured["latency_ms"]["mean"], predicted["latency_ms"]["mean"]),
        "latency_p50": rel(measured["latency_ms"]["p50"], predicted["latency_ms"]["p50"]),
        "latency_p99": rel(measured["latency_ms"]["p99"], predicted["latency_ms"]["p99"]),
        "ttft_mean": rel(measured["ttft_ms"]["mean"], predicted["ttft_ms"]["mean"]),
        "throughput": rel(measured["throughput_tokens_per_s"], predicted["throughput_tokens_per_s"]),
        "traffic": rel(measured["traffic_bytes_per_1k_tokens"], predicted["traffic_bytes_per_1k_tokens"]),
        "remote_ratio": rel(measured["remote_ratio"], predicted["remote_ratio"]),
    }


def reference_events(ctx, policy: str, params: dict, records, wire_bytes: int | None = None, decision_cost=None):
    """The reference simulator's replay of `records` with every job's event times (decision_cost: as
    `predicted_metrics`).

    Returns (pass_begin [P], pass_end [P], jobs [J, 7]: pass, layer, node, arrival, start, finish, done,
    dense [P*L, 6]: pass, layer, home, arrival, start, end of each layer's dense work), passes numbered as
    `replay_scenario` orders them (requests by submit time, then prefill, decode passes)."""
    from edgemoe.runtime.sim.des import run_reference

    if wire_bytes is not None:
        ctx = with_wire_bytes(ctx, wire_bytes)
    trace, scenario = replay_scenario(records, ctx.num_layers)
    jobs: list = []
    dense: list = []
    run = run_reference(ctx, _policy(ctx, policy, params, decision_cost), trace, scenario, record=jobs,
                        record_dense=dense)
    return run.pass_begin, run.pass_end, np.array(jobs, float).reshape(-1, 7), np.array(dense, float).reshape(-1, 6)


def emulated_events(records):
    """The same as `reference_events` from what the homes recorded: (pass_begin, pass_end, jobs [J, 7],
    dense [P*L, 6])."""
    records = sorted(records, key=lambda r: r.submitted_s)
    res = [r.result for r in records]
    first = np.cumsum([0] + [len(r.tokens) for r in res[:-1]])
    jobs = [np.column_stack([r.events[:, 0] + f, r.events[:, [1, 2, 6, 7, 8, 9]]]) for r, f in zip(res, first, strict=True)]
    dense = [np.column_stack([r.dense_events[:, 0] + f, r.dense_events[:, 1:]]) for r, f in zip(res, first, strict=True)
             if r.dense_events is not None and len(r.dense_events)]
    return (np.concatenate([r.pass_begin_s for r in res]), np.concatenate([r.pass_end_s for r in res]),
            np.concatenate(jobs) if jobs else np.zeros((0, 7)), np.concatenate(dense) if dense else np.zeros((0, 6)))


def sorted_jobs(jobs: np.ndarray) -> np.ndarray:
    """jobs [J, 7] in (pass, layer, node, arrival, start, ...) order, for comparing two runs row by row."""
    return jobs[np.lexsort(jobs.T[::-1])]
