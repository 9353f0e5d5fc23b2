# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3, the queue-aware look-ahead checked on one more scenario set: ordermoe H0 / H2 (static /
backlog) + oracle on the paper-scale scenario (one model).

    python -m bench.studies.backlog_paper MODEL COUNTED METHODS
    # e.g. qwen1.5-moe-a2.7b olmoe ordermoe-H0,ordermoe-H2,ordermoe-H2-now,ordermoe-H2-off,oracle

A method is `oracle` or `ordermoe-H<horizon>[-<backlog kind> | -priced]` (no kind: the default, `backlog="mean"`;
`-priced`: the default whose tables price future
stand-ins, `table_price=True`). The ordermoe placement is planned once per
planning draw and cached in runs/cache. Prints a JSON line per method and writes the rows into
bench/results/backlog_scenarios.json (this command's own part).
"""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench package

from bench.common import planning_draw, write_backlog_part
from edgemoe.cluster import load_cluster
from edgemoe.eval.paper_scale import PaperScaleConfig, scenario_profiles
from edgemoe.plan import plan_problem
from edgemoe.plan.base import load_placement, plan
from edgemoe.runtime import make_policy
from edgemoe.runtime.context import context_from_problem
from edgemoe.runtime.sim.simulate import simulate
from edgemoe.runtime.sim.workload import Trace, Workload


def _policy(name: str, ctx, eval_prof):
    """The policy a method name stands for (module docstring)."""
    if name == "oracle":
        return make_policy("oracle", ctx, budget=0.05, routing=(eval_prof.topk, eval_prof.gates))
    parts = name.split("-")
    tail = parts[2] if len(parts) >= 3 else None  # none: the policy's default queue term
    kind = {} if tail is None else {"table_price": True} if tail == "priced" else {"backlog": tail}
    return make_policy("ordermoe", ctx, budget=0.05, horizon=int(parts[1][1:]), **kind)


def paper_setting(model: str, counted: str, log=print):
    """(ctx, trace, workload, eval_prof) of the paper-scale scenario for one model: its routing generated from
    the `counted` real counts, testbed8 in migrate mode with dense work, the ordermoe placement planned once per
    planning draw (cached in runs/cache), the paper-scale closed-loop workload."""
    cfg = PaperScaleConfig(shared_data=str(ROOT.parent / "shared" / "data"))
    spec, plan_prof, eval_prof, info = scenario_profiles(model, counted, cfg, log)
    cluster = load_cluster("testbed8")
    fallback = any(u.domain not in plan_prof.meta.domains for u in cluster.users)
    # keyed by the planning draw, so a changed generator never reuses an older draw's placement
    cache = ROOT / "runs" / "cache" / f"placement-paper-scale-{model}-{planning_draw(plan_prof)}.json"
    problem = plan_problem(plan_prof, cluster, domain_fallback=fallback)
    if cache.exists():
        placement = load_placement(cache)
    else:
        c0 = time.process_time()
        placement = plan(problem, "ordermoe")
        log("plan", time.process_time() - c0)
        cache.parent.mkdir(parents=True, exist_ok=True)
        placement.save(cache)
    ctx = context_from_problem(problem, placement, mode="migrate", dense=True)
    wl = Workload(num_requests=cfg.num_requests, prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens,
                  arrival=cfg.arrival, rate_per_s=cfg.rate_per_s, seed=cfg.seed)
    return ctx, Trace.from_profile(eval_prof), wl, eval_prof


def main(argv: list[str]) -> int:
    model, counted, methods = argv[0], argv[1], argv[2].split(",")
    ctx, trace, wl, eval_prof = paper_setting(model, counted)
    rows = []
    for name in methods:
        c0 = time.process_time()
        m = simulate(ctx, _policy(name, ctx, eval_prof), trace, wl)
        rows.append({"model": model, "method": name, "mean_ms": m.latency_ms["mean"], "p99_ms": m.latency_ms["p99"],
                     "remote": m.remote_ratio, "cpu_s": round(time.process_time() - c0, 1),
                     "load": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)
    print("wrote", write_backlog_part(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
