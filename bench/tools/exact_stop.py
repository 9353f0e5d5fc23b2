"""Can the paper-scale exact ILP stop deterministically (by HiGHS's node limit) instead of by its clock?

For each paper-scale model: the MILP's size, then `exact` with node_limit=1 under a wall-clock cap (does
HiGHS finish its root node?), and the LP relaxation by interior point (deterministic) under the same cap.
Writes bench/results/exact_stop.json with the commit, load and CPU seconds. Run from the repository root:
`python -m bench.tools.exact_stop [CAP_S]` (default 120 s per solve; a few minutes in all on 2 cores).
"""

from __future__ import annotations

import json
import os
import sys
import time

from bench.common import RESULTS


def main(cap_s: float = 120.0) -> dict:
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
        rows.append(row)
        print(json.dumps(row))
    doc = {"what": __doc__.splitlines()[0], "environment": environment(), "cpu_count": os.cpu_count(), "models": rows}
    (RESULTS / "exact_stop.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 120.0)
