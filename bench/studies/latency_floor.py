"""The latency no runtime policy can go below on equal_quality's workload (issue 19: the 0.8x target at
`default-upcycled`'s `paper` point).

    python -m bench.studies.latency_floor [--models default-upcycled] [--eval-tokens 4096]

Per model, with bench.studies.equal_quality's settings (edge8, migrate mode, the model's dense cost, the
simulated workload replaying WikiText-2 test's routing), `exact` is simulated on a placement where every node
holds every expert, so that no branch leaves the token's node:
- `all_local_ms`: every routed branch run where the token is (K experts per layer, no transfer): what a
  policy gets that replaces every remote branch by a local stand-in, and the floor of every policy that runs
  K experts per layer (it has the same dense work and the same expert calls, and no transfer can be faster
  than none);
- `one_local_ms`: only each layer's top-1 branch, where the token is (the routing trace cut to K = 1): the
  floor of every policy that keeps some expert output at every layer (skip, reroute, random-local and
  OrderMoE never leave a layer without one);
- on the placement every method of bench.studies.equal_quality shares (`ordermoe` at ORDERMOE_BUDGET):
  `planned_stay_local_ms`, a policy that never moves the token and runs one local expert where the node holds
  one (else none), and `planned_stay_or_nearest_ms`, the same keeping an expert output at every layer: where the
  token's node holds no expert of the layer, one round trip to the node reached first that holds one; with
  `home_layers_without_expert`, the share of (user home, layer) pairs that force that trip.
Each is set beside the best baseline's latency at OrderMoE's `paper` point in `equal_quality_full.json`:
floor / best baseline is the least ratio any policy could reach there.
Writes bench/results/equal_quality_floor.json (commit, load, CPU s).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.common import RESULTS
from bench.studies.equal_quality import scoring_setting
from edgemoe.eval.experiment import (
    ORDERMOE_BUDGET,
    ExperimentConfig,
    cached_profile,
    default_specs,
    load_eval_text,
)
from edgemoe.io import atomic_write_json, read_json
from edgemoe.results import environment

REPO = Path(__file__).resolve().parents[2]
EQUAL_QUALITY = RESULTS / "equal_quality_full.json"  # whose best baseline at `paper` each floor is set beside


def everywhere(placement):
    """`placement` with every expert on every node (capacity raised to hold them): nothing is remote."""
    hosts = np.ones_like(placement.hosts)
    need = int(placement.expert_bytes.sum())
    return replace(placement, method="everywhere", params={}, hosts=hosts,
                   capacity_bytes=np.maximum(placement.capacity_bytes, need))


def top_one_policy():
    """A policy class running only each layer's top-1 branch, by `exact`'s rule (on `everywhere`: where the token is)."""
    from edgemoe.runtime.policies.baselines import exact_decision
    from edgemoe.runtime.policy import Policy

    class TopOneLocal(Policy):
        name = "top-one"

        def choose(self, layer, topk, gates, state, load):
            dec = exact_decision(self.ctx, layer, topk, state, load)
            drop = np.arange(topk.shape[1])[None, :] != np.argmax(np.abs(gates), axis=1)[:, None]  # [T, K]
            return replace(dec, experts=np.where(drop, -1, dec.experts), node=np.where(drop, -1, dec.node))

    return TopOneLocal


def stay_policy():
    """A policy class that never moves a token: at each layer one expert where the token is when its node holds
    any expert of the layer (the lowest id: which one does not change the seconds), else no expert at all (the
    layer's MoE output lost). Every policy on the same placement either travels (one trip costs more than a
    layer's expert call on edge8) or runs at least this work, so no policy's latency goes below it."""
    from edgemoe.runtime.policies.baselines import exact_decision
    from edgemoe.runtime.policy import Policy

    class StayLocal(Policy):
        name = "stay-local"

        def choose(self, layer, topk, gates, state, load):
            dec = exact_decision(self.ctx, layer, topk, state, load)
            loc = state.location
            held = self.ctx.hosts[loc, layer]  # [T, E]
            here = held.any(axis=1)
            keep = (np.arange(topk.shape[1])[None, :] == 0) & here[:, None]  # [T, K] slot 0 runs, where possible
            experts = np.where(keep, np.argmax(held, axis=1)[:, None], -1)
            return replace(dec, experts=experts, node=np.where(keep, loc[:, None], -1), next_location=loc.copy(),
                           zeroed=~keep)

    return StayLocal


def stay_or_nearest_policy():
    """`stay_policy` that keeps an expert output at every layer: where the token's node holds no expert of the
    layer, one expert runs on the node holding one that the token's node reaches first (its transfer plus
    compute), and the token meets it back where it was. What every policy that never leaves a layer without
    expert output must at least pay on this placement: the same local work, and one trip where a trip cannot
    be avoided."""
    from edgemoe.runtime.policy import Policy

    base = stay_policy()

    class StayOrNearest(base):
        name = "stay-or-nearest"

        def choose(self, layer, topk, gates, state, load):
            dec = base.choose(self, layer, topk, gates, state, load)
            ctx, loc = self.ctx, state.location
            lay_hosts = ctx.hosts[:, layer].transpose(1, 0, 2)  # [T, N, E]
            holds = lay_hosts.any(axis=2)  # [T, N]
            away = ~holds[np.arange(len(loc)), loc]
            if not away.any():
                return dec
            reach = ctx.xfer_s[loc] + ctx.xfer_s[:, loc].T  # [T, N] there and back
            n = np.where(holds, reach, np.inf).argmin(axis=1)
            e = np.argmax(lay_hosts[np.arange(len(loc)), n], axis=1)
            experts, node, zeroed = dec.experts.copy(), dec.node.copy(), dec.zeroed.copy()
            experts[away, 0], node[away, 0], zeroed[away, 0] = e[away], n[away], False
            return replace(dec, experts=experts, node=node, zeroed=zeroed)

    assert issubclass(StayOrNearest, Policy)
    return StayOrNearest


def run_model(model: str, cfg: ExperimentConfig, log, reference: dict | None) -> dict:
    from edgemoe.cluster.load import load_cluster
    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.plan import plan
    from edgemoe.plan.problem import plan_problem
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.simulate import simulate

    adapter, tokenizer = load_moe(model), load_tokenizer(model)
    eval_spec, calib_spec = default_specs(cfg)
    profile = cached_profile(adapter, tokenizer, calib_spec, cfg, log)
    text = load_eval_text(adapter, tokenizer, cfg, eval_spec, calib_spec, log)  # (calibration text: unused here)
    cluster = load_cluster("edge8")
    # any planned placement: only its node and byte tables are kept (random: no planning time)
    base = plan(plan_problem(profile, cluster), "random")
    ctx, workload, trace, _, _ = scoring_setting(profile, cluster, everywhere(base), adapter, text, cfg)
    all_local = simulate(ctx, make_policy("exact", ctx), trace, workload)
    one_local = simulate(ctx, top_one_policy()(ctx), trace, workload)
    # the placement every method of bench.studies.equal_quality shares
    placement = plan(plan_problem(profile, cluster), "ordermoe", budget=ORDERMOE_BUDGET)
    pctx, workload, trace, _, _ = scoring_setting(profile, cluster, placement, adapter, text, cfg)
    planned = simulate(pctx, stay_policy()(pctx), trace, workload)
    nearest = simulate(pctx, stay_or_nearest_policy()(pctx), trace, workload)
    held = pctx.hosts.any(axis=2)  # [N, L] node holds some expert of the layer
    homes = pctx.user_home
    out = {"model": model, "eval_tokens": int(text.ids.size), "all_local_ms": all_local.latency_ms["mean"],
           "one_local_ms": one_local.latency_ms["mean"], "planned_stay_local_ms": planned.latency_ms["mean"],
           "planned_stay_or_nearest_ms": nearest.latency_ms["mean"],
           "exact_planned_ms": simulate(pctx, make_policy("exact", pctx), trace, workload).latency_ms["mean"],
           "experts_held_per_node_layer": pctx.hosts.sum(axis=2).tolist(),
           "home_layers_without_expert": float((~held[homes]).mean())}
    if reference is not None:
        row = reference["equal_quality_full"]["paper"]
        best = row["baselines_latency_ms_at_same_ppl"][row["best_baseline"]]
        out["paper"] = {"best_baseline": row["best_baseline"], "best_baseline_ms": best,
                        "ordermoe_full_ms": row["ordermoe_latency_ms_mean"],
                        "all_local_over_best": out["all_local_ms"] / best, "one_local_over_best": out["one_local_ms"] / best,
                        "planned_stay_local_over_best": out["planned_stay_local_ms"] / best,
                        "planned_stay_or_nearest_over_best": out["planned_stay_or_nearest_ms"] / best}
    log(f"{model}: all local {out['all_local_ms']:.3f} ms, one local expert per layer {out['one_local_ms']:.3f} ms, "
        f"planned placement: exact {out['exact_planned_ms']:.3f} ms, never moving, one local expert where the node holds one "
        f"{out['planned_stay_local_ms']:.3f} ms, and an expert output at every layer {out['planned_stay_or_nearest_ms']:.3f} ms (home layers without an expert {out['home_layers_without_expert']:.3f})"
        + (f"; best baseline at paper {out['paper']['best_baseline_ms']:.3f} ms ({out['paper']['best_baseline']}): floors "
           f"{out['paper']['all_local_over_best']:.3f}x / {out['paper']['one_local_over_best']:.3f}x" if reference else ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default-upcycled")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--reference", default=str(EQUAL_QUALITY))
    ap.add_argument("--out", default=str(RESULTS / "equal_quality_floor.json"))
    args = ap.parse_args()
    ref = {m["model"]: m for m in read_json(args.reference, what="equal-quality results file")["models"]} \
        if Path(args.reference).is_file() else {}
    cfg = ExperimentConfig(shared_data=str(REPO.parent / "shared" / "data"), cache_dir=str(REPO / "runs" / "cache"),
                           eval_tokens=args.eval_tokens, calib_quality_tokens=256)
    load0, c0, w0 = os.getloadavg(), time.process_time(), time.perf_counter()
    models = [run_model(m, replace(cfg, model=m), print, ref.get(m)) for m in args.models.split(",")]
    doc = {"schema": "edgemoe.bench.equal_quality_floor/1", "environment": environment(),
           "load_average_start": list(load0), "load_average_end": list(os.getloadavg()),
           "cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1),
           "config": {"cluster": "edge8", "mode": "migrate", "eval_tokens": args.eval_tokens, "reference": args.reference,
                      "num_requests": cfg.num_requests, "prompt_tokens": cfg.prompt_tokens, "gen_tokens": cfg.gen_tokens,
                      "rate_per_s": cfg.rate_per_s},
           "models": models}
    atomic_write_json(Path(args.out), doc)
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s wall, {doc['cpu_s']:.0f} s CPU)")


if __name__ == "__main__":
    main()
