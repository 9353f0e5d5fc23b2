"""Policy benchmark: microseconds per token-layer of every runtime policy (target <= 10 us, batched).

    python -m bench.speed.policies [--quick]

One `decide` call per layer for T token rows (T = batch x sequence rows, as the local backend calls it),
on a synthetic profile and a placement by the `ordermoe` planner (capped at PLAN_EVALS evaluations), in both token-location modes, without
and with a load vector. Reports the median over repeats of (wall time of the L calls) / (T x L), and the same in
CPU time of this process (`cpu_us_per_token_layer`; the host is shared, so CPU time is the steadier figure); table
build time (look-ahead tables) is reported separately, and so is the oracle's `start` (its dynamic program over
every row's true path, `start_us_per_token_layer`). ordermoe with H >= 1 in migrate mode is the steered
decision (meeting node and replicas chosen with the look-ahead). Writes bench/results/policies.json.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from bench.common import RESULTS, environment
from edgemoe.cluster import generate, load_cluster
from edgemoe.io import atomic_write_json
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy

POLICIES = [("exact", {}), ("drop", {}), ("slimcaching", {}), ("ordermoe(H=0)", {"horizon": 0}),
            ("ordermoe(H=2)", {"horizon": 2}), ("ordermoe(H=3)", {"horizon": 3}), ("oracle", {})]
TARGET_US = 10.0
PLAN_EVALS = 500  # the ordermoe planner's evaluations per setup (its default is 4000)


def setups(quick: bool):
    """(label, profile, cluster) cases: edge8 with a small and a Mixtral-like shape, and 64 servers."""
    yield "edge8 L=8 E=8 K=2", synthetic_profile(8, 8, 2, 3000, seed=0), load_cluster("edge8")
    if not quick:
        yield "edge8 L=32 E=8 K=2", synthetic_profile(32, 8, 2, 3000, seed=1), load_cluster("edge8")
        yield "edge8 L=16 E=64 K=8", synthetic_profile(16, 64, 8, 3000, seed=2), load_cluster("edge8")
        yield "generate(64, 500) L=16 E=32 K=4", synthetic_profile(16, 32, 4, 3000, seed=3), generate(64, 500, seed=0)


def time_policy(pol, profile, rows, users, load, repeats: int) -> tuple[float, float, float]:
    """(median wall seconds per token-layer of the decide calls, of the start call, median CPU seconds of the
    decide calls per token-layer)."""
    L = profile.L
    topk = profile.topk[rows].astype(np.int64)
    gates = profile.gates[rows].astype(float)
    samples, starts, cpu = [], [], []
    for _ in range(repeats):
        t = time.perf_counter()
        state = pol.start(users, tokens=rows)
        starts.append((time.perf_counter() - t) / (len(rows) * L))
        t, c = time.perf_counter(), time.process_time()
        for layer in range(L):
            pol.decide(layer, topk[:, layer], gates[:, layer], state, load)
        samples.append((time.perf_counter() - t) / (len(rows) * L))
        cpu.append((time.process_time() - c) / (len(rows) * L))
    return float(np.median(samples)), float(np.median(starts)), float(np.median(cpu))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--setups", default="", help="comma-separated substrings: run only the setups whose label has one")
    ap.add_argument("--policies", default="", help="comma-separated policy names (default: all)")
    args = ap.parse_args()
    only = [x for x in args.setups.split(",") if x]
    names = [x for x in args.policies.split(",") if x]
    rows_out = []
    for label, profile, cluster in setups(args.quick):
        if only and not any(x in label for x in only):
            continue
        # a capped search: the decision's cost depends on how replicas spread, not on the last percent of the
        # placement's quality, and the full search costs minutes per setup here
        placement = plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe", max_evals=PLAN_EVALS)
        for mode in ("migrate", "home"):
            ctx = make_context(profile, cluster, placement, mode=mode, domain_fallback=True)
            rng = np.random.default_rng(0)
            for T in (1, 64, 1024):
                rows = rng.integers(0, profile.num_tokens, T)
                users = rng.integers(0, ctx.num_users, T)
                for name, params in POLICIES:
                    if names and name not in names:
                        continue
                    t0 = time.perf_counter()
                    if name == "oracle":
                        if T == 1024 and not label.startswith("edge8 L=8"):
                            continue  # its dynamic program over 1024 rows x all nodes x all actions: minutes
                        params = {"routing": (profile.topk, profile.gates)}
                    pol = make_policy(name.split("(")[0], ctx, **params)
                    build = time.perf_counter() - t0
                    for loaded in (False, True):
                        load = np.random.default_rng(1).exponential(0.005, ctx.num_nodes) if loaded else None
                        us, start, cpu = time_policy(pol, profile, rows, users, load, repeats=3 if T > 1 else 5)
                        us, start, cpu = 1e6 * us, 1e6 * start, 1e6 * cpu
                        rows_out.append({"setup": label, "mode": mode, "rows_per_call": T, "policy": name,
                                         "load": loaded, "us_per_token_layer": us, "cpu_us_per_token_layer": cpu, "build_s": build,
                                         "start_us_per_token_layer": start})
                        print(f"{label:32s} {mode:8s} T={T:5d} {name:14s} load={int(loaded)}  {us:9.2f} us/token-layer (CPU {cpu:7.2f})"
                              f"  (build {build * 1e3:.0f} ms)", flush=True)
    batched = [r for r in rows_out if r["rows_per_call"] >= 64]
    worst = max(batched, key=lambda r: r["us_per_token_layer"])
    worst_cpu = max(batched, key=lambda r: r["cpu_us_per_token_layer"])
    edge8 = [r for r in batched if r["setup"].startswith("edge8 L=8") and r["mode"] == "migrate"]
    summary = {"target_us": TARGET_US, "worst_batched": worst,
               "meets_target_batched": worst["us_per_token_layer"] <= TARGET_US,
               "worst_batched_cpu": worst_cpu, "meets_target_batched_cpu": worst_cpu["cpu_us_per_token_layer"] <= TARGET_US,
               "setups": only or "all", "policies": names or "all",
               "edge8_migrate_batched_us": {r["policy"]: max(x["us_per_token_layer"] for x in edge8 if x["policy"] == r["policy"])
                                            for r in edge8}}
    summary["load_average_1_5_15"] = list(os.getloadavg())  # the machine is shared: read ratios, not absolutes
    atomic_write_json(RESULTS / ("policies.json" if not (only or names) else "policies_partial.json"), {
        "benchmark": "policies", "quick": args.quick, "summary": summary, "rows": rows_out,
        "environment": environment(),
    })
    print(f"\nworst at T >= 64: {worst['us_per_token_layer']:.2f} us/token-layer ({worst['policy']}, {worst['setup']}, "
          f"{worst['mode']}); target <= {TARGET_US:g} us: {'met' if summary['meets_target_batched'] else 'MISSED'}")


if __name__ == "__main__":
    main()
