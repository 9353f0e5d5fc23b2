"""How the `ordermoe` planner's cost grows with the number of servers.

Generated heterogeneous clusters (`edgemoe.cluster.presets.generate(S, 2S, seed=0, topology="internet")`,
the inputs of bench/studies/scaling.py), migrate mode, the planner's defaults. Two shapes:

- `demo`: the default model's cached demo profile (4 layers x 16 experts, K = 2; runs/cache, built by
  bench/studies/ordermoe_placement.py or `edgemoe demo`), S = 8, 16, 32, 64. At 128 servers the generated cluster
  holds fewer than one copy of this 64-expert model (about 0.9 experts per server), so it cannot be planned.
- `L16-E32-K4`: bench/speed/policies.py's synthetic shape (`synthetic_profile(16, 32, 4, 3000, seed=3)`), the one
  that ran 40+ CPU minutes at 64 servers before the fix; S = 32 and 128 with `max_evals=1000` so the whole
  benchmark stays within about 5 CPU minutes (the default budget of 4000 evaluations costs about 130 CPU s
  at 64 and at 128 servers on this shape).

Per size: CPU seconds of the `plan` call (process time, steadier than wall time on the shared host), the
planner's own work counters (evaluations, accepted moves, replayed rows) and its expected latency. Records
the load average. Writes bench/results/ordermoe_scale.json.

    PYTHONPATH=src python -m bench.speed.ordermoe_scale [--cache-dir runs/cache] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USERS_PER_SERVER = 2
DEMO_SIZES = (8, 16, 32, 64)
SYNTH_SIZES = (32, 128)
SYNTH_PARAMS = {"max_evals": 1000}


def run(profile, servers: int, params: dict) -> dict:
    from edgemoe.cluster.presets import generate
    from edgemoe.plan import plan, plan_problem

    cluster = generate(servers, USERS_PER_SERVER * servers, seed=0, topology="internet")
    problem = plan_problem(profile, cluster, domain_fallback=True)
    c0, t0 = time.process_time(), time.perf_counter()
    placement = plan(problem, "ordermoe", mode="migrate", **params)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    p = placement.params
    return {"servers": servers, "users": USERS_PER_SERVER * servers, "params": params, "cpu_s": round(cpu, 3),
            "wall_s": round(wall, 3), "evaluations": p["evaluations"], "moves": p["moves"], "rows": p["rows"],
            "expected_latency_ms": p["expected_latency_ms"], "greedy_latency_ms": p["greedy_latency_ms"],
            "load_average_1_5_15": list(os.getloadavg())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "cache"))
    ap.add_argument("--quick", action="store_true", help="demo shape at 8 and 16 servers only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ordermoe_scale.json"))
    args = ap.parse_args()
    from bench.common import environment
    from bench.studies.ordermoe_placement import demo_inputs
    from edgemoe.io import atomic_write_json
    from edgemoe.plan import plan, plan_problem
    from edgemoe.profile import synthetic_profile

    # imports and first-call setup outside the timed calls
    plan(plan_problem(synthetic_profile(2, 4, 2, 50), "edge8", domain_fallback=True), "ordermoe", max_evals=1)
    demo, _, _, _ = demo_inputs(Path(args.cache_dir))
    cases = [("demo", demo, s, {}) for s in (DEMO_SIZES[:2] if args.quick else DEMO_SIZES)]
    if not args.quick:
        synth = synthetic_profile(16, 32, 4, 3000, seed=3)
        cases += [("L16-E32-K4", synth, s, SYNTH_PARAMS) for s in SYNTH_SIZES]
    rows = []
    print(f"{'shape':<11} {'servers':>7} {'CPU s':>7} {'evals':>6} {'moves':>6} {'rows':>6} {'E[lat] ms':>9}  load")
    for shape, profile, servers, params in cases:
        r = {"shape": shape, **run(profile, servers, params)}
        rows.append(r)
        print(f"{shape:<11} {servers:>7} {r['cpu_s']:>7.1f} {r['evaluations']:>6} {r['moves']:>6} {r['rows']:>6} "
              f"{r['expected_latency_ms']:>9.2f}  {r['load_average_1_5_15'][0]:.2f}", flush=True)
    atomic_write_json(args.out, {"schema": "edgemoe.bench.ordermoe_scale/1", "environment": environment(),
                                 "total_cpu_s": round(sum(r["cpu_s"] for r in rows), 1), "rows": rows})


if __name__ == "__main__":
    main()
