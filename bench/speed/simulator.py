"""Simulator benchmark: token-layer events per second of the `simulate` backend (target >= 1M here).

    python -m bench.speed.simulator [--quick]

A token-layer event = one token row passing one MoE layer (its K slots decided, queued, served, gathered).
Scenarios grow from edge8 with 16 users to generated clusters of hundreds of servers and thousands of
users (closed loop: every user keeps one request in flight). Each is run with the fast engine (default
the default window, `DEFAULT_WINDOW_S`) and, where small enough, the exact reference engine, to show the speed-up and the agreement.
Wall time is the headline (events_per_s); CPU time of this process is recorded too, because the machine is
shared and wall time moves with the other processes' load. Each fast-engine run is repeated (`--repeat`, 3)
and the fastest kept, as timeit does (the first run's CPU seconds are kept too, `cpu_s_first_run`: a context's
first ordermoe run also builds the look-ahead tables that its later runs reuse): the slower repeats measure the
other processes on the host, not the simulator (every repeat gives the same result; the load average is
recorded beside each row). The repeats of exact and ordermoe on one scenario take turns (exact, ordermoe,
exact, ...), so that the ratio of their times (issue 21's target) compares runs made under the same host
conditions: on this project's shared hosts the speed of one process drifts by tens of percent over a minute.
The compiled part of the fast engine is warmed up (compiled or loaded from numba's cache) before anything is
timed. Writes bench/results/simulator.json.
"""

from __future__ import annotations

import argparse
import os

from bench.common import RESULTS, environment, fastest_run
from edgemoe.cluster import generate, load_cluster
from edgemoe.io import atomic_write_json
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy
from edgemoe.runtime.sim.simulate import DEFAULT_WINDOW_S, simulate
from edgemoe.runtime.sim.workload import Trace, Workload


def scenarios(quick: bool):
    """(label, cluster, workload, run the reference too)."""
    yield "edge8, 16 users, poisson 20 req/s", load_cluster("edge8"), Workload(64, 16, 16, "poisson", 20.0), True
    yield "edge8, 16 users, closed loop", load_cluster("edge8"), Workload(64, 16, 16, "closed"), True
    if quick:
        return
    yield "64 servers, 1000 users, closed loop", generate(64, 1000, seed=0), Workload(2000, 16, 16, "closed"), False
    yield "256 servers, 4000 users, closed loop", generate(256, 4000, seed=0, copies=32), Workload(8000, 16, 16, "closed"), False
    yield "256 servers, 16000 users, closed loop", generate(256, 16000, seed=0, copies=32), Workload(32000, 16, 16, "closed"), False


def warm_up(profile, trace) -> None:
    """Run a tiny simulation so that numba's compilation (or cache load) is not timed."""
    cluster = load_cluster("edge8")
    ctx = make_context(profile, cluster, plan(plan_problem(profile, cluster, domain_fallback=True), "uniform"),
                       domain_fallback=True)
    simulate(ctx, make_policy("exact", ctx), trace, Workload(2, 2, 2, "closed"))


def contexts(quick: bool, max_users: int | None = None):
    """(label, ctx, trace, workload, run the reference too) per scenario (`scenarios`; those with at most
    max_users users when given, skipped before they are planned): the benchmark's synthetic profile (L=8, E=8,
    K=2), an ordermoe placement, migrate mode; the compiled engine warmed up first. The other simulator-cost
    studies (`bench.speed.backlog_cost`, `bench.studies.window_error`) time the same contexts."""
    profile = synthetic_profile(num_layers=8, num_experts=8, top_k=2, num_tokens=3000, seed=0)
    trace = Trace.from_profile(profile)
    warm_up(profile, trace)
    for label, cluster, wl, with_ref in scenarios(quick):
        if max_users is not None and cluster.num_users > max_users:
            continue
        placement = plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe")
        yield label, make_context(profile, cluster, placement, mode="migrate", domain_fallback=True), trace, wl, with_ref


def timed_runs(repeats: int, runs: dict) -> dict:
    """{name: (result, fastest wall s, fastest CPU s, first run's CPU s)} of `run_once(*runs[name])`, each called
    `repeats` times, the names taking turns (one run of each, then again): a drift of the host's speed then
    reaches every name alike. The first run's CPU is kept apart because a context's first ordermoe run also
    builds its look-ahead tables (kept for the later runs on the same context)."""
    out = {}
    for _ in range(max(int(repeats), 1)):
        for name, args in runs.items():
            m, wall, cpu = fastest_run(1, run_once, *args)
            if name in out:
                _, w0, c0, first = out[name]
                out[name] = (m, min(w0, wall), min(c0, cpu), first)
            else:
                out[name] = (m, wall, cpu, cpu)
    return out


def run_once(ctx, policy: str, params: dict, trace, wl, engine: str, window: float):
    """One simulation with a fresh policy (a policy keeps state across a run)."""
    return simulate(ctx, make_policy(policy, ctx, **params), trace, wl, engine=engine, window_s=window)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each fast-engine row; the fastest is kept")
    args = ap.parse_args()
    rows = []
    for label, ctx, trace, wl, with_ref in contexts(args.quick):
        policies = (("exact", {}), ("ordermoe", {"horizon": 2}))
        fast_load = os.getloadavg()[0]
        fast = timed_runs(args.repeat, {policy: (ctx, policy, params, trace, wl, "fast", DEFAULT_WINDOW_S)
                                        for policy, params in policies})
        for policy, params in policies:
            engines = [("fast", DEFAULT_WINDOW_S)] + ([("reference", 0.0)] if with_ref else [])
            for engine, window in engines:
                if engine == "fast":
                    m, wall, cpu, first = fast[policy]
                    load, repeats = fast_load, max(args.repeat, 1)
                else:
                    load = os.getloadavg()[0]
                    m, wall, cpu, first = timed_runs(1, {policy: (ctx, policy, params, trace, wl, engine, window)})[policy]
                    repeats = 1
                row = {"scenario": label, "nodes": ctx.num_nodes, "users": ctx.num_users, "policy": policy,
                       "engine": engine, "window_s": window, "token_layers": m.token_layers, "wall_s": wall,
                       "events_per_s": m.token_layers / wall, "cpu_s": cpu, "cpu_s_first_run": first,
                       "events_per_cpu_s": m.token_layers / cpu, "latency_ms_mean": m.latency_ms["mean"],
                       "latency_ms_p99": m.latency_ms["p99"], "ttft_ms_mean": m.ttft_ms["mean"],
                       "simulated_s": m.makespan_s, "load_average_1min": round(load, 2),
                       "repeats": repeats}
                exact = [r for r in rows if r["scenario"] == label and r["engine"] == engine and r["policy"] == "exact"]
                if policy != "exact" and exact:
                    row["cpu_ratio_to_exact"] = cpu / exact[0]["cpu_s"]
                rows.append(row)
                print(f"{label:40s} {policy:9s} {engine:9s} {m.token_layers:9d} events {wall:7.2f} s "
                      f"{row['events_per_s']:11.0f} ev/s ({row['events_per_cpu_s']:9.0f} per CPU s)  mean {m.latency_ms['mean']:7.2f} ms  "
                      f"p99 {m.latency_ms['p99']:7.2f} ms", flush=True)
    ratios = [r["cpu_ratio_to_exact"] for r in rows if r["engine"] == "fast" and "cpu_ratio_to_exact" in r]
    om64 = [r for r in rows if r["engine"] == "fast" and r["policy"] == "ordermoe" and r["nodes"] == 64
            and r["users"] == 1000]
    best = max(rows, key=lambda r: r["events_per_s"])
    best_cpu = max(rows, key=lambda r: r["events_per_cpu_s"])
    atomic_write_json(RESULTS / "simulator.json", {
        "benchmark": "simulator", "quick": args.quick, "target_events_per_s": 1e6,
        "best": best, "meets_target": best["events_per_s"] >= 1e6,
        # issue 10's paper-scale target, in CPU time (the machine is shared: wall time moves with the load)
        "target_events_per_cpu_s": 2e6, "best_cpu": best_cpu,
        "meets_cpu_target": best_cpu["events_per_cpu_s"] >= 2e6,
        # issue 21's: ordermoe within 2.5x of exact's CPU time on every fast-engine row, >= 1M events per CPU s
        # at 64 servers x 1000 users
        "ordermoe_max_cpu_ratio_to_exact": max(ratios) if ratios else None,
        "ordermoe_within_2_5x_exact": bool(ratios) and max(ratios) <= 2.5,
        "ordermoe_events_per_cpu_s_64x1000": om64[0]["events_per_cpu_s"] if om64 else None,
        "rows": rows,
        "environment": environment(),
    })
    print(f"\nbest {best['events_per_s']:.0f} token-layer events/s ({best['scenario']}, {best['policy']}); "
          f"target >= 1M: {'met' if best['events_per_s'] >= 1e6 else 'MISSED'}; best {best_cpu['events_per_cpu_s']:.0f} "
          f"per CPU s, target >= 2M: {'met' if best_cpu['events_per_cpu_s'] >= 2e6 else 'MISSED'}")


if __name__ == "__main__":
    main()
