# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3, the queue-aware look-ahead checked on one more scenario set: demo scenarios (edge8 migrate / home, a shipped model): ordermoe H0 / H2 static / H2 backlog, oracle."""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench package

from bench.studies.ordermoe_placement import demo_inputs
from bench.studies.scaling import operating_budgets
from edgemoe.cluster import load_cluster
from edgemoe.eval.experiment import eval_trace
from edgemoe.plan import plan, plan_problem
from edgemoe.runtime import make_policy
from edgemoe.runtime.context import context_from_problem
from edgemoe.runtime.sim.simulate import simulate
from edgemoe.runtime.sim.workload import Workload

model = sys.argv[1]
modes = sys.argv[2].split(",")
budgets = operating_budgets(model)
profile, topk, gates, cfg = demo_inputs(ROOT / "runs" / "cache", model)
cluster = load_cluster("edge8")
fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
problem = plan_problem(profile, cluster, domain_fallback=fallback)
wl = Workload(num_requests=64, prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens, rate_per_s=20.0, seed=cfg.seed)
for mode in modes:
    for point, b in budgets.items():
        pl = plan(problem, "ordermoe", mode=mode, budget=b)
        ctx = context_from_problem(problem, pl, mode=mode, dense=True)
        trace = eval_trace(topk, gates, ctx.user_domain, cfg.block_len)
        res = {}
        for name, params in (("H0", dict(horizon=0)), ("H2", dict(horizon=2)), ("H2-now", dict(horizon=2, backlog="now")), ("H2-mean", dict(horizon=2, backlog="mean"))):
            c0 = time.process_time()
            m = simulate(ctx, make_policy("ordermoe", ctx, budget=b, **params), trace, wl)
            res[name] = m.latency_ms["mean"]
            print(json.dumps({"model": model, "mode": mode, "point": point, "budget": b, "method": name,
                              "mean_ms": m.latency_ms["mean"], "p99_ms": m.latency_ms["p99"], "cpu_s": round(time.process_time() - c0, 1),
                              "load": os.getloadavg()[0]}), flush=True)
        print(f"# {model} {mode} {point}: H2/H0 {res['H2']/res['H0']:.3f}  now/H0 {res['H2-now']/res['H0']:.3f}  mean/H0 {res['H2-mean']/res['H0']:.3f}", flush=True)
