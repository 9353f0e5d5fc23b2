"""Look-ahead on a deep model: ordermoe H = 0..3 and the hindsight oracle on 32-layer Mixtral-8x7B routing.

    python -m bench.studies.lookahead [--quick] [--budgets 0.05,0.2] [--clusters testbed8,edge8]

Simulator only (no quality: the routing is calibrated, there are no weights). Routing from the paper-scale
scenario's generator (`edgemoe.eval.paper_scale.scenario_profiles`: Mixtral-8x7B, 32 MoE layers, 8 experts,
top-2, calibrated on the real counts in ../shared/data/routing): policies and the placement learn from the
first draw, the simulator replays the second. Placement: the `ordermoe` planner, migrate mode. Budgets are
per token-layer allowances. Budget 0 isolates steering (no stand-in may run; H = 0 is then `exact`); the
others are budgets at which stand-ins do run (the table's stand-in share: substituted + dropped slots, zeroed
ones counted among the dropped; on this weightless routing the in-group substitute's error is the estimate 1 - similarity, so the
stand-ins are almost all dropped or zeroed branches). At budgets above 0, H = 0 and 2 also run "free" (no
quality price: the budget is the only limit on spending, as it is for the oracle; their ratios are to
H0-free), which separates what the price holds back from what the look-ahead misses. Writes
bench/results/lookahead.json.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import RESULTS, environment
from edgemoe.cluster import load_cluster
from edgemoe.eval.paper_scale import PaperScaleConfig, scenario_profiles
from edgemoe.io import atomic_write_json
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile.groups import groups_for
from edgemoe.runtime import make_context, make_policy
from edgemoe.runtime.sim.simulate import simulate
from edgemoe.runtime.sim.workload import Trace, Workload

HORIZONS = (0, 1, 2, 3)
FREE_HORIZONS = (0, 2)


def study_inputs(shared_data: str, quick: bool = False, log=print):
    """(planning profile, evaluation profile, calibration info, workload) of the study: Mixtral-8x7B's calibrated
    routing, two draws of 200 tokens per domain (60 quick), 32 closed-loop requests of 16 + 16 tokens (8 quick)."""
    cfg = PaperScaleConfig(shared_data=shared_data, tokens_per_domain=60 if quick else 200)
    _, plan_prof, eval_prof, info = scenario_profiles("mixtral-8x7b", "mixtral", cfg, log)
    workload = Workload(num_requests=8 if quick else 32, prompt_tokens=16, gen_tokens=16, arrival="closed", seed=0)
    return plan_prof, eval_prof, info, workload


def study_context(cluster_name: str, plan_prof, log=print):
    """The runtime context of one cluster: the ordermoe placement planned on plan_prof, migrate mode."""
    cluster = load_cluster(cluster_name)
    fallback = any(u.domain not in plan_prof.meta.domains for u in cluster.users)
    t0 = time.process_time()
    placement = plan(plan_problem(plan_prof, cluster, domain_fallback=fallback), "ordermoe")
    log(f"{cluster_name}: ordermoe placement in {time.process_time() - t0:.1f} s CPU")
    return make_context(plan_prof, cluster, placement, mode="migrate", groups=groups_for(plan_prof),
                        domain_fallback=fallback)


def run(cluster_name: str, budgets, plan_prof, eval_prof, workload: Workload, log=print,
        backlog_horizons=(), backlogs=("off", "now")) -> list[dict]:
    """Rows of ordermoe H = 0..3 and the oracle at each budget on one cluster (ordermoe placement, migrate);
    backlog_horizons: H of extra rows "ordermoe-H{h}-{kind}" (and "-{kind}-free" where the free rows run) with
    the queue-aware look-ahead (`backlog=kind` for each kind in `backlogs`), the others with the policy's default."""
    ctx = study_context(cluster_name, plan_prof, log)
    trace = Trace.from_profile(eval_prof)
    rows = []
    for budget in budgets:
        # "free": no quality price, so the budget is the only limit on spending, as for the oracle
        free = [(f"ordermoe-H{h}-free", {"horizon": h, "quality_price": 0.0}) for h in FREE_HORIZONS] if budget > 0 else []
        extra = [(f"ordermoe-H{h}-{kind}", {"horizon": h, "backlog": kind}) for h in backlog_horizons for kind in backlogs]
        extra += [(f"ordermoe-H{h}-{kind}-free", {"horizon": h, "backlog": kind, "quality_price": 0.0})
                  for h in backlog_horizons for kind in backlogs if budget > 0 and h in FREE_HORIZONS]
        for name, params in [(f"ordermoe-H{h}", {"horizon": h}) for h in HORIZONS] + free + extra + \
                            [("oracle", {"routing": (eval_prof.topk, eval_prof.gates)})]:
            c0 = time.process_time()
            pol = make_policy(name.split("-")[0], ctx, budget=budget, **params)
            m = simulate(ctx, pol, trace, workload)
            rows.append({"cluster": cluster_name, "budget": budget, "method": name,
                         "mean_ms": m.latency_ms["mean"],
                         "p99_ms": m.latency_ms["p99"], "substitution_ratio": m.substitution_ratio,
                         "drop_ratio": m.drop_ratio, "zero_ratio": m.zero_ratio, "remote_ratio": m.remote_ratio,
                         "cpu_s": round(time.process_time() - c0, 2)})
            r = rows[-1]
            log(f"  {cluster_name:9s} budget {budget:<6g} {name:12s} mean {r['mean_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms"
                f"  stand-ins {r['substitution_ratio'] + r['drop_ratio']:.3f}  ({r['cpu_s']:.1f} s)")
    for r in rows:
        same = [x for x in rows if x["cluster"] == r["cluster"] and x["budget"] == r["budget"]]
        h0 = next(x for x in same if x["method"] == ("ordermoe-H0-free" if r["method"].endswith("-free") else "ordermoe-H0"))
        orc = next(x for x in same if x["method"] == "oracle")
        r["mean_vs_H0"] = r["mean_ms"] / h0["mean_ms"]
        r["p99_vs_H0"] = r["p99_ms"] / h0["p99_ms"]
        r["mean_vs_oracle"] = r["mean_ms"] / orc["mean_ms"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and requests (a smoke run)")
    ap.add_argument("--budgets", default="0,0.05,0.2")
    ap.add_argument("--clusters", default="testbed8,edge8")
    ap.add_argument("--backlog-horizons", default="", help="H values of extra rows with a queue-aware look-ahead, e.g. 2")
    ap.add_argument("--backlogs", default="off,now", help="the `backlog` kinds of those rows")
    ap.add_argument("--out", default=None, help="results file (default bench/results/lookahead[_quick].json)")
    ap.add_argument("--shared-data", default=str(Path(__file__).resolve().parents[2] / ".." / "shared" / "data"))
    args = ap.parse_args()
    start, cpu0, load0 = time.perf_counter(), time.process_time(), list(os.getloadavg())
    plan_prof, eval_prof, info, workload = study_inputs(args.shared_data, args.quick)
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = []
    for cluster in args.clusters.split(","):
        rows += run(cluster, budgets, plan_prof, eval_prof, workload,
                    backlog_horizons=[int(h) for h in args.backlog_horizons.split(",") if h],
                    backlogs=tuple(args.backlogs.split(",")))
    print(f"\n{'cluster':9s} {'budget':>6s} {'method':17s} {'mean ms':>8s} {'p99 ms':>8s} {'xH0':>6s} {'p99 xH0':>7s} "
          f"{'xoracle':>7s} {'stand-ins':>9s}")
    for r in rows:
        print(f"{r['cluster']:9s} {r['budget']:6g} {r['method']:17s} {r['mean_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{r['mean_vs_H0']:6.3f} {r['p99_vs_H0']:7.3f} {r['mean_vs_oracle']:7.3f} "
              f"{r['substitution_ratio'] + r['drop_ratio']:9.3f}")
    timing = {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(time.process_time() - cpu0, 1),
              "load_average_start": load0, "load_average_end": list(os.getloadavg())}
    print(f"{timing['cpu_s']} s CPU, {timing['wall_s']} s wall, load average at start {load0}")
    out = Path(args.out) if args.out else RESULTS / ("lookahead_quick.json" if args.quick else "lookahead.json")
    atomic_write_json(out, {
        "benchmark": "lookahead", "model": "mixtral-8x7b (calibrated routing, 32 MoE layers)", "quick": args.quick,
        "placement": "ordermoe", "mode": "migrate", "workload": asdict(workload),
        "calibration": info, "rows": rows, "timing": timing, "environment": environment(),
    })


if __name__ == "__main__":
    main()
