"""Out-of-sample placement quality on calibrated real-count routing: plan on one draw, replay another.

    python -m bench.studies.out_of_sample [--shared-data ../shared/data] [--quick] [--ilp-nodes N] [--ilp-from FILE]

For Mixtral-8x7B and Qwen1.5-MoE-A2.7B (60 experts, top-4) routing calibrated on the real expert counts
(edgemoe.profile.calibrated; docs/traces.md), two independent draws of 1,000 tokens per domain: placements
are planned on the first and scored by replaying the second (edgemoe.eval.replay, `plan_profile`). Two
settings: SlimCaching's (device-edge-cloud, home mode, the slimcaching policy) and OrderMoE's (testbed8,
migrate mode, exact execution). Reports mean/p99 latency per placement, SlimCaching's gap to each baseline,
and each planner's CPU seconds (process time; the load average is recorded beside it). SlimCaching runs
its load-aware variant (`SLIM_PARAMS`: remote-call charge "home-load", three block passes). In sample, every
placement's model objective on the planning draw (`plan_objective_s`) sits beside the exact ILP's
(`exact`, HiGHS with a deterministic node budget) optimum or dual bound, a lower bound on any placement's
in-sample objective: `ilp_bound_s`, and each planner's gap to it, `gap_to_ilp_bound_pct`. The ILP runs in
SlimCaching's setting at Mixtral scale only (at Qwen scale its LP has millions of rows). Writes bench/results/out_of_sample.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import RESULTS, environment, planning_draw
from edgemoe.eval.experiment import MethodSpec
from edgemoe.eval.paper_scale import MODELS, PaperScaleConfig, scenario_profiles
from edgemoe.eval.replay import replay_profile
from edgemoe.io import atomic_write_json
from edgemoe.runtime.sim.workload import Workload

SETTINGS = (  # (cluster, mode, policy, placements)
    ("device-edge-cloud", "home", "slimcaching", ("slimcaching", "greedy", "lfu", "random", "u-shaped", "exact")),
    ("testbed8", "migrate", "exact", ("slimcaching", "greedy", "lfu", "eplb", "activation-aware", "ordermoe", "uniform")),
)
# the ILP is far too large at 60 x top-4 (millions of rows; docs/planners-slimcaching.md §7)
SKIP = {"qwen1.5-moe-a2.7b": ("exact",)}
ILP_TIME_CAP_S = 1800.0
# SlimCaching's load-aware variant (docs/planners-slimcaching.md, "Remote-call charge"): remote calls also pay
# the queueing they cause at the demand-estimated utilisation of the node they load, and three block passes
# (at Qwen scale the refinement's work cap ends before one settle sweep, so later blocks are never revisited)
SLIM_PARAMS = {"remote_charge": "home-load", "passes": 3}  # the ILP's wall-clock safety cap only; its deterministic budget is --ilp-nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared-data", default="../shared/data")
    ap.add_argument("--quick", action="store_true", help="200 tokens per domain, 16 requests")
    ap.add_argument("--ilp-nodes", type=int, default=1,
                    help="branch-and-bound nodes of the ILP (1: the root's cuts and bound; deterministic; 0: no ILP)")
    ap.add_argument("--ilp-from", default=None,
                    help="rows without an ILP of their own take the ILP entry (bound, incumbent, source) of the same "
                         "model, cluster, mode and planning draw (`planning_draw`, a fingerprint of its routing) from "
                         "this earlier results file (a separate --ilp-nodes 1 run); a row of another draw carries nothing")
    ap.add_argument("--out", default=str(RESULTS / "out_of_sample.json"))
    args = ap.parse_args()
    earlier = json.loads(Path(args.ilp_from).read_text())["rows"] if args.ilp_from else []
    cfg = PaperScaleConfig(shared_data=args.shared_data, tokens_per_domain=200 if args.quick else 1000)
    workload = Workload(num_requests=16 if args.quick else 64, prompt_tokens=16, gen_tokens=16, arrival="closed")
    rows, load0, t0 = [], list(os.getloadavg()), time.perf_counter()
    for name, counted in MODELS:
        _, plan_prof, eval_prof, _ = scenario_profiles(name, counted, cfg, print)
        draw = planning_draw(plan_prof)
        for cluster, mode, policy, placements in SETTINGS:
            keep = [p for p in placements if p not in SKIP.get(name, ()) and (p != "exact" or args.ilp_nodes > 0)]
            ilp_params = {"node_limit": args.ilp_nodes, "time_limit": ILP_TIME_CAP_S}
            params = {"exact": ilp_params, "slimcaching": SLIM_PARAMS}
            methods = [MethodSpec(p, p, policy, placement_params=params.get(p, {})) for p in keep]
            doc = replay_profile(eval_prof, cluster, methods, mode=mode, workload=workload, plan_profile=plan_prof,
                                 skip_failed_plans=True)
            lat = {k: v["latency_ms"]["mean"] for k, v in doc["methods"].items()}
            slim = lat.get("slimcaching")
            placed = doc["placements"]
            ilp = placed.get("exact", {})
            bound = ilp.get("plan_objective_s") if ilp.get("proven_optimal") else ilp.get("mip_dual_bound")
            if not ilp:
                ilp, bound = carried_ilp(earlier, name, cluster, mode, draw)
            rows.append({
                "model": name, "cluster": cluster, "mode": mode, "policy": policy, "planning_draw": draw,
                "mean_ms": {k: round(v, 2) for k, v in lat.items()},
                "p99_ms": {k: round(v["latency_ms"]["p99"], 2) for k, v in doc["methods"].items()},
                "slimcaching_vs": {k: round(100 * (slim - v) / v, 1) for k, v in lat.items() if k != "slimcaching" and slim},
                "plan_cpu_s": {k: v["plan_cpu_seconds"] for k, v in placed.items()},
                "plan_objective_s": {k: round(v["plan_objective_s"], 6) for k, v in placed.items()},
                "ilp_bound_s": bound, "ilp": {k: v for k, v in ilp.items() if k not in ("bytes_used",)},
                "gap_to_ilp_bound_pct": {k: round(100 * (v["plan_objective_s"] / bound - 1), 2)
                                         for k, v in placed.items()} if bound else None,
                "load_average": list(os.getloadavg()),
                "skipped": {**doc["skipped"], **{p: "left out at this scale" for p in placements if p not in keep}},
            })
            r = rows[-1]
            if bound and "greedy" in r["plan_objective_s"]:
                r["best_possible_below_greedy_pct_in_sample"] = round(100 * (1 - bound / r["plan_objective_s"]["greedy"]), 2)
            print(f"{name} on {cluster} ({mode}, {policy}): " + ", ".join(f"{k} {v:.1f} ms" for k, v in r["mean_ms"].items()))
            print(f"  slimcaching vs: {r['slimcaching_vs']}  plan CPU s: {r['plan_cpu_s']}")
            print(f"  in sample: objective s {r['plan_objective_s']}; ILP bound {bound} "
                  f"({ilp.get('stopped_by', 'not run')}); gap to it % {r['gap_to_ilp_bound_pct']}", flush=True)
    atomic_write_json(args.out, {
        "what": __doc__.splitlines()[0], "rows": rows, "quick": args.quick, "workload": asdict(workload),
        "ilp_nodes": args.ilp_nodes, "ilp_time_cap_s": ILP_TIME_CAP_S, "slimcaching_params": SLIM_PARAMS,
        "wall_s": round(time.perf_counter() - t0, 1), "load_average_start": load0, "load_average_end": list(os.getloadavg()),
        "environment": environment(), "ilp_from": args.ilp_from})
    print(f"wrote {args.out}")


def carried_ilp(earlier: list, model: str, cluster: str, mode: str, draw: str) -> tuple[dict, float | None]:
    """(ILP entry, bound) of the earlier row with this model, cluster, mode and planning draw ({} and None when
    none had one). A row of another draw (a changed routing generator, or a file from before rows named their
    draw) carries nothing: its bound is of another program."""
    for row in earlier:
        if (row["model"], row["cluster"], row["mode"], row.get("planning_draw")) == (model, cluster, mode, draw) \
                and row.get("ilp_bound_s"):
            return row["ilp"], row["ilp_bound_s"]
    return {}, None


if __name__ == "__main__":
    main()
