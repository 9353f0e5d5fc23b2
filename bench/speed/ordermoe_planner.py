"""The `ordermoe` planner's CPU time on a real model's routing: Qwen1.5-MoE-A2.7B (24 layers x 60 experts,
top-4) on SlimCaching's device-edge-cloud preset and on testbed8 (issue 21 item 5: <= 20 CPU s on each, the
same objective or better, the same evaluations).

The routing is the paper-scale scenario's planning draw (`edgemoe.eval.paper_scale.scenario_profiles`:
calibrated on the real expert counts in ../shared/data/routing, 1,000 tokens per domain), the problem is
what `edgemoe.eval.replay.replay_profile` builds, and the planner runs with its defaults, as the paper-scale
scenario and bench/studies/out_of_sample.py call it (no mode given: the problem's, migrate), plus
device-edge-cloud in home mode, SlimCaching's own setting. SlimCaching (its defaults) is timed on the
same problems for the comparison. Per case: CPU s of the `plan` call (process time; the load average beside
it), the search's evaluations and accepted moves, and the expected latency. Writes
bench/results/ordermoe_planner.json (with the commit and load: `edgemoe.results.environment`).

    PYTHONPATH=src python -m bench.speed.ordermoe_planner [--shared-data ../shared/data] [--cases dec,testbed8]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench.common import RESULTS, environment

TARGET_CPU_S = 20.0  # issue 21 item 5, per ordermoe case
MODEL = ("qwen1.5-moe-a2.7b", "olmoe")  # (spec, counted model its routing is calibrated on)
CASES = {  # name -> (cluster, planner, planner parameters)
    "device-edge-cloud": ("device-edge-cloud", "ordermoe", {}),
    "device-edge-cloud/home": ("device-edge-cloud", "ordermoe", {"mode": "home"}),
    "testbed8": ("testbed8", "ordermoe", {}),
    "device-edge-cloud/slimcaching": ("device-edge-cloud", "slimcaching", {}),
    "testbed8/slimcaching": ("testbed8", "slimcaching", {}),
}


def problems(shared_data: str, clusters) -> dict:
    """cluster name -> the PlanProblem of Qwen1.5-MoE's planning draw on it (as `replay_profile` builds it)."""
    from edgemoe.cluster.load import load_cluster
    from edgemoe.eval.paper_scale import PaperScaleConfig, scenario_profiles
    from edgemoe.plan import plan_problem

    _, profile, _, _ = scenario_profiles(*MODEL, PaperScaleConfig(shared_data=shared_data), print)
    out = {}
    for name in clusters:
        cluster = load_cluster(name)
        fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
        out[name] = plan_problem(profile, cluster, domain_fallback=fallback)
    return out


def run(problem, planner: str, params: dict) -> dict:
    from edgemoe.plan import plan
    from edgemoe.plan.objective import expected_latency

    load = list(os.getloadavg())
    c0, t0 = time.process_time(), time.perf_counter()
    placement = plan(problem, planner, **params)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    p = placement.params
    row = {"planner": planner, "params": params, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
           "load_average_1_5_15_before": [round(x, 2) for x in load],
           "load_average_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
           # SlimCaching's model objective (home mode, every planner comparable)
           "plan_objective_s": expected_latency(problem, placement.hosts)}
    if planner == "ordermoe":
        row.update({k: p[k] for k in ("mode", "evaluations", "moves", "rows", "expected_latency_ms",
                                      "greedy_latency_ms", "empty_latency_ms")})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared-data", default=str(Path(__file__).resolve().parents[2] / ".." / "shared" / "data"))
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    ap.add_argument("--out", default=str(RESULTS / "ordermoe_planner.json"))
    args = ap.parse_args()
    from edgemoe.io import atomic_write_json

    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: {unknown} unknown; expected some of {list(CASES)}")
    # imports and the compiled kernels' first load (numba's cache, or their compilation in a fresh clone)
    # outside the timed calls
    from edgemoe.plan import plan, plan_problem
    from edgemoe.profile import synthetic_profile

    for k in (2, 4):
        plan(plan_problem(synthetic_profile(2, 6, k, 50), "device-edge-cloud", domain_fallback=True), "ordermoe",
             max_evals=20)
    probs = problems(args.shared_data, sorted({CASES[c][0] for c in names}))
    rows = []
    print(f"{'case':<30} {'CPU s':>7} {'wall s':>7} {'evals':>6} {'moves':>6} {'E[lat] ms':>10}  load")
    for name in names:
        cluster, planner, params = CASES[name]
        r = {"case": name, "cluster": cluster, **run(probs[cluster], planner, params)}
        rows.append(r)
        print(f"{name:<30} {r['cpu_s']:>7.1f} {r['wall_s']:>7.1f} {r.get('evaluations', '-'):>6} "
              f"{r.get('moves', '-'):>6} {r.get('expected_latency_ms', float('nan')):>10.4f}  "
              f"{r['load_average_1_5_15_after'][0]:.2f}", flush=True)
    atomic_write_json(args.out, {"schema": "edgemoe.bench.ordermoe_planner/1", "model": MODEL[0],
                                 "target_cpu_s": TARGET_CPU_S, "environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
