# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3, the queue-aware look-ahead checked on one more scenario set: ordermoe H0 / H2 (static / backlog) + oracle on the paper-scale scenario (one model)."""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench package

from edgemoe.cluster import load_cluster
from edgemoe.eval.paper_scale import PaperScaleConfig, scenario_profiles
from edgemoe.plan import plan_problem
from edgemoe.plan.base import load_placement, plan
from edgemoe.runtime import make_policy
from edgemoe.runtime.context import context_from_problem
from edgemoe.runtime.sim.simulate import simulate
from edgemoe.runtime.sim.workload import Trace, Workload

model, counted = sys.argv[1], sys.argv[2]
methods = sys.argv[3].split(",")
cfg = PaperScaleConfig(shared_data=str(ROOT.parent / "shared" / "data"))
spec, plan_prof, eval_prof, info = scenario_profiles(model, counted, cfg, print)
cluster = load_cluster("testbed8")
fallback = any(u.domain not in plan_prof.meta.domains for u in cluster.users)
cache = ROOT / "runs" / "cache" / f"placement-paper-scale-{model}.json"
if cache.exists():
    placement = load_placement(cache)
else:
    c0 = time.process_time()
    placement = plan(plan_problem(plan_prof, cluster, domain_fallback=fallback), "ordermoe")
    print("plan", time.process_time() - c0)
    placement.save(cache)
problem = plan_problem(plan_prof, cluster, domain_fallback=fallback)
ctx = context_from_problem(problem, placement, mode="migrate", dense=True)
trace = Trace.from_profile(eval_prof)
wl = Workload(num_requests=cfg.num_requests, prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens,
              arrival=cfg.arrival, rate_per_s=cfg.rate_per_s, seed=cfg.seed)
for name in methods:
    c0 = time.process_time()
    if name == "oracle":
        pol = make_policy("oracle", ctx, budget=0.05, routing=(eval_prof.topk, eval_prof.gates))
    else:
        h, bl = name.split("-")[1:3] if name.count("-") >= 2 else (name.split("-")[1], "off")
        pol = make_policy("ordermoe", ctx, budget=0.05, horizon=int(h[1:]), backlog=bl)
    m = simulate(ctx, pol, trace, wl)
    print(json.dumps({"model": model, "method": name, "mean_ms": m.latency_ms["mean"], "p99_ms": m.latency_ms["p99"],
                      "remote": m.remote_ratio, "cpu_s": round(time.process_time() - c0, 1), "load": os.getloadavg()[0]}), flush=True)
