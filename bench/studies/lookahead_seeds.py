# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3: how much of "H=2 <= 1.0x H=0" one workload draw decides. The committed scenario files
(`backlog_scenarios.json`, `lookahead.json`) simulate each scenario on one workload seed; this study runs the
default policy (H=2) and H=0 on the same scenarios over SEEDS workload seeds (the committed seed first, then the
next ones: other arrival times and other requests' tokens, the same placement, routing trace and budgets) and
reports each scenario's ratio per seed, its mean, spread and how many seeds put H=2 above H=0 (and the ratio of
p99 latencies beside it); the options of the queue-aware table (`backlog="now"` / `"mean"`, `table_price=True`)
are run on the same seeds beside it.

    python -m bench.studies.lookahead_seeds [--seeds 10] [--sets demo,scaling,lookahead,paper] [--window-s W]
        [--out FILE]

Sets: `demo` (edge8, both shipped models, migrate and home, the demo's `paper` and `strict` budgets:
`bench.studies.backlog_demo`'s scenarios), `scaling` (default-upcycled on 4, 8, 16, 32 generated servers:
`bench.studies.backlog_scaling`'s) and `lookahead` (32-layer Mixtral routing on edge8 and testbed8 at budgets
0, 0.05, 0.2: `bench.studies.lookahead`'s) and `paper` (Qwen1.5-MoE and Mixtral at paper scale on testbed8,
budget 0.05: `bench.studies.backlog_paper`'s; their default ratios, 0.86x and 0.95x, are far from 1.0, but the
queue term's options move them in opposite directions). `--window-s` is the simulator's wave width (its default,
1 ms, unless given; 0 is the reference engine's exact event order: `bench.studies.window_error` says where the
two differ). Writes bench/results/lookahead_seeds.json (or --out); no timing but the CPU seconds of the whole run.
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench package

import numpy as np

from bench.common import RESULTS, environment
from edgemoe.io import atomic_write_json

OUT = RESULTS / "lookahead_seeds.json"
SETS = ("demo", "scaling", "lookahead", "paper")
# H=2 variants, each over H=0 on every seed: the default first, then the options the queue-aware table compares
VARIANTS = {"H2": {}, "H2-now": {"backlog": "now"}, "H2-off": {"backlog": "off"}, "H2-priced": {"table_price": True}}


def ratios(ctx, trace, workload, budget: float, seeds: int, window_s: float) -> dict[str, dict[str, list[float]]]:
    """{variant: {"mean": [seeds], "p99": [seeds]}}: mean and p99 latency of ordermoe H=2 with the variant's
    parameters over H=0's, one per workload seed workload.seed + k (VARIANTS; "H2" is the default policy), each
    simulated with wave width window_s."""
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.simulate import simulate

    out = {name: {"mean": [], "p99": []} for name in VARIANTS}
    for k in range(seeds):
        wl = dataclasses.replace(workload, seed=workload.seed + k)
        h0 = simulate(ctx, make_policy("ordermoe", ctx, budget=budget, horizon=0), trace, wl,
                      window_s=window_s).latency_ms
        for name, params in VARIANTS.items():
            pol = make_policy("ordermoe", ctx, budget=budget, horizon=2, **params)
            lat = simulate(ctx, pol, trace, wl, window_s=window_s).latency_ms
            out[name]["mean"].append(lat["mean"] / h0["mean"])
            out[name]["p99"].append(lat["p99"] / h0["p99"])
    return out


def _summary(r: dict[str, list[float]]) -> dict:
    a = np.asarray(r["mean"])
    return {"ratio": r["mean"], "mean": float(a.mean()), "sd": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
            "min": float(a.min()), "max": float(a.max()), "above_1": int((a > 1.0).sum()),
            "p99_ratio": r["p99"], "p99_mean": float(np.mean(r["p99"]))}


def row(labels: dict, budget: float, seed0: int, r: dict[str, dict[str, list[float]]]) -> dict:
    """One scenario's record: its labels, budget, the seeds, the default's ratios and their summary, and each
    other variant's under `variants`."""
    h2 = r["H2"]
    rec = {**labels, "budget": budget, "seeds": [seed0 + k for k in range(len(h2["mean"]))], **_summary(h2),
           "committed_seed_ratio": h2["mean"][0],
           "variants": {name: _summary(v) for name, v in r.items() if name != "H2"}}
    print(json.dumps({k: v for k, v in rec.items() if k not in ("seeds", "ratio", "p99_ratio", "variants")}
                     | {name: round(v["mean"], 4) for name, v in rec["variants"].items()}), flush=True)
    return rec


def scenarios(which, each) -> list[dict]:
    """Every scenario of the sets in `which` (SETS), in SETS order, through `each(ctx, trace, workload, budget,
    labels)` (a list of rows): the demo and scaling sets through the backlog scripts' loop (`backlog_sweep`: an
    ordermoe placement per budget), the lookahead set (`bench.studies.lookahead`'s inputs, placement and workload
    on testbed8 and edge8 at budgets 0, 0.05, 0.2) and the paper set (`bench.studies.backlog_paper`'s scenario
    and budget, 0.05). `bench.studies.window_error` walks the same scenarios."""
    from bench.common import backlog_sweep
    from bench.studies import backlog_demo, backlog_scaling
    from bench.studies.ordermoe_placement import demo_inputs
    from bench.studies.scaling import operating_budgets

    def demo(profile, cfg):
        return backlog_demo.scenarios(profile, cfg, ["migrate", "home"])

    def scaling(profile, cfg):
        return backlog_scaling.scenarios(profile, cfg, [4, 8, 16, 32])

    rows = []
    for set_name, model, make in (("demo", "default", demo), ("demo", "default-upcycled", demo),
                                  ("scaling", "default-upcycled", scaling)):
        if set_name not in which:
            continue
        profile, topk, gates, cfg = demo_inputs(ROOT / "runs" / "cache", model)
        rows += backlog_sweep(make(profile, cfg), operating_budgets(model), topk, gates, cfg.block_len, model,
                              each=lambda ctx, trace, wl, b, labels, set_name=set_name: each(
                                  ctx, trace, wl, b, {"set": set_name, **labels}))
    if "lookahead" in which:
        from bench.studies.lookahead import study_context, study_inputs
        from edgemoe.runtime.sim.workload import Trace

        plan_prof, eval_prof, _, workload = study_inputs(str(ROOT.parent / "shared" / "data"), log=lambda *a: None)
        trace = Trace.from_profile(eval_prof)
        for cluster in ("testbed8", "edge8"):
            ctx = study_context(cluster, plan_prof, log=lambda *a: None)
            for b in (0.0, 0.05, 0.2):
                rows += each(ctx, trace, workload, b, {"set": "lookahead", "model": "mixtral-8x7b", "cluster": cluster})
    if "paper" in which:
        from bench.studies.backlog_paper import paper_setting

        for model, counted in (("qwen1.5-moe-a2.7b", "olmoe"), ("mixtral-8x7b", "mixtral")):
            ctx, trace, workload, _ = paper_setting(model, counted, log=lambda *a: None)
            rows += each(ctx, trace, workload, 0.05, {"set": "paper", "model": model, "cluster": "testbed8"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10, help="workload seeds per scenario (the committed one first)")
    ap.add_argument("--sets", default=",".join(SETS), help=f"scenario sets, of {','.join(SETS)}")
    ap.add_argument("--window-s", type=float, default=None,
                    help="the simulator's wave width in seconds (default: the simulator's own, 1 ms; 0: exact order)")
    ap.add_argument("--out", type=Path, default=OUT, help="results file")
    args = ap.parse_args(argv)
    which = args.sets.split(",")
    unknown = sorted(set(which) - set(SETS))
    if unknown or args.seeds < 1:
        ap.error(f"--sets: expected names among {list(SETS)}, got {unknown}" if unknown else "--seeds must be >= 1")
    from edgemoe.runtime.sim.simulate import DEFAULT_WINDOW_S

    window = DEFAULT_WINDOW_S if args.window_s is None else args.window_s
    if not (np.isfinite(window) and window >= 0):
        ap.error(f"--window-s: expected a finite number of seconds >= 0, got {args.window_s}")
    c0 = time.process_time()
    rows = scenarios(which, lambda ctx, trace, wl, b, labels: [
        row(labels, b, wl.seed, ratios(ctx, trace, wl, b, args.seeds, window))])
    atomic_write_json(args.out, {"benchmark": "lookahead_seeds", "issue": "21 item 3",
                                 "note": __doc__.split("\n\n")[0], "seeds_per_scenario": args.seeds,
                                 "window_s": window, "rows": rows,
                                 "environment": environment(cpu_s=time.process_time() - c0)})
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
