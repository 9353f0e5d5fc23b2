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
from bench.studies.scaling import operating_budgets, size_setting
from edgemoe.eval.experiment import eval_trace
from edgemoe.plan import plan
from edgemoe.runtime import make_context


def main(argv: list[str]) -> int:
    model, sizes = argv[0], [int(s) for s in argv[1].split(",")]
    budgets = operating_budgets(model)
    profile, topk, gates, cfg = demo_inputs(ROOT / "runs" / "cache", model)
    rows = []
    for servers in sizes:
        cluster, fallback, problem, groups, wl = size_setting(profile, cfg, servers)
        for point, b in budgets.items():
            pl = plan(problem, "ordermoe", mode="migrate", budget=b)
            ctx = make_context(profile, cluster, pl, mode="migrate", groups=groups, domain_fallback=fallback)
            trace = eval_trace(topk, gates, ctx.user_domain, cfg.block_len)
            rows += compare_backlogs(ctx, trace, wl, b, {"model": model, "servers": servers, "point": point})
    print("wrote", write_backlog_part(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
