"""SlimCaching capacity and user sweeps: does its gain over greedy and LFU peak at small storage?

    python -m bench.studies.slim_sweeps [--quick]

Writes bench/results/slim_sweeps.json and slim_sweeps.png (atomically) and prints tables. Problems are
`edgemoe.plan.synthetic.synthetic_problem` with user devices and a cloud (1 MB experts). Sweeps:
- edge storage: every edge server holds 5%..100% of the model's bytes (devices fixed at 5%);
- device storage: every device holds 5%..100% of the model (edge servers fixed at 20%);
- users: 6..48 users (storage as the base).
Planners: slimcaching (default), slimcaching(one pass), greedy (strong: best of true-objective and K = 1
greedy), lfu (device-aware), and the exact ILP with a time limit: its objective when it proves
optimality, else its dual bound (a lower bound on the optimal latency) where HiGHS returns one.
Cells are expected per-token MoE latency divided by all-cloud. Planning seconds are process CPU time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, environment
from edgemoe.io import atomic_write_json, atomic_write_with
from edgemoe.plan import plan
from edgemoe.plan.base import empty_hosts
from edgemoe.plan.objective import expected_latency
from edgemoe.plan.synthetic import synthetic_problem

BASE = dict(num_servers=4, num_users=12, num_layers=6, num_experts=8, top_k=2, with_devices=True, num_tokens=1500,
            seed=0)
FRACTIONS = [0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0]
PLANNERS = {"slimcaching": ("slimcaching", {}), "slimcaching(one pass)": ("slimcaching", {"refine": False}),
            "greedy": ("greedy", {}), "lfu": ("lfu", {})}


def slots(fraction: float) -> int:
    """Expert slots holding `fraction` of the model (at least 1)."""
    return max(1, int(round(fraction * BASE["num_layers"] * BASE["num_experts"])))


def run_point(problem, ilp_limit: float) -> dict:
    cloud = expected_latency(problem, empty_hosts(problem))
    row = {"all_cloud_s": cloud, "planners": {}}
    for label, (method, params) in PLANNERS.items():
        start = time.process_time()
        placement = plan(problem, method, **params)
        row["planners"][label] = {"objective_s": expected_latency(problem, placement.hosts),
                                  "cpu_s": time.process_time() - start}
    if ilp_limit > 0:
        start = time.process_time()
        try:
            ilp = plan(problem, "exact", time_limit=ilp_limit).params
            bound = ilp["objective_s"] if ilp["optimal"] else ilp.get("mip_dual_bound")
            row["ilp"] = {"optimal": ilp["optimal"], "objective_s": ilp["objective_s"], "lower_bound_s": bound,
                          "cpu_s": time.process_time() - start}
        except Exception as exc:  # noqa: BLE001 - a failed ILP is reported, not fatal
            row["ilp"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    slim = row["planners"]["slimcaching"]["objective_s"]
    for base in ("greedy", "lfu"):
        row[f"slimcaching_below_{base}_pct"] = 100 * (1 - slim / row["planners"][base]["objective_s"])
    return row


def sweeps(quick: bool) -> dict:
    fractions = [0.05, 0.2, 1.0] if quick else FRACTIONS
    users = [6, 24] if quick else [6, 12, 24, 48]
    edge_default, device_default = slots(0.2), slots(0.05)
    return {
        "edge_storage": (fractions, lambda f: synthetic_problem(**{**BASE, "slots_per_server": slots(f),
                                                                   "device_slots": device_default})),
        "device_storage": (fractions, lambda f: synthetic_problem(**{**BASE, "slots_per_server": edge_default,
                                                                     "device_slots": slots(f)})),
        "users": (users, lambda u: synthetic_problem(**{**BASE, "num_users": u, "slots_per_server": edge_default,
                                                        "device_slots": device_default})),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["sweeps"])
    fig, axes = plt.subplots(2, len(names), figsize=(4.5 * len(names), 7), squeeze=False)
    for col, name in enumerate(names):
        sweep = results["sweeps"][name]
        xs = sweep["xs"]
        for label in PLANNERS:
            ys = [p["planners"][label]["objective_s"] / p["all_cloud_s"] for p in sweep["points"]]
            axes[0, col].plot(xs, ys, "-o" if label.startswith("slim") else "--.", label=label, ms=3)
        bound = [p.get("ilp", {}).get("lower_bound_s") for p in sweep["points"]]
        bx = [x for x, b in zip(xs, bound, strict=True) if b is not None]
        by = [b / p["all_cloud_s"] for b, p in zip(bound, sweep["points"], strict=True) if b is not None]
        axes[0, col].plot(bx, by, ":k", label="ILP optimum / lower bound")
        for base in ("greedy", "lfu"):
            axes[1, col].plot(xs, [p[f"slimcaching_below_{base}_pct"] for p in sweep["points"]], "-o",
                              label=f"below {base}", ms=3)
        axes[0, col].set_title(f"latency / all-cloud vs {name}")
        axes[1, col].set_title(f"slimcaching gain (%) vs {name}")
        for ax in axes[:, col]:
            ax.set_xlabel(name + (" (fraction of model)" if "storage" in name else ""))
    axes[0, 0].legend(fontsize=7)
    axes[1, 0].legend(fontsize=7)
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three points per sweep, short ILP limit")
    parser.add_argument("--ilp-limit", type=float, default=None, help="seconds per ILP (0: skip the ILP)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args()
    ilp_limit = args.ilp_limit if args.ilp_limit is not None else (3.0 if args.quick else 10.0)
    start = time.perf_counter()
    results = {"schema": "edgemoe.bench.slim_sweeps/1", "mode": "quick" if args.quick else "full",
               "command": "python -m bench.studies.slim_sweeps" + (" --quick" if args.quick else ""),
               "environment": environment(), "base_problem": BASE, "ilp_time_limit_s": ilp_limit,
               "objective": "expected per-token MoE latency (s), edgemoe.plan.objective.expected_latency",
               "sweeps": {}}
    for name, (xs, make) in sweeps(args.quick).items():
        points = []
        for x in xs:
            points.append({"x": x, **run_point(make(x), ilp_limit)})
            print(f"  {name}={x} done", file=sys.stderr, flush=True)
        gains = {b: [p[f"slimcaching_below_{b}_pct"] for p in points] for b in ("greedy", "lfu")}
        results["sweeps"][name] = {"xs": xs, "points": points,
                                   "largest_gain_at": {b: xs[int(np.argmax(g))] for b, g in gains.items()}}
    results["total_seconds"] = time.perf_counter() - start
    results["environment"] = environment()  # now, so that its cpu_s covers the run
    suffix = "-quick" if args.quick else ""
    atomic_write_json(args.out / f"slim_sweeps{suffix}.json", results)
    plot(results, args.out / f"slim_sweeps{suffix}.png")
    for name, sweep in results["sweeps"].items():
        print(f"\n## {name}: latency / all-cloud (ILP: optimum or lower bound)")
        print(f"{'planner':24s}" + "".join(f"{x!s:>9s}" for x in sweep["xs"]))
        for label in PLANNERS:
            print(f"{label:24s}" + "".join(f"{p['planners'][label]['objective_s'] / p['all_cloud_s']:9.3f}"
                                           for p in sweep["points"]))
        cells = []
        for p in sweep["points"]:
            b = p.get("ilp", {}).get("lower_bound_s")
            cells.append(f"{b / p['all_cloud_s']:8.3f}{'*' if p['ilp'].get('optimal') else ' '}" if b else f"{'-':>9s}")
        print(f"{'ILP (* = optimal)':24s}" + "".join(cells))
        for base in ("greedy", "lfu"):
            print(f"{'% below ' + base:24s}" + "".join(f"{p[f'slimcaching_below_{base}_pct']:9.1f}"
                                                      for p in sweep["points"]))
        print(f"largest gain at: {sweep['largest_gain_at']}")
    print(f"\ntotal {results['total_seconds']:.0f}s; wrote {args.out}/slim_sweeps{suffix}.json and .png")


if __name__ == "__main__":
    main()
