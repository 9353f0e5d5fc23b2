"""Planner benchmark: planning time and SlimCaching objective of every registered planner.

    python -m bench.speed.planners [--quick]

Writes bench/results/planners.json and planners.png (atomically) and prints tables. Every planner is run
with its defaults on synthetic problems (`edgemoe.plan.synthetic`: users on their own devices, edge
servers, a cloud) while one dimension grows; the objective is `edgemoe.plan.objective.expected_latency`
(expected per-token MoE latency, seconds). Also: the optimality gap to the exact ILP on small instances
with the paper's stated bounds beside it (`slimcaching.bounds`: (1 - kappa_g)/2 with the measured supermodular
curvature, 1/2, 1/4, and the K = 1 guarantee, as fractions of the optimal latency reduction), SlimCaching's
two scale targets (process CPU time: Mixtral scale <= 1 s, Qwen scale <= 10 s), the max-convolution fast
path against naive where its condition holds, and the device-edge-cloud preset with K = 2. Every run
records wall seconds and process CPU seconds; the machine's load average is recorded beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, environment
from edgemoe.io import atomic_write_json, atomic_write_with
from edgemoe.plan import planners
from edgemoe.plan.base import empty_hosts
from edgemoe.plan.objective import expected_latency
from edgemoe.plan.slimcaching.bounds import instance_bounds
from edgemoe.plan.slimcaching.multimodel import combine_models
from edgemoe.plan.synthetic import synthetic_problem
from edgemoe.profile import synthetic_profile

# The largest point of a sweep each slow planner is run at (sweep -> label -> x), fixed in advance so that the
# file's rows never depend on the host's load: beyond these the planners take minutes each on 2 cores
# (ordermoe's replay grows with experts x layers, SlimCaching's DP with experts). Every other point is run.
LARGEST_RUN = {"experts": {"ordermoe": 8, "slimcaching": 32}, "layers": {"ordermoe": 16}}
BASE = dict(num_servers=10, num_users=50, num_layers=8, num_experts=8, top_k=2, slots_per_server=12,
            with_devices=True, device_slots=2, num_tokens=2000, seed=0)


def variants() -> dict[str, tuple[str, dict]]:
    """Label -> (registered planner, params): every registered planner with defaults, plus SlimCaching variants.

    `slimcaching` is the default (one pass + refinement); `slimcaching(one pass)` is the paper-faithful
    successive decomposition alone; passes=3 and fptas are also without refinement, to compare with it.
    """
    table = {name: (name, {}) for name in sorted(planners()) if name != "exact"}
    table["slimcaching(one pass)"] = ("slimcaching", {"refine": False})
    table["slimcaching(passes=3)"] = ("slimcaching", {"passes": 3, "refine": False})
    table["slimcaching(fptas)"] = ("slimcaching", {"maxconv": "fptas", "epsilon": 0.1, "refine": False})
    return table


# SlimCaching from the rounded LP relaxation: run only where the LP is small (the ILP-gap instances and the
# preset), not on the sweeps, whose largest points would each solve an LP of millions of rows
LP_START = {"slimcaching(lp start)": ("slimcaching", {"warm_start": "lp"})}


def run_one(problem, method: str, params: dict) -> dict:
    fn = planners()[method]
    start, cpu = time.perf_counter(), time.process_time()
    try:
        placement = fn(problem, **params)
        placement.check_capacity()
    except Exception as exc:  # a planner that fails is reported, not fatal
        return {"seconds": time.perf_counter() - start, "error": f"{type(exc).__name__}: {exc}"[:300]}
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    out = {"seconds": seconds, "cpu_s": cpu_s, "objective_s": expected_latency(problem, placement.hosts),
           "gap": placement.params.get("mip_gap")}
    for key in ("optimal", "guarantee", "variant_used", "refine_stopped_by", "kicks_run", "maxconv_used"):
        if key in placement.params:
            out[key] = placement.params[key]
    return out


def run_sweep(name: str, xs: list, make, labels: dict) -> dict:
    rows, largest = [], LARGEST_RUN.get(name, {})
    for x in xs:
        problem = make(x)
        cloud = expected_latency(problem, empty_hosts(problem))
        for label, (method, params) in labels.items():
            if label in largest and x > largest[label]:
                rows.append({"x": x, "planner": label, "skipped": f"run up to {name}={largest[label]} only"})
                continue
            rows.append({"x": x, "planner": label, "all_cloud_s": cloud, **run_one(problem, method, params)})
        print(f"  {name}={x} done", file=sys.stderr, flush=True)
    return {"xs": xs, "rows": rows}


def with_profiles(problem, num_models: int):
    """Same cluster, `num_models` different synthetic models (seeded 100+m) sharing the storage. Odd models
    have 2 fewer experts per layer and K = 1 (models with different E and K share one problem)."""
    L, E = problem.expert_bytes.shape
    K = problem.profile.K
    shapes = [(E, K) if m % 2 == 0 else (E - 2, 1) for m in range(num_models)]
    models = [dataclasses.replace(problem, profile=synthetic_profile(L, e, k, problem.profile.num_tokens, num_domains=3,
                                                                     seed=100 + m),
                                  compute_s=problem.compute_s[:, :, :e], expert_bytes=problem.expert_bytes[:, :e])
              for m, (e, k) in enumerate(shapes)]
    user_model = np.arange(len(problem.user_names)) % num_models
    return combine_models(models, user_model, names=[f"m{m}" for m in range(num_models)])


def sweeps(quick: bool) -> dict[str, tuple[list, object]]:
    def synth(**over):
        return synthetic_problem(**{**BASE, **over})

    if quick:
        return {
            "servers": ([4, 16], lambda x: synth(num_servers=x, num_users=20)),
            "users": ([10, 50], lambda x: synth(num_users=x)),
            "models": ([1, 2], lambda x: with_profiles(synth(num_layers=4), x)),
            "slots_per_server": ([4, 16], lambda x: synth(slots_per_server=x)),
            "experts": ([8, 16], lambda x: synth(num_experts=x, slots_per_server=2 * x)),
            "layers": ([4, 16], lambda x: synth(num_layers=x)),
        }
    return {
        "servers": ([4, 16, 64], lambda x: synth(num_servers=x)),
        "users": ([10, 100, 500], lambda x: synth(num_users=x)),
        "models": ([1, 2, 4], lambda x: with_profiles(synth(), x)),
        "slots_per_server": ([2, 8, 32], lambda x: synth(slots_per_server=x)),
        "experts": ([8, 32, 64], lambda x: synth(num_experts=x, slots_per_server=x + x // 2)),
        "layers": ([4, 16, 32], lambda x: synth(num_layers=x)),
    }


def ilp_gaps(quick: bool, labels: dict) -> list[dict]:
    """Gap (objective / ILP optimum - 1) of every planner on small instances the ILP solves."""
    shapes = [dict(num_servers=2, num_users=3, num_layers=2, num_experts=4, slots_per_server=3, device_slots=1),
              dict(num_servers=3, num_users=5, num_layers=2, num_experts=6, slots_per_server=4, device_slots=2),
              dict(num_servers=2, num_users=3, num_layers=2, num_experts=6, slots_per_server=3, device_slots=1,
                   top_k=1)]
    seeds = range(2) if quick else range(5)
    out = []
    for shape_id, shape in enumerate(shapes):
        for seed in seeds:
            problem = synthetic_problem(with_devices=True, num_tokens=500, seed=seed, **shape)
            ilp = run_one(problem, "exact", {"time_limit": 30.0})
            cloud = expected_latency(problem, empty_hosts(problem))
            row = {"instance": f"shape{shape_id}-seed{seed}", **shape, "ilp": ilp, "all_cloud_s": cloud,
                   "bounds": instance_bounds(problem)}
            for label, (method, params) in labels.items():
                r = run_one(problem, method, params)
                if "objective_s" in r and "objective_s" in ilp:
                    r["gap"] = r["objective_s"] / ilp["objective_s"] - 1
                    saved = cloud - ilp["objective_s"]
                    r["reduction_ratio"] = (cloud - r["objective_s"]) / saved if saved > 0 else 1.0
                row[label] = r
            out.append(row)
    return out


def maxconv_speed(quick: bool) -> dict:
    """Monotone path vs naive on concave layer tables after a convex one (the path's condition), at the
    byte-level grid of unequal expert sizes (C = 4096 units). Side by side, same process, CPU seconds."""
    from edgemoe.plan.slimcaching.maxconv import solve_layers

    rng = np.random.default_rng(0)
    size, layers = (1025, 8) if quick else (4097, 16)
    convex = np.linspace(0, 1, size) ** 2
    concave = [np.concatenate([[0.0], np.cumsum(np.sort(rng.uniform(0, 1, size - 1))[::-1])]) for _ in range(layers)]
    tables = np.stack([convex] + concave)
    out = {"capacity_units": size - 1, "layers": layers + 1}
    for method in ("naive", "auto"):
        counts: dict = {}
        start = time.process_time()
        budgets, used = solve_layers(tables, method, counts=counts)
        out[method] = {"cpu_s": time.process_time() - start, "steps": counts, "reported": used,
                       "value": float(tables[np.arange(len(budgets)), budgets].sum())}
    out["speedup"] = out["naive"]["cpu_s"] / max(out["auto"]["cpu_s"], 1e-9)
    out["same_value"] = bool(abs(out["naive"]["value"] - out["auto"]["value"]) <= 1e-9 * abs(out["naive"]["value"]))
    return out


def targets(quick: bool) -> dict:
    """SlimCaching's two scale targets (process CPU time: 1 s and 10 s), plus greedy/lfu on the same instances."""
    cases = {
        "mixtral": (dict(num_layers=32, num_experts=8, top_k=2, slots_per_server=40, device_slots=4), 1.0),
        "qwen": (dict(num_layers=24, num_experts=60, top_k=4, slots_per_server=150, device_slots=16), 10.0),
    }
    out = {}
    for name, (shape, limit) in cases.items():
        problem = synthetic_problem(num_servers=10, num_users=50, with_devices=True, num_tokens=2000, **shape)
        res = {"shape": shape, "limit_s": limit, "all_cloud_s": expected_latency(problem, empty_hosts(problem))}
        for method in ["slimcaching", "lfu"] + ([] if quick and name == "qwen" else ["greedy"]):
            if method in planners():
                res[method] = run_one(problem, method, {})
        res["slimcaching(one pass)"] = run_one(problem, "slimcaching", {"refine": False})
        res["met"] = res["slimcaching"].get("cpu_s", np.inf) <= limit
        res["load_average"] = list(os.getloadavg())
        out[name] = res
        print(f"  target {name} done", file=sys.stderr, flush=True)
    return out


def preset(labels: dict) -> dict:
    """device-edge-cloud preset with a synthetic K = 2 profile (32 x 8 experts, 33.8 MB each: LLaMA-MoE 2/8)."""
    try:
        from edgemoe.cluster.presets import DEFAULT_DOMAINS
        from edgemoe.plan import plan_problem
    except ImportError as exc:
        return {"error": f"cluster package not ready: {exc}"}
    profile = synthetic_profile(32, 8, 2, 3000, num_domains=len(DEFAULT_DOMAINS), expert_bytes=33_800_000,
                                hidden_size=4096, seed=0)
    profile = dataclasses.replace(profile, meta=dataclasses.replace(profile.meta, domains=list(DEFAULT_DOMAINS)))
    problem = plan_problem(profile, "device-edge-cloud")
    res = {"cluster": "device-edge-cloud preset", "profile": "synthetic L=32 E=8 K=2, 33.8 MB experts",
           "all_cloud_s": expected_latency(problem, empty_hosts(problem)), "planners": {}}
    for label, (method, params) in labels.items():
        res["planners"][label] = run_one(problem, method, params)
    for label, prefix in (("slimcaching", "slimcaching"), ("slimcaching(lp start)", "slimcaching_lp")):
        slim = res["planners"].get(label, {}).get("objective_s")
        for base in ("greedy", "lfu"):
            other = res["planners"].get(base, {}).get("objective_s")
            if slim is not None and other is not None:
                res[f"{prefix}_below_{base}_pct"] = 100 * (1 - slim / other)
    return res


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["sweeps"])
    fig, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 7), squeeze=False)
    for col, name in enumerate(names):
        rows = [r for r in results["sweeps"][name]["rows"] if "objective_s" in r]
        for label in dict.fromkeys(r["planner"] for r in rows):
            mine = [r for r in rows if r["planner"] == label]
            xs = [r["x"] for r in mine]
            style = "-o" if label.startswith("slimcaching") else "--."
            axes[0, col].plot(xs, [r["seconds"] for r in mine], style, label=label, ms=3)
            axes[1, col].plot(xs, [r["objective_s"] / r["all_cloud_s"] for r in mine], style, label=label, ms=3)
        axes[0, col].set_yscale("log")
        axes[0, col].set_title(f"planning time vs {name}")
        axes[1, col].set_title(f"latency / all-cloud vs {name}")
        for ax in axes[:, col]:
            ax.set_xlabel(name)
            ax.set_xscale("log", base=2)
    axes[0, 0].set_ylabel("seconds")
    axes[1, 0].set_ylabel("expected latency / all-cloud")
    axes[0, -1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)


def print_tables(results: dict) -> None:
    for name, sweep in results["sweeps"].items():
        labels = list(dict.fromkeys(r["planner"] for r in sweep["rows"]))
        print(f"\n## {name}: seconds / latency-vs-all-cloud")
        print(f"{'planner':24s}" + "".join(f"{str(x):>16s}" for x in sweep["xs"]))
        for label in labels:
            cells = []
            for x in sweep["xs"]:
                r = next(r for r in sweep["rows"] if r["planner"] == label and r["x"] == x)
                if "objective_s" in r:
                    cells.append(f"{r['seconds']:7.2f}/{r['objective_s'] / r['all_cloud_s']:.3f}")
                else:
                    cells.append("skip" if "skipped" in r else "error")
            print(f"{label:24s}" + "".join(f"{c:>16s}" for c in cells))
    print("\n## gap to ILP optimum (mean / max over instances)")
    gaps = results["ilp_gap"]
    for label in results["planners"]:
        vals = [row[label]["gap"] for row in gaps if "gap" in row.get(label, {})]
        if vals:
            print(f"{label:24s} mean {100 * np.mean(vals):6.2f}%  max {100 * np.max(vals):6.2f}%  (n={len(vals)})")
    print("\n## stated bounds vs achieved (fractions of the ILP optimum's latency reduction)")
    shown = [lb for lb in ("slimcaching", "slimcaching(one pass)", "greedy", "lfu") if lb in results["planners"]]
    print(f"{'instance':16s} K {'kappa_g':>8s} {'(1-k)/2':>8s} {'1/2':>5s} {'1/4':>5s} {'K1 guar.':>8s}"
          + "".join(f"{lb[:14]:>15s}" for lb in shown) + f"{'ILP opt':>9s}")
    for row in gaps:
        b = row["bounds"]
        k1 = row.get("slimcaching", {}).get("guarantee")
        cells = "".join(f"{row[lb].get('reduction_ratio', float('nan')):15.3f}" for lb in shown)
        print(f"{row['instance']:16s} {row.get('top_k', 2)} {b['kappa_g']:8.3f} {b['bound_1_minus_kappa_over_2']:8.3f}"
              f" {0.5:5.2f} {0.25:5.2f} {f'{k1:.3f}' if k1 is not None else '-':>8s}{cells}"
              f"{str(row['ilp'].get('optimal')):>9s}")
    mc = results.get("maxconv_speed", {})
    if mc:
        print(f"\n## max-convolution, C = {mc['capacity_units']} units, {mc['layers']} layers (1 convex, rest concave)")
        print(f"naive {mc['naive']['cpu_s']:.3f}s  auto {mc['auto']['cpu_s']:.3f}s (steps {mc['auto']['steps']})"
              f"  speedup {mc['speedup']:.1f}x  same value {mc['same_value']}")
    print("\n## scale targets (process CPU seconds)")
    for name, t in results["targets"].items():
        cells = ", ".join(f"{m} {t[m].get('cpu_s', float('nan')):.2f}s/{t[m].get('objective_s', float('nan')):.4f}s"
                          for m in ("slimcaching", "slimcaching(one pass)", "greedy", "lfu") if m in t)
        print(f"{name}: limit {t['limit_s']}s CPU, met={t['met']} (load {t['load_average'][0]:.1f}): {cells}")
    pre = results["preset"]
    print("\n## device-edge-cloud preset, K=2")
    for label, r in pre.get("planners", {}).items():
        print(f"{label:24s} {r.get('objective_s', float('nan')) * 1000:9.2f} ms  ({r['seconds']:.2f}s)")
    for key in ("slimcaching_below_greedy_pct", "slimcaching_below_lfu_pct", "slimcaching_lp_below_greedy_pct",
                "slimcaching_lp_below_lfu_pct"):
        if key in pre:
            print(f"{key}: {pre[key]:.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sweep (under a minute)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args()
    labels = variants()
    start = time.perf_counter()
    results = {
        "schema": "edgemoe.bench.planners/1", "mode": "quick" if args.quick else "full",
        "command": "python -m bench.speed.planners" + (" --quick" if args.quick else ""),
        "objective": "expected per-token MoE latency (s), edgemoe.plan.objective.expected_latency",
        "base_problem": BASE, "planners": list(labels) + list(LP_START),
        "sweeps": {name: run_sweep(name, xs, make, labels) for name, (xs, make) in sweeps(args.quick).items()},
    }
    results["ilp_gap"] = ilp_gaps(args.quick, {**labels, **LP_START})
    results["maxconv_speed"] = maxconv_speed(args.quick)
    results["targets"] = targets(args.quick)
    results["preset"] = preset({**labels, **LP_START})
    results["total_seconds"] = time.perf_counter() - start
    # made last, so that its cpu_s is the whole run's
    results["environment"] = {**environment(), "processor": platform.processor()}
    suffix = "-quick" if args.quick else ""
    atomic_write_json(args.out / f"planners{suffix}.json", results)
    plot(results, args.out / f"planners{suffix}.png")
    print_tables(results)
    print(f"\ntotal {results['total_seconds']:.0f}s; wrote {args.out}/planners{suffix}.json and .png")


if __name__ == "__main__":
    main()
