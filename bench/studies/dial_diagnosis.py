"""Why the quality dial misses on a model: the calibration curve against the evaluation text's (issue 19, section 3).

    python -m bench.studies.dial_diagnosis [--model default] [--calib-tokens 2048,4096,8192,16384] [--eval-tokens 4096,16384]

With the setting of bench.studies.equal_quality (edge8, migrate mode, the demo's `ordermoe` placement, the dial's
method `ordermoe-full`: H = 2, per-token stand-ins priced in measured nats from calibration.json), measure the
policy's perplexity increase on a grid of budgets on several texts:
- `calib-N`: the first N tokens of the calibration text (the shared corpus' held-out split, as the dial uses it:
  its first source, the held-out part of WikiText-2 valid, fills the first blocks), N = 2048 ... 16384;
- `calib-mixed-N`: N tokens drawn evenly from the four domains of the held-out split (is it the domain?);
- `eval-N`: the first N tokens of the evaluation text (WikiText-2 test), for the diagnosis only: the dial never
  reads it. The prefixes of one text come from one run (each block's decisions do not depend on other blocks).
Per text and budget: the increase, a block bootstrap 90% interval of it (blocks, not tokens, are the unit), the
increase by position in the block (sequence-length effects), the predicted nats the policy spent per token and
the measured extra nats per predicted nat (does the budget's unit transfer across text?), and the share of slots
substituted / dropped. Then the dial's curve estimates (running maximum, isotonic fit) on each calibration text,
and where each puts the asked values on that text's own curve and on the evaluation text's.
Writes bench/results/dial_diagnosis.json (commit, load, CPU s).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.common import RESULTS
from bench.studies.equal_quality import DIAL_ASKED, REPO, model_calibration, scoring_setting
from edgemoe.eval.dial import calibrate_dial, rise_interval
from edgemoe.eval.experiment import (
    ORDERMOE_BUDGET,
    ExperimentConfig,
    cached_profile,
    default_specs,
    load_eval_text,
)
from edgemoe.io import atomic_write_json
from edgemoe.results import environment

GRID = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)  # nats per token-layer (the dial's grid and between)
POSITIONS = ((0, 32), (32, 128), (128, 255))  # predicted-token positions in a 256-token block
BOOT = 2000  # bootstrap resamples of the blocks


def measure(adapter, ctx, params: dict, ids: np.ndarray, nll_exact: np.ndarray, users: np.ndarray,
            budget: float) -> dict:
    """The policy at `budget` on blocks ids [B, S]: per-block extra nats, by position, spending, stand-in shares."""
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.local import score_local

    nll, _, dec = score_local(adapter, make_policy("ordermoe", ctx, **params, budget=budget), ids, users)
    diff = nll.astype(np.float64) - nll_exact.astype(np.float64)  # [B, S-1]
    spent = dec.quality_cost.sum(axis=1).reshape(len(ids), -1).mean(axis=1)  # [B] predicted nats per token
    return {"budget": budget, "block_extra_nats": diff.mean(axis=1).tolist(), "block_spent_nats": spent.tolist(),
            "by_position": {f"{a}-{b}": float(np.expm1(diff[:, a:b].mean())) for a, b in POSITIONS},
            "slots_substituted": float(dec.substituted().mean()),
            "slots_dropped": float(((dec.experts < 0) & ~dec.zeroed).mean()), "slots_zeroed": float(dec.zeroed.mean())}


def curve_of(rows: list[dict], blocks: int, rng: np.random.Generator) -> list[dict]:
    """The curve of the first `blocks` blocks: increase, block bootstrap 90% interval, measured extra nats per
    predicted nat spent."""
    out = []
    for r in rows:
        d = np.asarray(r["block_extra_nats"][:blocks])
        spent = float(np.mean(r["block_spent_nats"][:blocks]))
        out.append({"budget": r["budget"], "ppl_rel_increase": float(np.expm1(d.mean())),
                    "boot90": list(rise_interval(d, 0.9, BOOT, int(rng.integers(2**31)))), "spent_nats_per_token": spent,
                    "measured_per_predicted": float(d.mean() / spent) if spent > 0 else None})
    return out


def mixed_blocks(tokenizer, spec: str, tokens: int, block_len: int) -> tuple[np.ndarray, list[str]]:
    """[B, S] calibration blocks drawn evenly from every domain of the held-out split (the first blocks of each)."""
    from edgemoe.data import resolve, tokenize_blocks

    n = max(1, tokens // block_len)
    blocks = tokenize_blocks(resolve(spec), tokenizer, block_len, max_tokens_per_source=tokens)
    doms = np.unique(blocks.domain)
    per = -(-n // len(doms))
    take = np.concatenate([np.flatnonzero(blocks.domain == d)[:per] for d in doms])[:n]
    return blocks.ids[np.sort(take)], [blocks.domains[d] for d in blocks.domain[np.sort(take)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--calib-tokens", default="2048,4096,8192,16384", help="calibration prefixes (tokens) compared")
    ap.add_argument("--eval-tokens", default="4096,16384", help="evaluation prefixes (tokens) compared")
    ap.add_argument("--out", default=str(RESULTS / "dial_diagnosis.json"))
    args = ap.parse_args()
    from edgemoe.cluster.load import load_cluster
    from edgemoe.data import resolve, tokenize_blocks
    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.models.scoring import token_scores
    from edgemoe.plan import plan
    from edgemoe.plan.problem import plan_problem

    load0, c0, w0 = os.getloadavg(), time.process_time(), time.perf_counter()
    calib_sizes = [int(x) for x in args.calib_tokens.split(",")]
    eval_sizes = [int(x) for x in args.eval_tokens.split(",")]
    cfg = ExperimentConfig(shared_data=str(REPO.parent / "shared" / "data"), cache_dir=str(REPO / "runs" / "cache"),
                           eval_tokens=min(eval_sizes), calib_quality_tokens=min(calib_sizes), model=args.model)
    adapter, tokenizer = load_moe(args.model), load_tokenizer(args.model)
    eval_spec, calib_spec = default_specs(cfg)
    profile = cached_profile(adapter, tokenizer, calib_spec, cfg, print)
    text = load_eval_text(adapter, tokenizer, cfg, eval_spec, calib_spec, print)
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster), "ordermoe", budget=ORDERMOE_BUDGET)
    ctx, _, _, eval_users, _ = scoring_setting(profile, cluster, placement, adapter, text, cfg)
    params = {"horizon": 2, "stand_in_choice": "token", "calibration": model_calibration(args.model)}
    rng = np.random.default_rng(0)

    texts = {"calib": tokenize_blocks(resolve(calib_spec), tokenizer, cfg.block_len,
                                      max_tokens_per_source=max(calib_sizes)).ids[:max(calib_sizes) // cfg.block_len],
             "calib-mixed": mixed_blocks(tokenizer, calib_spec, min(calib_sizes), cfg.block_len)[0],
             "eval": load_eval_text(adapter, tokenizer, replace(cfg, eval_tokens=max(eval_sizes)), eval_spec, None,
                                    print).ids}
    runs, curves = {}, {}
    for name, ids in texts.items():
        t0 = time.perf_counter()
        nll_exact = token_scores(adapter, ids)[0]
        users = np.arange(len(ids)) % ctx.num_users  # as the studies deal rows to users: block b to user b mod U
        rows = [measure(adapter, ctx, params, ids, nll_exact, users, b) for b in GRID]
        runs[name] = {"tokens": int(ids.size), "blocks": len(ids), "exact_ppl": float(np.exp(nll_exact.mean())),
                      "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
        sizes = {"calib": calib_sizes, "eval": eval_sizes}.get(name, [int(ids.size)])
        for n in sizes:  # the first n tokens of the text: the curve a run on n tokens would measure
            curves[f"{name}-{n}"] = curve_of(rows, n // cfg.block_len, rng)
            print(f"{name}-{n}: " + ", ".join(f"{r['budget']} {100 * r['ppl_rel_increase']:+.2f}% "
                                               f"[{100 * r['boot90'][0]:+.2f},{100 * r['boot90'][1]:+.2f}]"
                                               for r in curves[f"{name}-{n}"]), flush=True)

    # where each calibration curve's dial puts the asked values, read on the evaluation text's curves
    landing = {}
    for cname, c in curves.items():
        if cname.startswith("eval"):
            continue
        rise = {r["budget"]: r["ppl_rel_increase"] for r in c}
        for fit in ("running-max", "isotonic"):
            got = calibrate_dial(lambda b, rise=rise: rise.get(b, 0.0), GRID, curve=fit).budget(np.array(DIAL_ASKED))
            for ename in (k for k in curves if k.startswith("eval")):
                ev_b = np.array([0.0, *(r["budget"] for r in curves[ename])])
                ev_r = np.array([0.0, *(r["ppl_rel_increase"] for r in curves[ename])])
                landing[f"{cname}/{fit} on {ename}"] = [
                    {"asked": a, "budget": float(b), "eval_rise_interpolated": float(np.interp(b, ev_b, ev_r)),
                     "ratio": float(np.interp(b, ev_b, ev_r) / a)} for a, b in zip(DIAL_ASKED, got, strict=True)]
    # the figures the diagnosis reads: each curve's noise where it crosses +1% (half the 90% interval's width at
    # the grid budget whose increase is nearest 1%), and each curve over the long evaluation text's, budget by budget
    ref = {r["budget"]: r["ppl_rel_increase"] for r in curves[f"eval-{max(eval_sizes)}"]}
    summary = {}
    for cname, c in curves.items():
        near = min(c, key=lambda r: abs(r["ppl_rel_increase"] - 0.01))
        summary[cname] = {"budget_nearest_1pct": near["budget"], "rise_there": near["ppl_rel_increase"],
                          "boot90_halfwidth_there": (near["boot90"][1] - near["boot90"][0]) / 2,
                          "over_long_eval": {r["budget"]: r["ppl_rel_increase"] / ref[r["budget"]] for r in c
                                             if r["budget"] >= 0.01}}
    doc = {"schema": "edgemoe.bench.dial_diagnosis/1", "environment": environment(), "model": args.model,
           "policy": "ordermoe-full", "params": {"horizon": 2, "stand_in_choice": "token", "calibration": "from-file"},
           "grid": GRID, "positions": POSITIONS, "bootstrap": BOOT, "runs": runs, "curves": curves,
           "landing_on_eval_curve": landing, "summary": summary,
           "load_average_start": list(load0), "load_average_end": list(os.getloadavg()),
           "cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1)}
    atomic_write_json(Path(args.out), doc)
    print(f"wrote {args.out} ({doc['wall_s']:.0f} s wall, {doc['cpu_s']:.0f} s CPU)")


if __name__ == "__main__":
    main()
