# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3: where the look-ahead (H=2) loses to the myopic policy (H=0) on `bench.studies.lookahead`'s
32-layer Mixtral routing: the same per-layer split as `bench.studies.backlog_diagnosis` (static seconds of the
picked actions, the queue waits the policy saw, the queueing that formed after it, the trip home, hops, budget
spent, slots replaced), summed over the layers of a decode pass, for H=0 and H=2 at each asked budget and at
budget 0 (steering alone), and H=2 with priced tables (`table_price=True`).

    python -m bench.studies.lookahead_diagnosis [CLUSTER[,CLUSTER]] [BUDGET[,BUDGET]]   # default: edge8 0.05

The scenario is `bench.studies.lookahead`'s (its generator, placement, closed-loop workload of 32 requests).
Writes bench/results/lookahead_diagnosis.json.
"""
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench package

import numpy as np

from bench.common import environment
from bench.studies.backlog_diagnosis import diagnose
from bench.studies.lookahead import study_context, study_inputs
from edgemoe.io import atomic_write_json

OUT = ROOT / "bench" / "results" / "lookahead_diagnosis.json"
VARIANTS = {"H0": {"horizon": 0}, "H2": {"horizon": 2}, "H2-priced": {"horizon": 2, "table_price": True}}
SUMMED = ("realized_ms", "static_ms", "seen_wait_ms", "unforeseen_ms", "stage_ms", "home_trip_ms", "hops", "spent",
          "replaced")


def summed_row(labels: dict, out: dict, cpu_from: float, **extra) -> dict:
    """One diagnosed run's record: `labels`, `diagnose`'s mean and first stage, the per-layer split summed over a
    decode pass (SUMMED) and in full, `extra`, the run's CPU seconds since `cpu_from` and the load; its summary
    (all but the per-layer split) is printed as a JSON line."""
    per = out["per_layer"]
    row = {**labels, "mean_ms": out["mean_ms"], "first_stage_ms": out["first_stage_ms"],
           "pass_sum": {k: round(float(np.nansum(per[k])), 4) for k in SUMMED}, **extra, "per_layer": per,
           "cpu_s": round(time.process_time() - cpu_from, 1), "load": os.getloadavg()[0]}
    print(json.dumps({k: v for k, v in row.items() if k != "per_layer"}), flush=True)
    return row


def main(argv: list[str]) -> int:
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.workload import Trace

    clusters = (argv[0] if argv else "edge8").split(",")
    budgets = [float(b) for b in (argv[1] if len(argv) > 1 else "0.05").split(",")]
    c_all = time.process_time()
    plan_prof, eval_prof, _, workload = study_inputs(str(ROOT.parent / "shared" / "data"))
    trace = Trace.from_profile(eval_prof)
    rows = []
    for cluster in clusters:
        ctx = study_context(cluster, plan_prof)
        runs = [(name, b, params) for b in budgets for name, params in VARIANTS.items()]
        runs += [(f"{name}-budget0", 0.0, VARIANTS[name]) for name in ("H0", "H2")]
        for name, budget, params in runs:
            c0 = time.process_time()
            out = diagnose(ctx, make_policy("ordermoe", ctx, budget=budget, **params), trace, workload)
            rows.append(summed_row({"cluster": cluster, "budget": budget, "method": name, "params": params}, out, c0))
    atomic_write_json(OUT, {"note": __doc__.split("\n\n")[0], "environment": environment(cpu_s=time.process_time() - c_all),
                            "rows": rows})
    print("wrote", OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
