# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3: what the queue term (`backlog`) changes at paper scale, where it moves the two models in
opposite directions (`lookahead_seeds.json`'s paper set). `bench.studies.backlog_diagnosis`'s per-layer split
(static seconds of the picked actions, the queue waits the policy saw, the queueing that formed after it, the
trip home, hops, budget spent, slots replaced), summed over the layers of a decode pass, plus each node's
utilisation, for H=0, H=2 (the default), H=2 with the queue term (`now`, `mean`) and with priced tables, on
`bench.studies.backlog_paper`'s scenario (testbed8, migrate, budget 0.05, the committed workload seed).

    python -m bench.studies.paper_diagnosis [MODEL:COUNTED[,MODEL:COUNTED]] [--window-s W --out FILE]
    # default: qwen1.5-moe-a2.7b:olmoe,mixtral-8x7b:mixtral

`--window-s`: the simulator's wave width (default its own, 1 ms; 0: the exact event order, where each pass
decides at its own instant with the backlogs of that instant, `bench.studies.window_error`). Writes
bench/results/paper_diagnosis.json (or --out).
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the bench package


from bench.common import environment
from bench.studies.backlog_diagnosis import diagnose
from bench.studies.backlog_paper import paper_setting
from bench.studies.lookahead_diagnosis import summed_row
from edgemoe.io import atomic_write_json

OUT = ROOT / "bench" / "results" / "paper_diagnosis.json"
MODELS = "qwen1.5-moe-a2.7b:olmoe,mixtral-8x7b:mixtral"
BUDGET = 0.05  # backlog_paper's
VARIANTS = {"H0": {"horizon": 0}, "H2": {"horizon": 2}, "H2-now": {"horizon": 2, "backlog": "now"},
            "H2-off": {"horizon": 2, "backlog": "off"}, "H2-priced": {"horizon": 2, "table_price": True}}


def main(argv: list[str]) -> int:
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.simulate import DEFAULT_WINDOW_S, simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="?", default=MODELS, help="MODEL:COUNTED[,MODEL:COUNTED]")
    ap.add_argument("--window-s", type=float, default=DEFAULT_WINDOW_S, help="the simulator's wave width, seconds")
    ap.add_argument("--out", type=Path, default=OUT, help="results file")
    args = ap.parse_args(argv)
    if not (args.window_s >= 0 and args.window_s < float("inf")):
        ap.error(f"--window-s: expected a finite number of seconds >= 0, got {args.window_s}")
    pairs = [p.split(":") for p in args.models.split(",")]
    if any(len(p) != 2 for p in pairs):
        ap.error(f"expected MODEL:COUNTED[,MODEL:COUNTED], got {args.models!r}")
    window = args.window_s
    c_all = time.process_time()
    rows = []
    for model, counted in pairs:
        ctx, trace, wl, _ = paper_setting(model, counted, log=lambda *a: None)
        for name, params in VARIANTS.items():
            c0 = time.process_time()
            out = diagnose(ctx, make_policy("ordermoe", ctx, budget=BUDGET, **params), trace, wl, window)
            # the compiled loop makes the same decisions; it also gives each node's utilisation
            sim = simulate(ctx, make_policy("ordermoe", ctx, budget=BUDGET, **params), trace, wl, window_s=window)
            if abs(sim.latency_ms["mean"] - out["mean_ms"]) > 1e-4:  # diagnose rounds to 4 decimals
                raise AssertionError(f"{model} {name}: the per-wave path gave {out['mean_ms']} ms, the simulator "
                                     f"{sim.latency_ms['mean']} ms")
            rows.append(summed_row({"model": model, "budget": BUDGET, "method": name, "params": params}, out, c0,
                                   p99_ms=sim.latency_ms["p99"], utilisation=sim.utilisation,
                                   remote=sim.remote_ratio))
    atomic_write_json(args.out, {"note": __doc__.split("\n\n")[0], "window_s": window, "rows": rows,
                                 "environment": environment(cpu_s=time.process_time() - c_all)})
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
