"""What the look-ahead's queue term (`backlog=`) costs where issue 21's speed targets are measured: the ordermoe
(H=2) decision at decode with the term off / "now" / "mean" (`bench.speed.policies`' setups and timing, 1 and 64
rows per call, loaded nodes), and the simulator's CPU time over exact's (`bench.speed.simulator`'s scenarios, the
fast engine, runs taking turns). A setting whose exposure tables would pass `EXPOSURE_MAX_BYTES` records the
policy's error instead of a time.

    python -m bench.speed.backlog_cost [--repeat 5]

Writes bench/results/backlog_cost.json (CPU seconds, the fastest of the repeats, the load beside each row).
Decision costs are the same quantity as `policies_decode.json`'s; the simulator ratio is `simulator.json`'s.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from bench.common import RESULTS, environment
from edgemoe.errors import EdgeMoEError
from edgemoe.io import atomic_write_json

KINDS = ("off", "now", "mean")


def decode_rows(repeat: int) -> list[dict]:
    """The decision at decode per setup, rows per call and queue-term kind: fastest CPU us per token-layer."""
    from bench.speed.policies import PLAN_EVALS, setups, time_policy
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan
    from edgemoe.runtime import make_context, make_policy

    out = []
    for label, profile, cluster in setups(False):
        placement = plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe", max_evals=PLAN_EVALS)
        ctx = make_context(profile, cluster, placement, mode="migrate", domain_fallback=True)
        for T in (1, 64):
            rng = np.random.default_rng(0)
            rows, users = rng.integers(0, profile.num_tokens, T), rng.integers(0, ctx.num_users, T)
            load = np.random.default_rng(1).exponential(0.005, ctx.num_nodes)
            for kind in KINDS:
                rec = {"setup": label, "rows_per_call": T, "backlog": kind, "load_average_1": os.getloadavg()[0]}
                try:
                    pol = make_policy("ordermoe", ctx, horizon=2, backlog=kind)
                except EdgeMoEError as e:
                    out.append({**rec, "error": str(e)})
                    continue
                got = time_policy(pol, profile, rows, users, load, repeats=max(repeat, 5 if T == 1 else 3))
                out.append({**rec, "fastest_cpu_us_per_token_layer": 1e6 * got["cpu_min"],
                            "fastest_us_per_token_layer": 1e6 * got["wall_min"]})
                print(out[-1], flush=True)
    return out


def simulator_rows(repeat: int) -> list[dict]:
    """The simulator per scenario: fastest CPU s of exact and of ordermoe (H=2) with each queue-term kind."""
    from bench.speed.simulator import contexts, timed_runs
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.simulate import DEFAULT_WINDOW_S

    out = []
    for label, ctx, trace, wl, _ in contexts(False):
        runs, errors, rows = {"exact": (ctx, "exact", {}, trace, wl, "fast", DEFAULT_WINDOW_S)}, {}, {}
        for kind in KINDS:
            try:
                expo = make_policy("ordermoe", ctx, horizon=2, backlog=kind).lookahead.expo
                runs[kind] = (ctx, "ordermoe", {"horizon": 2, "backlog": kind}, trace, wl, "fast", DEFAULT_WINDOW_S)
            except EdgeMoEError as e:
                errors[kind] = str(e)
                continue
            if kind != "off":  # the exposure rows the term reads (the same for both kinds)
                count = expo.count
                distinct = np.unique(expo.span[count > 0, 0])  # (identical rows share their entries)
                rows = {"rows": len(count), "entries_per_nonempty_row_mean": float(count[count > 0].mean()),
                        "entries_per_row_max": int(count.max()), "distinct_nonempty_rows": len(distinct),
                        "entries_stored": len(expo.val), "entries_if_unshared": int(count.sum()),
                        "mib": expo.nbytes / 2**20}
        load = os.getloadavg()[0]
        got = timed_runs(repeat, runs)
        cpu = {name: v[2] for name, v in got.items()}
        out.append({"scenario": label, "cpu_s": cpu, "vs_exact": {k: v / cpu["exact"] for k, v in cpu.items() if k != "exact"},
                    "errors": errors, "exposure_rows": rows, "load_average_1": load})
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per row; the fastest is kept")
    args = ap.parse_args()
    decode = decode_rows(args.repeat)
    sim = simulator_rows(args.repeat)
    atomic_write_json(RESULTS / "backlog_cost.json", {
        "benchmark": "backlog_cost", "issue": "21 item 3", "note": __doc__.split("\n\n")[0],
        "decode": decode, "simulator": sim, "environment": environment()})
    print("wrote", RESULTS / "backlog_cost.json")


if __name__ == "__main__":
    main()
