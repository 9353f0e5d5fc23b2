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

from bench.common import backlog_sweep, write_backlog_part
from bench.studies.ordermoe_placement import demo_inputs
from bench.studies.scaling import operating_budgets, size_setting
from edgemoe.runtime import make_context


def scenarios(profile, cfg, sizes: list[int]):
    """backlog_sweep's scenarios: scaling's generated setting of each size, migrate mode."""
    for servers in sizes:
        cluster, fallback, problem, groups, wl = size_setting(profile, cfg, servers)
        yield ({"servers": servers}, problem, "migrate", wl,
               lambda pl, cluster=cluster, groups=groups, fallback=fallback: make_context(
                   profile, cluster, pl, mode="migrate", groups=groups, domain_fallback=fallback))


def main(argv: list[str]) -> int:
    model, sizes = argv[0], [int(s) for s in argv[1].split(",")]
    budgets = operating_budgets(model)
    profile, topk, gates, cfg = demo_inputs(ROOT / "runs" / "cache", model)
    rows = backlog_sweep(scenarios(profile, cfg, sizes), budgets, topk, gates, cfg.block_len, model)
    print("wrote", write_backlog_part(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
