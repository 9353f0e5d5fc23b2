"""OrderMoE's predicted quality cost against measured perplexity, calibrated per stand-in kind and layer, and
the quality dial on the calibrated costs (issue 19, sections 2 and 3).

    python -m bench.studies.calibration [--eval-tokens 2048] [--calib-tokens 2048] [--models default,default-upcycled]

Per model, with equal_quality's settings (edge8, migrate mode, WikiText-2 test as evaluation text, the shared
corpus' held-out split as calibration text, one ordermoe placement at ORDERMOE_BUDGET):
1. interventions (`edgemoe.eval.calibration`): each stand-in kind alone at one layer, on one slot of every
   token, and each layer's MoE output lost; measured on calibration text, where the `KindCalibration` is
   fitted, and again on evaluation text, where the fit is judged: predicted vs measured nats per run and
   their Spearman, uncalibrated (the profile's P ** 2) and calibrated (nats), overall and per kind, and per
   (layer, slot) whether the kind predicted cheapest is the kind measured cheapest;
2. the policies over a budget sweep on evaluation text, `ordermoe` (budget in the profile's units) and
   `ordermoe` with `calibration=` (budget in nats per token-layer), all kinds and each kind alone: mean
   latency (simulator), measured perplexity increase, predicted increase (calibrated: expm1 of the nats
   spent per token; uncalibrated: the spent cost times the nats per unit of the full policy's calibration
   run), their Spearman, and the slots substituted / dropped / zeroed;
3. the dial (`edgemoe.eval.dial`) of both, calibrated on calibration text, asked 1%, 3%, 7.8%, 15% and
   measured on evaluation text.
Writes bench/results/calibration.json (commit, load, CPU s, token counts) and prints the tables.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np

from bench.common import RESULTS, merge_results
from bench.studies.equal_quality import scoring_setting
from edgemoe.eval.dial import calibrate_dial
from edgemoe.eval.experiment import (
    ORDERMOE_BUDGET,
    ExperimentConfig,
    cached_profile,
    default_specs,
    load_eval_text,
)
from edgemoe.io import atomic_write_json
from edgemoe.results import environment

REPO = Path(__file__).resolve().parents[2]
MODELS = ("default", "default-upcycled", "upcycled-diverged", "finegrained-shared")  # the ladder (docs/models.md)
SWEEP = (0.05, 0.2, 0.5)  # ordermoe's budgets per token-layer (the profile's units, as equal_quality)
NATS_SWEEP = (0.005, 0.01, 0.02)  # calibrated budgets: nats per token-layer
KIND_SWEEP = {"ordermoe": (), "calibrated": (0.01,)}  # each kind alone at these budgets
DIAL_ASKED = (0.01, 0.03, 0.078, 0.15)
NATS_GRID = (0.002, 0.005, 0.01, 0.02, 0.05)
DIAL_GRID = {"ordermoe": (0.05, 0.1, 0.15, 0.2, 0.5), "calibrated": NATS_GRID, "calibrated-empty": NATS_GRID}
HORIZON = 2


def spearman(x, y) -> float | None:
    from scipy.stats import spearmanr

    if len(x) < 3:
        return None
    rho = spearmanr(x, y).statistic
    return float(rho) if np.isfinite(rho) else None


def judge_interventions(runs_eval, calib) -> dict:
    """Predicted vs measured nats of the evaluation-text interventions, uncalibrated and calibrated."""
    from edgemoe.eval.calibration import predicted_nats

    meas = np.array([r.nats for r in runs_eval])
    raw, cal = predicted_nats(runs_eval, None), predicted_nats(runs_eval, calib)
    out = {"all": {"runs": len(runs_eval), "spearman_uncalibrated": spearman(raw, meas),
                   "spearman_calibrated": spearman(cal, meas)}}
    for kind in ("sub", "drop", "zero", "empty"):
        idx = [i for i, r in enumerate(runs_eval) if r.kind == kind]
        out[kind] = {"runs": len(idx), "spearman_uncalibrated": spearman(raw[idx], meas[idx]),
                     "spearman_calibrated": spearman(cal[idx], meas[idx]),
                     "measured_nats": meas[idx].tolist(), "predicted_nats_calibrated": cal[idx].tolist(),
                     "predicted_uncalibrated": raw[idx].tolist()}
    # per (layer, slot): the kind predicted cheapest vs the kind measured cheapest (sub: its best substitute)
    choice = []
    for layer in sorted({r.layer for r in runs_eval}):
        for slot in sorted({r.slot for r in runs_eval if r.slot >= 0}):
            cand = [i for i, r in enumerate(runs_eval) if r.layer == layer and r.slot == slot
                    and r.variant in ("zero", "drop", "sub-best")]
            kinds = [runs_eval[i].kind for i in cand]
            best = kinds[int(np.argmin(meas[cand]))]
            choice.append({"layer": layer, "slot": slot, "measured_best": best,
                           "uncalibrated_pick": kinds[int(np.argmin(raw[cand]))],
                           "calibrated_pick": kinds[int(np.argmin(cal[cand]))],
                           "measured_nats": dict(zip(kinds, meas[cand].tolist(), strict=True))})
    out["choice"] = choice
    out["choice_agreement_uncalibrated"] = float(np.mean([c["uncalibrated_pick"] == c["measured_best"] for c in choice]))
    out["choice_agreement_calibrated"] = float(np.mean([c["calibrated_pick"] == c["measured_best"] for c in choice]))
    return out


def run_model(model: str, cfg: ExperimentConfig, log, save=None, intervention_tokens: int = 1024) -> dict:
    """One model's three parts; `save(part)` is called after each with what is measured so far (a run
    stopped half-way keeps its finished parts, marked by `parts_done`)."""
    from edgemoe.cluster.load import load_cluster
    from edgemoe.eval.calibration import fit_calibration, measure_interventions
    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.models.scoring import quality_metrics
    from edgemoe.plan import plan
    from edgemoe.plan.problem import plan_problem
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.local import score_local
    from edgemoe.runtime.sim.simulate import simulate

    t_model = time.perf_counter()
    adapter, tokenizer = load_moe(model), load_tokenizer(model)
    eval_spec, calib_spec = default_specs(cfg)
    profile = cached_profile(adapter, tokenizer, calib_spec, cfg, log)
    text = load_eval_text(adapter, tokenizer, cfg, eval_spec, calib_spec, log)
    # 1. interventions: fit on calibration text, judge on evaluation text
    t0 = time.perf_counter()
    log(f"{model}: interventions on calibration text")
    n_blocks = max(1, intervention_tokens // cfg.block_len)  # the interventions use the texts' first blocks
    runs_cal = measure_interventions(adapter, profile.subst_err, text.calib_ids[:n_blocks], text.calib_nll[:n_blocks], log=log)
    calib_empty = fit_calibration(runs_cal, adapter.num_layers)
    calib = replace(calib_empty, empty=None)  # the main variant: a layer always keeps some expert output
    log(f"{model}: interventions on evaluation text")
    runs_eval = measure_interventions(adapter, profile.subst_err, text.ids[:n_blocks], text.nll[:n_blocks], log=log)
    judged = judge_interventions(runs_eval, calib_empty)
    log(f"  Spearman predicted vs measured on evaluation text: uncalibrated {judged['all']['spearman_uncalibrated']}, "
        f"calibrated {judged['all']['spearman_calibrated']}; cheapest kind agreement "
        f"{judged['choice_agreement_uncalibrated']:.2f} -> {judged['choice_agreement_calibrated']:.2f}")
    interventions_s = time.perf_counter() - t0
    out = {"model": model, "eval_tokens": int(text.ids.size), "calib_tokens": int(text.calib_ids.size),
           "intervention_tokens": int(text.ids[:n_blocks].size),
           "calibration": calib_empty.to_dict(), "interventions_calibration_text": [r.to_dict() for r in runs_cal],
           "interventions_evaluation_text": [r.to_dict() for r in runs_eval], "interventions_judged": judged,
           "seconds": {"interventions": round(interventions_s, 1)}, "parts_done": ["interventions"]}
    if save:
        save(out)
    # 2. the policies
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster), "ordermoe", budget=ORDERMOE_BUDGET)
    ctx, workload, trace, eval_users, calib_users = scoring_setting(profile, cluster, placement, adapter, text, cfg)
    variants = {"ordermoe": {"horizon": HORIZON},
                "calibrated": {"horizon": HORIZON, "calibration": calib.to_dict()},
                "calibrated-empty": {"horizon": HORIZON, "calibration": calib_empty.to_dict()}}

    def evaluate(variant: str, budget: float, substitutes: str = "sub,drop,zero", latency: bool = True) -> dict:
        params = dict(variants[variant], substitutes=substitutes, budget=budget)
        nll, top1, dec = score_local(adapter, make_policy("ordermoe", ctx, **params), text.ids, eval_users)
        q = quality_metrics(nll, top1, text.nll, text.top1)
        sim = simulate(ctx, make_policy("ordermoe", ctx, **params), trace, workload) if latency else None
        sub = dec.substituted()
        return {"budget": budget, "substitutes": substitutes, "latency_ms_mean": sim.latency_ms["mean"] if sim else None,
                "ppl_rel_increase": q["ppl_rel_increase"], "extra_nats_per_token": q["extra_nats_per_token"],
                "slots_substituted": float(sub.mean()), "slots_dropped": float(((dec.experts < 0) & ~dec.zeroed).mean()),
                "slots_zeroed": float(dec.zeroed.mean()),
                "layers_without_output": float(((dec.experts < 0) & dec.zeroed).all(axis=2).mean()),
                "spent_per_token": float(dec.quality_cost.sum(axis=1).mean())}

    def calib_rise(variant: str, budget: float, substitutes: str = "sub,drop,zero") -> tuple[float, float]:
        """(relative increase on calibration text, spent per token)."""
        params = dict(variants[variant], substitutes=substitutes, budget=budget)
        nll, _, dec = score_local(adapter, make_policy("ordermoe", ctx, **params), text.calib_ids, calib_users)
        return float(np.expm1(nll.mean() - text.calib_nll.mean())), float(dec.quality_cost.sum(axis=1).mean())

    # 3. the dials
    t0 = time.perf_counter()
    dials = {}
    for variant in DIAL_GRID:
        dial = calibrate_dial(lambda b, v=variant: calib_rise(v, b)[0], DIAL_GRID[variant], policy=variant,
                              calib_tokens=int(text.calib_ids.size))
        rows = []
        for asked in DIAL_ASKED:
            b = float(dial.budget(asked))
            r = evaluate(variant, b, latency=False)  # (the dial's target is quality; latency: the sweeps)
            rows.append({"asked": asked, "budget": b, "measured": r["ppl_rel_increase"], "ratio": r["ppl_rel_increase"] / asked,
                         "latency_ms_mean": r["latency_ms_mean"], "layers_without_output": r["layers_without_output"],
                         "in_target": bool(0.5 <= r["ppl_rel_increase"] / asked <= 1.2)})
            log(f"  dial {variant:<10} asked {100 * asked:4.1f}% -> budget {b:.4g} -> measured "
                f"{100 * r['ppl_rel_increase']:+.2f}%")
        dials[variant] = {**dial.to_dict(), "asked_vs_measured": rows,
                          "measured_monotone": bool(all(b["measured"] >= a["measured"] - 1e-4 for a, b in pairwise(rows))),
                          "calib_max_rise": float(dial.envelope[-1])}
        out["dials"] = dials
        if save:
            save(out)
    out["seconds"]["dials"] = round(time.perf_counter() - t0, 1)
    out["parts_done"].append("dials")
    t0 = time.perf_counter()
    # the uncalibrated cost's nats per unit, from the full policy at the demo's budget on calibration text
    rise, spent = calib_rise("ordermoe", ORDERMOE_BUDGET)
    nats_per_unit = float(np.log1p(rise) / spent) if rise > 0 and spent > 0 else None
    exact = {"latency_ms_mean": simulate(ctx, make_policy("exact", ctx), trace, workload).latency_ms["mean"]}
    sweeps: dict = {}
    for variant, budgets in (("ordermoe", SWEEP), ("calibrated", NATS_SWEEP)):
        rows = [evaluate(variant, b) for b in budgets]
        for kind in ("sub", "drop", "zero"):
            rows += [evaluate(variant, b, kind) for b in KIND_SWEEP[variant]]
        for r in rows:
            unit = 1.0 if variant == "calibrated" else nats_per_unit
            r["predicted_ppl_rel_increase"] = None if unit is None else float(np.expm1(unit * r["spent_per_token"]))
            log(f"  {variant:<10} {r['substitutes']:<12} b={r['budget']:<6g} {r['latency_ms_mean']} ms "
                f"measured {100 * r['ppl_rel_increase']:+6.2f}% predicted {r['predicted_ppl_rel_increase']} "
                f"sub/drop/zero {r['slots_substituted']:.3f}/{r['slots_dropped']:.3f}/{r['slots_zeroed']:.3f}")
        full = [r for r in rows if r["substitutes"] == "sub,drop,zero"]
        # the spent cost's rank is the predicted increase's (expm1 of a positive multiple is increasing)
        sweeps[variant] = {"rows": rows, "spearman_full": spearman([r["spent_per_token"] for r in full],
                                                                   [r["ppl_rel_increase"] for r in full]),
                           "spearman_all_rows": spearman([r["spent_per_token"] for r in rows],
                                                         [r["ppl_rel_increase"] for r in rows])}
        out["sweeps"], out["nats_per_unit_uncalibrated"], out["exact"] = sweeps, nats_per_unit, exact
        if save:
            save(out)
    out["seconds"]["sweeps"] = round(time.perf_counter() - t0, 1)
    out["seconds"]["total"] = round(time.perf_counter() - t_model, 1)
    out["parts_done"].append("sweeps")
    if save:
        save(out)
    return out


def print_tables(models: list[dict]) -> None:
    print("\nmodel | interventions on evaluation text: Spearman uncalibrated -> calibrated | cheapest-kind agreement")
    for m in models:
        j = m["interventions_judged"]
        per = "; ".join(f"{k} {j[k]['spearman_uncalibrated']} -> {j[k]['spearman_calibrated']}" for k in ("sub", "drop", "zero"))
        print(f"{m['model']} | all {j['all']['spearman_uncalibrated']} -> {j['all']['spearman_calibrated']} ({per}) | "
              f"{j['choice_agreement_uncalibrated']:.2f} -> {j['choice_agreement_calibrated']:.2f}")
    print("\nmodel | variant | Spearman predicted vs measured (full policy / all rows)")
    for m in models:
        for v, s in m["sweeps"].items():
            print(f"{m['model']} | {v} | {s['spearman_full']} / {s['spearman_all_rows']}")
    print("\nmodel | dial | 1% | 3% | 7.8% | 15% (measured / asked) | monotone")
    for m in models:
        for v, d in m["dials"].items():
            print(f"{m['model']} | {v} | " + " | ".join(f"{r['ratio']:.2f}" for r in d["asked_vs_measured"])
                  + f" | {d['measured_monotone']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--intervention-tokens", type=int, default=1024, help="the interventions' share of each text")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--cache-dir", default=str(REPO / "runs" / "cache"))
    ap.add_argument("--out", default=str(RESULTS / "calibration.json"))
    ap.add_argument("--merge", nargs="+", help="join these results files' models into --out (runs made apart)")
    args = ap.parse_args()
    if args.merge:
        doc = merge_results(args.merge, environment_cpu="environment")
        atomic_write_json(Path(args.out), doc)
        print_tables(doc["models"])
        return
    cfg = ExperimentConfig(shared_data=str(REPO.parent / "shared" / "data"), cache_dir=args.cache_dir,
                           eval_tokens=args.eval_tokens, calib_quality_tokens=args.calib_tokens)
    load0, c0, w0 = os.getloadavg(), time.process_time(), time.perf_counter()
    models: list[dict] = []

    def document(current: dict | None = None) -> dict:
        return {"schema": "edgemoe.bench.calibration/1", "environment": environment(),
                "load_average_start": list(load0), "load_average_end": list(os.getloadavg()),
                "cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1),
                "config": config, "models": models + ([current] if current else [])}

    config = {"cluster": "edge8", "mode": "migrate", "placement": "ordermoe", "placement_budget": ORDERMOE_BUDGET,
              "horizon": HORIZON, "eval_tokens": args.eval_tokens, "calib_tokens": args.calib_tokens,
              "intervention_tokens": args.intervention_tokens, "sweep": SWEEP, "nats_sweep": NATS_SWEEP,
              "kind_sweep": KIND_SWEEP, "dial_grid": DIAL_GRID, "dial_asked": DIAL_ASKED, "num_requests": cfg.num_requests}
    for model in args.models.split(","):
        models.append(run_model(model, replace(cfg, model=model), print,
                                lambda part: atomic_write_json(Path(args.out), document(part)), args.intervention_tokens))
    doc = {**document(), "config": config,
           "models": models}
    atomic_write_json(Path(args.out), doc)
    print_tables(models)
    print(f"\nwrote {args.out} ({doc['wall_s']:.0f} s wall, {doc['cpu_s']:.0f} s CPU, load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
