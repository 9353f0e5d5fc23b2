# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3: what the queue term (`backlog`) changes at paper scale, where it moves the two models in
opposite directions (`lookahead_seeds.json`'s paper set). `bench.studies.backlog_diagnosis`'s per-layer split
(static seconds of the picked actions, the queue waits the policy saw, the queueing that formed after it, the
trip home, hops, budget spent, slots replaced), summed over the layers of a decode pass, plus each node's
utilisation, for H=0, H=2 (the default), H=2 with the queue term (`now`, `mean`) and with priced tables, on
`bench.studies.backlog_paper`'s scenario (testbed8, migrate, budget 0.05, the committed workload seed).

    python -m bench.studies.paper_diagnosis [MODEL:COUNTED[,MODEL:COUNTED]]
    # default: qwen1.5-moe-a2.7b:olmoe,mixtral-8x7b:mixtral

Writes bench/results/paper_diagnosis.json.
"""
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
            "H2-mean": {"horizon": 2, "backlog": "mean"}, "H2-priced": {"horizon": 2, "table_price": True}}


def main(argv: list[str]) -> int:
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.simulate import simulate

    pairs = [p.split(":") for p in (argv[0] if argv else MODELS).split(",")]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit(f"paper_diagnosis: expected MODEL:COUNTED[,MODEL:COUNTED], got {argv[0]!r}")
    c_all = time.process_time()
    rows = []
    for model, counted in pairs:
        ctx, trace, wl, _ = paper_setting(model, counted, log=lambda *a: None)
        for name, params in VARIANTS.items():
            c0 = time.process_time()
            out = diagnose(ctx, make_policy("ordermoe", ctx, budget=BUDGET, **params), trace, wl)
            # the compiled loop makes the same decisions; it also gives each node's utilisation
            sim = simulate(ctx, make_policy("ordermoe", ctx, budget=BUDGET, **params), trace, wl)
            if abs(sim.latency_ms["mean"] - out["mean_ms"]) > 1e-4:  # diagnose rounds to 4 decimals
                raise AssertionError(f"{model} {name}: the per-wave path gave {out['mean_ms']} ms, the simulator "
                                     f"{sim.latency_ms['mean']} ms")
            rows.append(summed_row({"model": model, "budget": BUDGET, "method": name, "params": params}, out, c0,
                                   p99_ms=sim.latency_ms["p99"], utilisation=sim.utilisation,
                                   remote=sim.remote_ratio))
    atomic_write_json(OUT, {"note": __doc__.split("\n\n")[0], "environment": environment(cpu_s=time.process_time() - c_all),
                            "rows": rows})
    print("wrote", OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
