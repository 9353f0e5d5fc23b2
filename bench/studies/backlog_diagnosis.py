# ruff: noqa: E402 - imports after the sys.path line that lets the script import the bench package
"""Issue 21 item 3: where does the look-ahead (H=2) lose to the myopic policy (H=0)? Per layer, on decode
passes (what the latency metric measures), each variant's mean of:

- `realized_ms`: the layer's time in the simulator (start of layer l+1, or the pass's end, less its start);
- `static_ms`: the picked action's seconds with no queues (transfers + compute of its slowest branch, + the
  trip home after the last layer): what the action costs by itself;
- `seen_wait_ms`: the policy's own estimate (`Decision.latency_s`, with the queue waits it saw) less static;
- `unforeseen_ms`: realized less the estimate and the layer's backbone stage (dense work): the queueing
  that formed after the decision (other tokens sent to the same node: herding shows here);
- `home_trip_ms` (last layer): the transfer from the meeting node to the token's home, inside static;
- `hops`: share of tokens whose location changes at the layer; `spent`: quality cost spent at the layer;
  `replaced`: share of slots substituted, dropped or zeroed.

    python -m bench.studies.backlog_diagnosis MODEL SIZE:POINT[,SIZE:POINT...] [VARIANT,...]
    # e.g. default-upcycled 4:strict,8:paper  (scaling's generated clusters; SIZE "demo" = edge8 migrate)

A variant is NAME=JSON of OrderMoEPolicy parameters (';' between them); default H0, H2, H2 without the trip
home in its tables (home_trip=False) and H2 with priced tables (table_price=True). The wave loop is the
simulator's per-wave path (`run_fast` with compiled=False, the same decisions as the compiled loop), with
the layer times read from the engine between waves. Writes bench/results/backlog_diagnosis.json.
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
from bench.studies.ordermoe_placement import demo_inputs
from bench.studies.scaling import operating_budgets, size_setting
from edgemoe.io import atomic_write_json
from edgemoe.runtime import make_context, make_policy

OUT = ROOT / "bench" / "results" / "backlog_diagnosis.json"
# the default policy at H = 0 and 2; H = 2 with tables that take the token's home to be its last node; H = 2 with
# tables whose future layers pay the policy's quality price (`table_price`)
VARIANTS = {"H0": {"horizon": 0}, "H2": {"horizon": 2}, "H2-no-home-trip": {"horizon": 2, "home_trip": False},
            "H2-priced": {"horizon": 2, "table_price": True}}


def static_s(ctx, layer: np.ndarray, dec, home: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([T] seconds of the picked actions with no queues, [T] their trip home after the last layer)."""
    xfer, comp = ctx.xfer_s, ctx.compute_s
    loc, nxt = dec.location, dec.next_location
    ran = dec.node >= 0
    node = np.where(ran, dec.node, 0)
    exp = np.where(ran, dec.experts, 0)
    branch = xfer[loc[:, None], node] + comp[node, layer[:, None], exp] + xfer[node, nxt[:, None]]
    lat = np.where(ran, branch, 0.0).max(axis=1, initial=0.0)
    trip = np.where(layer == ctx.num_layers - 1, xfer[nxt, home], 0.0)
    return lat + trip, trip


def diagnose(ctx, policy, trace, workload, window_s: float | None = None) -> dict:
    """Per-layer means (module docstring) over decode passes, plus the run's mean decode latency; window_s: the
    simulator's wave width (None: its default)."""
    from edgemoe.runtime.sim.engine import WaveEngine
    from edgemoe.runtime.sim.run import Feedback, Run
    from edgemoe.runtime.sim.simulate import DEFAULT_WINDOW_S, build_scenario

    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, workload)
    run = Run(ctx, sc)
    state = policy.start(sc.row_user, tokens=sc.row_trace)
    engine = WaveEngine(ctx, sc, run, DEFAULT_WINDOW_S if window_s is None else window_s, policy)
    feedback = Feedback(policy, sc, state, run, dense_s=engine.pass_dense)
    L, P = ctx.num_layers, sc.num_passes
    cols = ("static", "trip", "est", "hops", "spent", "replaced", "start")
    rec = {c: np.full((P, L), np.nan) for c in cols}
    wave = engine.first()
    while wave is not None:
        rows, row_pass, lv, tok, load = wave
        starts = engine.start_t[row_pass].copy()
        part = state.take(rows)
        topk, gates = trace.topk[tok, lv], trace.gates[tok, lv]
        dec = policy.decide(lv, topk, gates, part, load)
        state.put(rows, part)
        feedback.add(row_pass, dec)
        st, trip = static_s(ctx, lv, dec, part.home)
        # a decode pass has one row: its values are the pass's (prefill rows are dropped below)
        for c, v in (("static", st), ("trip", trip), ("est", dec.latency_s), ("start", starts),
                     ("hops", (dec.next_location != dec.location).astype(float)), ("spent", dec.quality_cost),
                     ("replaced", (dec.experts != topk).mean(axis=1))):
            rec[c][row_pass, lv] = v
        wave = engine.step(row_pass, lv, part.home, dec)
        feedback.flush()
    feedback.flush(force=True)
    decode = ~sc.pass_prefill
    # layer l runs from its expert stage's start to the next layer's (which follows that layer's backbone
    # stage: the dense work, counted in `stage`), the last one to the pass's end; layer 0's backbone stage
    # comes before its start (`first_stage_ms`)
    end = np.concatenate([rec["start"][:, 1:], run.pass_end[:, None]], axis=1)
    realized = end - rec["start"]
    first = rec["start"][:, 0] - run.pass_begin
    stage = np.where(np.arange(L) < L - 1, np.asarray(engine.pass_dense, float)[:, None], 0.0)
    total = (run.pass_end - run.pass_begin)[decode]
    if not np.allclose(realized[decode].sum(axis=1) + first[decode], total, rtol=1e-9, atol=1e-12):
        raise AssertionError("layer times do not add up to the pass latency")

    def mean(x):
        return (np.nanmean(x[decode], axis=0)).round(6).tolist()

    ms = 1e3
    return {"mean_ms": round(float(total.mean()) * ms, 4), "first_stage_ms": round(float(first[decode].mean()) * ms, 4),
            "per_layer": {"realized_ms": mean(realized * ms), "static_ms": mean(rec["static"] * ms),
                          "seen_wait_ms": mean((rec["est"] - rec["static"]) * ms),
                          "unforeseen_ms": mean((realized - rec["est"] - stage) * ms),
                          "stage_ms": mean(stage * ms),
                          "home_trip_ms": mean(rec["trip"] * ms), "hops": mean(rec["hops"]),
                          "spent": mean(rec["spent"]), "replaced": mean(rec["replaced"])}}


def scenario(profile, cfg, model: str, size: str, point: str):
    """(ctx, workload, budget) of one diagnosed row: scaling's setting of `size` servers (or the demo's edge8,
    migrate), the ordermoe placement planned for the point's budget."""
    from edgemoe.cluster import load_cluster
    from edgemoe.plan import plan, plan_problem
    from edgemoe.runtime.context import context_from_problem
    from edgemoe.runtime.sim.workload import Workload

    budget = operating_budgets(model)[point]
    if size == "demo":
        cluster = load_cluster("edge8")
        fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
        problem = plan_problem(profile, cluster, domain_fallback=fallback)
        wl = Workload(num_requests=64, prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens, rate_per_s=20.0,
                      seed=cfg.seed)
        return context_from_problem(problem, plan(problem, "ordermoe", mode="migrate", budget=budget),
                                    mode="migrate", dense=True), wl, budget
    cluster, fallback, problem, groups, wl = size_setting(profile, cfg, int(size))
    pl = plan(problem, "ordermoe", mode="migrate", budget=budget)
    return make_context(profile, cluster, pl, mode="migrate", groups=groups, domain_fallback=fallback), wl, budget


def main(argv: list[str]) -> int:
    from edgemoe.eval.experiment import eval_trace

    model, cases = argv[0], [c.split(":") for c in argv[1].split(",")]
    variants = VARIANTS if len(argv) < 3 else dict(
        (v.split("=", 1)[0], json.loads(v.split("=", 1)[1])) for v in argv[2].split(";"))
    c_all = time.process_time()
    profile, topk, gates, cfg = demo_inputs(ROOT / "runs" / "cache", model)
    doc = json.loads(OUT.read_text()) if OUT.is_file() else {"rows": []}
    rows = [r for r in doc["rows"] if (r["model"], r["size"], r["point"]) not in {(model, s, p) for s, p in cases}]
    for size, point in cases:
        ctx, wl, budget = scenario(profile, cfg, model, size, point)
        trace = eval_trace(topk, gates, ctx.user_domain, cfg.block_len)
        for name, params in variants.items():
            c0 = time.process_time()
            out = diagnose(ctx, make_policy("ordermoe", ctx, budget=budget, **params), trace, wl)
            rows.append({"model": model, "size": size, "point": point, "budget": budget, "method": name,
                         "params": params, **out, "cpu_s": round(time.process_time() - c0, 1),
                         "load": os.getloadavg()[0]})
            print(json.dumps(rows[-1]), flush=True)
    doc = {"note": __doc__.split("\n\n")[0], "environment": environment(cpu_s=time.process_time() - c_all),
           "rows": rows}
    atomic_write_json(OUT, doc)
    print("wrote", OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
