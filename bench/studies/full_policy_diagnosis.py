"""Why `ordermoe-full` was slower than `reroute` on `finegrained-shared`, on calibration text only (issue 19).

    python -m bench.studies.full_policy_diagnosis [--model finegrained-shared] [--budget 0.0488]

With bench.studies.equal_quality's settings (edge8, migrate mode, one `ordermoe` placement at ORDERMOE_BUDGET)
but the calibration text in both roles (2,048 tokens of the shared corpus' held-out split: its perplexity
from the local backend, its routing replayed by the simulator), per variant: perplexity increase, simulated
mean latency, and the slots substituted / dropped or zeroed in each backend (they must agree for the row's
latency and perplexity to come from the same decisions):
- `ordermoe-full` simulated without router logits (the co-selection fallback prices the substitutes there),
- the same with the calibration text's router logits replayed (`OrderMoEPolicy.replay_logits`),
- the same without the feedback's adaptive weights (`adapt_gain=0`), without logits,
- `reroute` at the budget of its `paper` point in equal_quality_ladder_finegrained.json (0.481);
and, at the small budgets of the `strict` point, `ordermoe-full` (H = 2, steered) against the same with
H = 0 (myopic, unsteered), both with the logits replayed, beside `random-local` (the best baseline at `strict`
there) at its own small budgets (`STRICT_SWEEP`); and, at two of those budgets, the ablations that split the
steered policy's loss (`STEER_ABLATIONS`): H = 2 without the trip home in its tables (`home_trip` False: the
window that reaches the last layer then ends at the token's node), H = 2 unsteered (the look-ahead only
prices the budget kept), H = 2 looked up at budget level 0 (`pace_share` 0: the tables price exact execution ahead), steered and unsteered,
H = 2 with no quality price, and H = 2 / H = 0 both without the logits (the tables' co-selection fallback then
prices the decisions' substitutes too).
Writes bench/results/equal_quality_diagnosis.json (commit, load, CPU s).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS
from bench.studies.equal_quality import model_calibration, router_logits_of, scoring_setting, simulated_policy
from edgemoe.eval.experiment import (
    ORDERMOE_BUDGET,
    ExperimentConfig,
    cached_profile,
    default_specs,
    eval_trace,
    load_eval_text,
    rise_with_bound,
)
from edgemoe.io import atomic_write_json
from edgemoe.results import environment

REPO = Path(__file__).resolve().parents[2]
REROUTE_BUDGET = 0.4809355398685445  # reroute's paper point on finegrained-shared (equal_quality_ladder_finegrained.json)
STRICT_SWEEP = {"ordermoe-full": (0.003, 0.0041, 0.006), "ordermoe-full-h0": (0.003, 0.0041, 0.006),
                "random-local": (0.12, 0.186, 0.25)}  # around each method's strict point there (nats / gate share)
ABLATION_BUDGETS = (0.003, 0.006)
# name: (params over the full policy's, replay the logits, pace_share override or None)
STEER_ABLATIONS = {"h2-no-home-trip": ({"home_trip": False}, True, None),
                   "h2-unsteered": ({"steer": False}, True, None),
                   "h2-exact-ahead": ({}, True, 0.0),
                   "h2-unsteered-exact-ahead": ({"steer": False}, True, 0.0),
                   "h2-no-quality-price": ({"quality_price": 0.0}, True, None),
                   "h2-without-logits": ({}, False, None),
                   "h0-without-logits": ({"horizon": 0}, False, None)}


def with_share(policy, share: float | None):
    """The policy with its look-ahead looked up at `share` of the remaining budget (`pace_share` replaced;
    share 0: budget level 0, the tables' exact-execution values), or as made (None). A diagnosis, not an option."""
    if share is not None:
        policy.pace_share = lambda layer: np.full(np.shape(layer), share, float)
    return policy


def main() -> None:
    from edgemoe.cluster.load import load_cluster
    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.plan import plan
    from edgemoe.plan.problem import plan_problem
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.local import routing_trace, score_local
    from edgemoe.runtime.sim.simulate import simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="finegrained-shared")
    ap.add_argument("--budget", type=float, default=0.0488, help="ordermoe-full's budget (its paper point there)")
    ap.add_argument("--out", default=str(RESULTS / "equal_quality_diagnosis.json"))
    args = ap.parse_args()
    load0, c0, w0 = os.getloadavg(), time.process_time(), time.perf_counter()
    cfg = ExperimentConfig(shared_data=str(REPO.parent / "shared" / "data"), cache_dir=str(REPO / "runs" / "cache"),
                           eval_tokens=256, calib_quality_tokens=2048, model=args.model)
    adapter, tokenizer = load_moe(args.model), load_tokenizer(args.model)
    eval_spec, calib_spec = default_specs(cfg)
    profile = cached_profile(adapter, tokenizer, calib_spec, cfg, print)
    text = load_eval_text(adapter, tokenizer, cfg, eval_spec, calib_spec, print)
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster), "ordermoe", budget=ORDERMOE_BUDGET)
    ctx, workload, _, _, users = scoring_setting(profile, cluster, placement, adapter, text, cfg)
    topk, gates = routing_trace(adapter, text.calib_ids)
    trace = eval_trace(topk, gates, ctx.user_domain, cfg.block_len)  # the calibration text's routing, replayed
    logits = router_logits_of(adapter, text.calib_ids)
    full = {"horizon": 2, "stand_in_choice": "token", "calibration": model_calibration(args.model)}
    variants = (("ordermoe-full, simulated without logits", "ordermoe", full, args.budget, False),
                ("ordermoe-full, logits replayed", "ordermoe", full, args.budget, True),
                ("ordermoe-full, adapt_gain 0, without logits", "ordermoe", {**full, "adapt_gain": 0.0}, args.budget, False),
                ("reroute", "reroute", {}, REROUTE_BUDGET, False),
                *((f"{name} at a strict budget", "random-local" if name == "random-local" else "ordermoe",
                   {"seed": 0} if name == "random-local" else {**full, "horizon": 0 if name.endswith("h0") else 2}, b,
                   name != "random-local") for name, bs in STRICT_SWEEP.items() for b in bs))
    variants = tuple((*v, None) for v in variants) + tuple(
        (f"ordermoe-full-{name} at a strict budget", "ordermoe", {**full, **extra}, b, replay, share)
        for name, (extra, replay, share) in STEER_ABLATIONS.items() for b in ABLATION_BUDGETS)
    rows = []
    for name, policy, params, budget, replay, share in variants:
        nll, _, dec = score_local(adapter, with_share(make_policy(policy, ctx, **params, budget=budget), share),
                                  text.calib_ids, users)
        sim = simulate(ctx, with_share(simulated_policy(policy, ctx, params, budget, logits if replay else None), share),
                       trace, workload)
        sub = dec.substituted()
        rows.append({"variant": name, "policy": policy, "budget": budget, "replayed_logits": replay,
                     "pace_share_override": share,
                     "ppl_rel_increase": rise_with_bound(nll, text.calib_nll)[0],
                     "latency_ms_mean": sim.latency_ms["mean"], "local_slots_substituted": float(sub.mean()),
                     "local_slots_dropped_or_zeroed": float((dec.experts < 0).mean()),
                     "sim_substitution_ratio": sim.substitution_ratio, "sim_drop_ratio": sim.drop_ratio,
                     "sim_budget_used_fraction": sim.budget_used_fraction, "sim_remote_ratio": sim.remote_ratio,
                     "local_substituted_per_layer": sub.mean(axis=(0, 2)).tolist()})
        r = rows[-1]
        print(f"{name:<44} +{100 * r['ppl_rel_increase']:.2f}% {r['latency_ms_mean']:.2f} ms; substituted local "
              f"{r['local_slots_substituted']:.3f} / simulated {r['sim_substitution_ratio']:.3f}")
    doc = {"schema": "edgemoe.bench.equal_quality_diagnosis/1", "environment": environment(),
           "load_average_start": list(load0), "load_average_end": list(os.getloadavg()),
           "cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1),
           "config": {"model": args.model, "cluster": "edge8", "mode": "migrate", "text": calib_spec,
                      "calib_tokens": int(text.calib_ids.size), "num_requests": cfg.num_requests,
                      "prompt_tokens": cfg.prompt_tokens, "gen_tokens": cfg.gen_tokens, "rate_per_s": cfg.rate_per_s},
           "rows": rows}
    atomic_write_json(Path(args.out), doc)
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s wall, {doc['cpu_s']:.0f} s CPU)")


if __name__ == "__main__":
    main()
