"""OrderMoE placement vs SlimCaching's, measured the way the demo measures (simulator, same workload).

Rows: exact and ordermoe policies on the `ordermoe` and `slimcaching` placements, edge8 in migrate mode
and device-edge-cloud in home mode, on the demo's calibration profile of the default model and the
routing of the demo's evaluation text (WikiText-2 test). Beside each simulated mean, `model_ms` is what the
planner's runtime model (`PathModel` at the planner's defaults) predicts for that policy on that placement.
Writes bench/results/ordermoe_placement.json.

    PYTHONPATH=src python -m bench.studies.ordermoe_placement [--cache-dir runs/cache] [--param key=value ...]

The profile and the evaluation routing trace are computed once (torch, the real model) and cached in
--cache-dir; everything after that is numpy.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def demo_inputs(cache_dir: Path, model: str = "default"):
    """(profile, eval topk [T, L, K], eval gates [T, L, K], cfg) exactly as `edgemoe demo` builds them for
    `model`."""
    from edgemoe.eval.experiment import ExperimentConfig, cached_profile, default_specs

    cfg = ExperimentConfig(model=model, cache_dir=str(cache_dir), shared_data=str(ROOT.parent / "shared" / "data"))
    trace_path = cache_dir / ("eval-trace.npz" if model == "default" else f"eval-trace-{Path(model).name}.npz")
    from edgemoe.models import load_moe, load_tokenizer

    adapter, tokenizer = load_moe(cfg.model), load_tokenizer(cfg.model)
    eval_spec, calib_spec = default_specs(cfg)
    profile = cached_profile(adapter, tokenizer, calib_spec, cfg, print)
    if trace_path.is_file():
        z = np.load(trace_path)
        return profile, z["topk"], z["gates"], cfg
    from edgemoe.data import resolve, tokenize_blocks
    from edgemoe.runtime.local import routing_trace

    blocks = tokenize_blocks(resolve(eval_spec), tokenizer, cfg.block_len, max_tokens_per_source=cfg.eval_tokens)
    ids = blocks.ids[: max(1, cfg.eval_tokens // cfg.block_len)]
    topk, gates = routing_trace(adapter, ids)
    np.savez(trace_path, topk=topk, gates=gates)
    return profile, topk, gates, cfg


CASES = (("edge8", "migrate"), ("device-edge-cloud", "home"))
SLIM_PARAMS: dict = {}  # the demo's: its deterministic refinement budget (kicks, work units)
PARAMS_KEPT = ("mode", "budget", "exact_share", "evaluations", "moves", "rows", "expected_latency_ms",
               "expected_policy_ms", "expected_exact_ms", "dense_ms", "greedy_latency_ms",
               "objective_s", "traffic_with_substitute", "spearman_cosine_vs_error")


def placement_for(problem, method: str, params: dict, cache_dir: Path, cluster: str):
    """Plan `method`; SlimCaching's (about 10 s) is cached in cache_dir per cluster and profile."""
    from edgemoe.plan import plan
    from edgemoe.plan.base import load_placement

    if method == "slimcaching":
        path = cache_dir / f"placement-slimcaching-{cluster}-{problem.profile.meta.weights_hash[:12]}.json"
        if path.is_file():
            return load_placement(path), float("nan")
    t0 = time.process_time()
    pl = plan(problem, method, **params)
    seconds = time.process_time() - t0  # CPU seconds: the shared machine's load does not inflate them
    if method == "slimcaching":
        pl.save(path)
    return pl, seconds


def measure(profile, topk, gates, cfg, cluster_name: str, mode: str, cache_dir: Path, ordermoe_params: dict,
            policies=(("exact", {}), ("ordermoe", {"budget": 0.05, "horizon": 2}))) -> dict:
    """{placement: {policy: {mean, p99}}, plus plan seconds, the planner's own expected latency and what the
    planner's runtime model (`PathModel`, policy's budget, defaults) predicts for each policy on that placement}."""
    from edgemoe.cluster.load import load_cluster
    from edgemoe.eval.experiment import eval_trace
    from edgemoe.plan import plan_problem
    from edgemoe.plan.ordermoe.planner import BUDGET, MAX_ROWS, PATHS_PER_USER
    from edgemoe.plan.ordermoe.runtime_model import PathModel
    from edgemoe.profile.groups import groups_for
    from edgemoe.runtime import make_context, make_policy
    from edgemoe.runtime.sim.simulate import simulate
    from edgemoe.runtime.sim.workload import Workload

    cluster = load_cluster(cluster_name)
    fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
    problem = plan_problem(profile, cluster, domain_fallback=fallback)
    groups = groups_for(profile)
    workload = Workload(num_requests=cfg.num_requests, prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens,
                        rate_per_s=cfg.rate_per_s, seed=cfg.seed)
    # the planner's runtime model, the same on both placements: what it predicts for each policy there
    model = PathModel(problem, mode, PATHS_PER_USER, BUDGET, groups.substitute_ids, MAX_ROWS, exact_share=0.5)
    out = {}
    for method, params in (("ordermoe", {"mode": mode, **ordermoe_params}), ("slimcaching", SLIM_PARAMS)):
        pl, seconds = placement_for(problem, method, params, cache_dir, cluster_name)
        ctx = make_context(profile, cluster, pl, mode=mode, groups=groups, domain_fallback=fallback)
        trace = eval_trace(topk, gates, ctx.user_domain, cfg.block_len)
        policy_s, exact_s = model.expected_parts(model.replay(pl.hosts))
        row = {"plan_seconds": seconds, "planner_expected_ms": pl.params.get("expected_latency_ms"),
               "model_ms": {"ordermoe": 1e3 * policy_s, "exact": 1e3 * exact_s},
               "plan_params": {k: v for k, v in pl.params.items() if k in PARAMS_KEPT}}
        for policy, pp in policies:
            m = simulate(ctx, make_policy(policy, ctx, **pp), trace, workload)
            row[policy] = {"mean": m.latency_ms["mean"], "p99": m.latency_ms["p99"]}
        out[method] = row
        print(f"{cluster_name:>18} {mode:8} {method:12} plan {seconds:6.2f} s cpu  "
              + "  ".join(f"{p}: {row[p]['mean']:7.2f} / {row[p]['p99']:7.2f} ms (model {row['model_ms'][p]:6.2f})"
                          for p, _ in policies), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "cache"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ordermoe_placement.json"))
    ap.add_argument("--param", action="append", default=[], help="ordermoe planner key=value")
    args = ap.parse_args()
    from bench.common import environment
    from edgemoe.io import atomic_write_json
    from edgemoe.params import parse_params

    cache_dir = Path(args.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    profile, topk, gates, cfg = demo_inputs(cache_dir)
    params = parse_params(args.param, "--param") if args.param else {}
    from edgemoe.profile.groups import grouping_report

    results = {f"{c}/{m}": measure(profile, topk, gates, cfg, c, m, cache_dir, params) for c, m in CASES}
    for key, r in results.items():
        r["exact_ratio"] = r["ordermoe"]["exact"]["mean"] / r["slimcaching"]["exact"]["mean"]
        r["policy_ratio"] = r["ordermoe"]["ordermoe"]["mean"] / r["slimcaching"]["ordermoe"]["mean"]
        print(f"{key}: exact@ordermoe / exact@slimcaching = {r['exact_ratio']:.3f}; "
              f"ordermoe policy on ordermoe / on slimcaching placement = {r['policy_ratio']:.3f}")
    doc = {"schema": "edgemoe.bench.ordermoe_placement/1", "environment": environment(), "ordermoe_params": params,
           "config": {"model": cfg.model, "num_requests": cfg.num_requests, "rate_per_s": cfg.rate_per_s,
                      "prompt_tokens": cfg.prompt_tokens, "gen_tokens": cfg.gen_tokens, "seed": cfg.seed},
           "results": results,
           # section 2 of issue 9: does router cosine predict measured substitution error, what do groups cover
           "groups": grouping_report(profile)}
    atomic_write_json(args.out, doc)


if __name__ == "__main__":
    main()
