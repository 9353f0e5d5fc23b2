"""Ray backend against the simulator as users grow: where the host saturates without dilation, and that
dilation holds the error (issue 12).

    python -m bench.ray.ray_sweep [--users 1 4 16 32] [--requests 2] [--gen 8] [--quick]

edge8, default model, ordermoe placement, exact policy, home mode, bf16 wire, links emulated. For each user
count: a closed loop of `--requests` requests per user at dilation 1 and at the calibrated dilation (one CPU
calibration for the whole sweep). Each row: measured (Ray, nominal ms) beside the simulator's replay of the
very requests Ray ran, their ratio, k, host and Ray CPU, lateness, validity. Writes
bench/results/ray_sweep.json and prints the table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import RESULTS


def row(users: int, out: dict) -> dict:
    m, p = out["measured"], out["predicted"]
    return {"users": users, "dilation": out["dilation"], "requests": m["requests"],
            "measured_mean_ms": m["latency_ms"]["mean"], "simulated_mean_ms": p["latency_ms"]["mean"],
            "ratio_mean": m["latency_ms"]["mean"] / p["latency_ms"]["mean"],
            "measured_p99_ms": m["latency_ms"]["p99"], "simulated_p99_ms": p["latency_ms"]["p99"],
            "ratio_p99": m["latency_ms"]["p99"] / p["latency_ms"]["p99"],
            "late_share": m["late_share"], "host_util": out["cpu"]["host_util"], "ray_cores": out["cpu"]["ray_cores_busy"],
            "other_cores": out["cpu"]["other_cores_busy"], "load_avg": out["cpu"]["load_avg_1min_after"],
            "wall_s": out["cpu"]["wall_s"], "valid": out["valid"], "invalid_because": out["invalid_because"],
            "errors": len(out["errors"]), "duplicates": out["duplicates"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--dilations", nargs="+", default=["1", "auto"])
    ap.add_argument("--out", type=Path, default=RESULTS / "ray_sweep.json")
    args = ap.parse_args()

    from bench.common import environment, setup
    from edgemoe.distributed.cli import load_prompts
    from edgemoe.distributed.loadrun import calibrate, measure_load
    from edgemoe.distributed.measure import predicted_metrics
    from edgemoe.distributed.serve import Client, Deployment, start_ray, stop_ray
    from edgemoe.distributed.server import ServerConfig
    from edgemoe.io import atomic_write_json

    ctx, path = setup("exact")
    prompts = load_prompts("default", 32, 16)
    start_ray(ctx.node_names)
    dep = Deployment.launch(ServerConfig(ctx, path))
    client = Client(dep)
    rows, t_all = [], time.perf_counter()
    try:
        cal = calibrate(dep, client, list(range(ctx.num_users)), prompts, args.gen)
        print(f"calibration: {cal['cpu_s_per_token'] * 1e3:.1f} ms CPU per token, {cal['free_cores']:.2f} free cores")
        for users in args.users:
            who = [u % ctx.num_users for u in range(users)]
            sim_s = None
            for k in args.dilations:
                if k == "auto" and sim_s is None:  # size k from the replayed simulation of the undilated run
                    sim_s = rows[-1]["simulated_mean_ms"] / 1e3 if rows and rows[-1]["users"] == users else None
                    if sim_s is None:
                        probe = measure_load(dep, who, prompts, args.gen, 1, dilation=1.0, client=client)
                        sim_s = predicted_metrics(ctx, "exact", {}, probe["records"])["latency_ms"]["mean"] / 1e3
                out = measure_load(dep, who, prompts, args.gen, args.requests, dilation="auto" if k == "auto" else float(k),
                                   sim_latency_s=sim_s, client=client, calibration=cal)
                r = row(users, out)
                rows.append(r)
                print(f"users {users:3d} k {r['dilation']:6.0f}: measured {r['measured_mean_ms']:8.2f} ms vs simulated "
                      f"{r['simulated_mean_ms']:8.2f} ms (x{r['ratio_mean']:.3f}; p99 x{r['ratio_p99']:.3f}) late "
                      f"{100 * r['late_share']:5.1f}% host CPU {100 * r['host_util']:3.0f}% ray {r['ray_cores']:.2f} cores "
                      f"{'valid' if r['valid'] else 'INVALID'} ({r['wall_s']:.0f} s)", flush=True)
    finally:
        dep.shutdown()
        stop_ray()
    doc = {"benchmark": "ray_sweep", "cluster": "edge8", "model": "default", "placement": ctx.placement_method,
           "policy": "exact", "mode": ctx.mode, "wire": "bf16", "gen_tokens": args.gen, "prompt_tokens": 16,
           "requests_per_user": args.requests, "calibration": cal, "rows": rows,
           "total_wall_s": time.perf_counter() - t_all, "environment": environment()}
    RESULTS.mkdir(exist_ok=True)
    atomic_write_json(args.out, doc)
    print_table(doc)


def print_table(doc: dict) -> None:
    print("\n| users | k | measured mean ms | simulated mean ms | ratio | p99 ratio | late | host CPU | Ray cores | valid |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["rows"]:
        print(f"| {r['users']} | {r['dilation']:.0f} | {r['measured_mean_ms']:.2f} | {r['simulated_mean_ms']:.2f} | "
              f"{r['ratio_mean']:.3f} | {r['ratio_p99']:.3f} | {100 * r['late_share']:.1f}% | {100 * r['host_util']:.0f}% | "
              f"{r['ray_cores']:.2f} | {'yes' if r['valid'] else 'no'} |")


if __name__ == "__main__":
    main()
