# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3, the queue-aware look-ahead checked on one more scenario set: demo scenarios (edge8 migrate /
home, a shipped model): ordermoe H0 / H2 static / H2 backlog.

    python -m bench.studies.backlog_demo MODEL MODES      # e.g. default migrate,home

Prints a JSON line per run and writes its rows into bench/results/backlog_scenarios.json (its own part).
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench package

from bench.common import backlog_sweep, write_backlog_part
from bench.studies.ordermoe_placement import demo_inputs
from bench.studies.scaling import operating_budgets
from edgemoe.cluster import load_cluster
from edgemoe.plan import plan_problem
from edgemoe.runtime.context import context_from_problem
from edgemoe.runtime.sim.workload import Workload


def scenarios(profile, cfg, modes: list[str]):
    """backlog_sweep's scenarios: edge8 in each mode, the demo's workload (64 requests at 20 req/s)."""
    cluster = load_cluster("edge8")
    fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
    problem = plan_problem(profile, cluster, domain_fallback=fallback)
    wl = Workload(num_requests=64, prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens, rate_per_s=20.0,
                  seed=cfg.seed)
    return (({"mode": mode}, problem, mode, wl,
             lambda pl, mode=mode: context_from_problem(problem, pl, mode=mode, dense=True)) for mode in modes)


def main(argv: list[str]) -> int:
    model, modes = argv[0], argv[1].split(",")
    budgets = operating_budgets(model)
    profile, topk, gates, cfg = demo_inputs(ROOT / "runs" / "cache", model)
    rows = backlog_sweep(scenarios(profile, cfg, modes), budgets, topk, gates, cfg.block_len, model)
    print("wrote", write_backlog_part(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
