# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3, the queue-aware look-ahead checked on one more scenario set: bench.studies.scaling's
setting, ordermoe placements only: H0 / H2 static / H2 backlog per point and size.

    python -m bench.studies.backlog_scaling MODEL SIZES   # e.g. default-upcycled 4,8,16,32

Prints a JSON line per run and writes its rows into bench/results/backlog_scenarios.json (its own part).
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench package

from bench.common import compare_backlogs, write_backlog_part
from bench.studies.ordermoe_placement import demo_inputs
from bench.studies.scaling import RATE_PER_USER, REQUESTS_PER_USER, USERS_PER_SERVER, operating_budgets
from edgemoe.cluster.presets import generate
from edgemoe.eval.experiment import eval_trace
from edgemoe.plan import plan, plan_problem
from edgemoe.profile.groups import groups_for
from edgemoe.runtime import make_context
from edgemoe.runtime.sim.workload import Workload


def main(argv: list[str]) -> int:
    model, sizes = argv[0], [int(s) for s in argv[1].split(",")]
    budgets = operating_budgets(model)
    profile, topk, gates, cfg = demo_inputs(ROOT / "runs" / "cache", model)
    rows = []
    for servers in sizes:
        users = USERS_PER_SERVER * servers
        cluster = generate(servers, users, seed=0, topology="internet")
        fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
        problem = plan_problem(profile, cluster, domain_fallback=fallback)
        groups = groups_for(profile)
        wl = Workload(num_requests=REQUESTS_PER_USER * users, prompt_tokens=cfg.prompt_tokens,
                      gen_tokens=cfg.gen_tokens, rate_per_s=RATE_PER_USER * users, seed=cfg.seed)
        for point, b in budgets.items():
            pl = plan(problem, "ordermoe", mode="migrate", budget=b)
            ctx = make_context(profile, cluster, pl, mode="migrate", groups=groups, domain_fallback=fallback)
            trace = eval_trace(topk, gates, ctx.user_domain, cfg.block_len)
            rows += compare_backlogs(ctx, trace, wl, b, {"model": model, "servers": servers, "point": point})
    print("wrote", write_backlog_part(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
