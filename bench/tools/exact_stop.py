"""Can the paper-scale exact ILP stop deterministically (by HiGHS's node limit) instead of by its clock?

For each paper-scale model: the MILP's size, then `exact` with node_limit=1 under a wall-clock cap (does
HiGHS finish its root node?), and the LP relaxation by interior point (deterministic) under the same cap;
then `exact` as the paper-scale scenario calls it (solver "auto": "lp-round" at this size; issue 22 item 5),
twice, with the SlimCaching placement's objective beside it. Writes bench/results/exact_stop.json with the
commit, load and CPU seconds. Run from the repository root:
`python -m bench.tools.exact_stop [CAP_S] [--only-solver]` (default 120 s per solve; a few minutes in all on
2 cores). --only-solver runs the last part alone and adds it to the models of the existing file (its own
environment beside it), leaving the earlier parts as they were measured.
"""

from __future__ import annotations

import json
import os
import sys
import time

from bench.common import RESULTS


def solver_row(problem, cap_s: float) -> dict:
    """`exact` with its defaults (solver "auto") twice, and SlimCaching's objective on the same problem."""
    from edgemoe.plan.base import plan
    from edgemoe.plan.objective import expected_latency

    runs = []
    for _ in range(2):
        load0, c0 = list(os.getloadavg()), time.process_time()
        pl = plan(problem, "exact", time_limit=max(cap_s, 600.0))
        runs.append((pl, {"cpu_s": round(time.process_time() - c0, 1), "load_start": [round(x, 2) for x in load0],
                          "wall_s": round(pl.params["plan_seconds"], 1)}))
    (a, ta), (b, tb) = runs
    c0 = time.process_time()
    slim = plan(problem, "slimcaching")
    slim_cpu = round(time.process_time() - c0, 1)
    keys = ("solver", "stopped_by", "deterministic", "proven_optimal", "mip_gap", "lp_bound", "ilp_objective",
            "objective_s")
    return {**{k: a.params.get(k) for k in keys}, "runs": [ta, tb],
            "same_placement_twice": bool((a.hosts == b.hosts).all()),
            "same_params_twice": {k: v for k, v in a.params.items() if k != "plan_seconds"}
            == {k: v for k, v in b.params.items() if k != "plan_seconds"},
            "slimcaching_objective_s": expected_latency(problem, slim.hosts), "slimcaching_cpu_s": slim_cpu}


def main(cap_s: float = 120.0, only_solver: bool = False) -> dict:
    from edgemoe.cluster.load import load_cluster
    from edgemoe.errors import EdgeMoEError
    from edgemoe.eval.paper_scale import MODELS, PaperScaleConfig, scenario_profiles
    from edgemoe.plan.base import plan
    from edgemoe.plan.exact import lp_relaxation, program_size, resolve_coverage
    from edgemoe.plan.problem import plan_problem
    from edgemoe.results import environment

    cfg = PaperScaleConfig(shared_data=os.environ.get("EDGEMOE_SHARED_DATA", "../shared/data"))
    cluster = load_cluster(cfg.cluster)
    rows = []
    for name, counted in MODELS[:1]:  # Mixtral-8x7B: the smaller program of the two
        _spec, plan_prof, _eval, _info = scenario_profiles(name, counted, cfg, lambda _: None)
        problem = plan_problem(plan_prof, cluster)
        if only_solver:
            rows.append({"model": name, "solver_auto": solver_row(problem, cap_s)})
            print(json.dumps(rows[-1]))
            continue
        cols, nnz = program_size(problem, "slimcaching", resolve_coverage(problem, None))
        row = {"model": name, "columns": cols, "nonzeros": nnz, "cap_s": cap_s}
        load0, t0, c0 = list(os.getloadavg()), time.perf_counter(), time.process_time()
        pl = plan(problem, "exact", node_limit=1, time_limit=cap_s)
        row["milp_node_limit_1"] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
                                    "load_start": load0,
                                    **{k: pl.params.get(k) for k in ("stopped_by", "deterministic", "mip_gap",
                                                                     "mip_node_count", "mip_dual_bound")}}
        load0, t0, c0 = list(os.getloadavg()), time.perf_counter(), time.process_time()
        try:
            _x, bound = lp_relaxation(problem, time_limit=cap_s, max_nonzeros=float("inf"))
            lp = {"bound": bound}
        except EdgeMoEError as exc:
            lp = {"error": str(exc)[:300]}
        row["lp_relaxation"] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
                                "load_start": load0, **lp}
        row["solver_auto"] = solver_row(problem, cap_s)
        rows.append(row)
        print(json.dumps(row))
    from edgemoe.io import atomic_write_json

    out = RESULTS / "exact_stop.json"
    if only_solver:
        doc = json.loads(out.read_text())
        by_model = {r["model"]: r for r in doc["models"]}
        for r in rows:
            by_model.setdefault(r["model"], {"model": r["model"]})["solver_auto"] = r["solver_auto"]
        doc["models"] = list(by_model.values())
        doc["solver_auto_environment"] = environment()
    else:
        doc = {"what": __doc__.splitlines()[0], "environment": environment(), "cpu_count": os.cpu_count(), "models": rows}
    atomic_write_json(out, doc)
    return doc


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(float(args[0]) if args else 120.0, "--only-solver" in sys.argv[1:])
