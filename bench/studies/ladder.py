"""The ladder of shipped models by expert distinctness, beside published figures for real MoE models.

Per model and MoE layer:
  - expert weight spread: mean over experts of ||W_e - mean W|| / ||mean W|| (routed experts);
  - output similarity between experts on calibration hidden states: the mean over expert pairs of the
    per-token cosine of their outputs, and of their linear CKA (centred, over the sampled tokens);
  - substitution error ||Y_sub - Y_e|| / ||Y_e|| (the profile's measured `subst_err`): median over experts for
    the most router-similar substitute (the paper's grouping) and over all pairs, and Spearman's rho between
    router cosine and error over all pairs;
and per model, on WikiText-2 test (never trained on), the relative perplexity increase of: the top-1
expert replaced by its router-similar substitute (gate kept), the 2nd expert dropped (gates renormalised
to the original total), the 1st expert dropped. Calibration is the shared corpus' held-out split.

Writes bench/results/ladder.json (entries of models not in --models are kept):
    python -m bench.studies.ladder [--models default-upcycled upcycled-diverged finegrained-shared default]
                                   [--tokens 32768] [--calib-tokens 8192] [--subst-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import environment
from bench.studies.upcycle import drop_slot, replace_slot, substitute_maps, substitution_error_stats
from edgemoe.data import shared_corpus, tokenize_blocks, wikitext_test
from edgemoe.io import atomic_write_json
from edgemoe.models import load_moe, load_tokenizer
from edgemoe.models.loader import resolve_model_path
from edgemoe.models.scoring import perplexity, token_nll
from edgemoe.models.upcycle import expert_spread
from edgemoe.profile.collect import collect_profile, profile_blocks_for

OUT = Path(__file__).resolve().parents[1] / "results" / "ladder.json"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
MODELS = ("default-upcycled", "upcycled-diverged", "finegrained-shared", "default")

# Published figures for real MoE models, each with its source; what each measures differs from ours (a
# benchmark score, not perplexity), so they are a scale to compare against, not the same quantity.
PUBLISHED = [
    {"model": "Mixtral-8x7B", "what": "experts pruned per layer 8 -> 6 (of 8), post-training, no fine-tuning",
     "figure": "average score over eight zero-shot tasks down 2.9 points", "source": "Lu et al. 2024, arXiv 2402.14800"},
    {"model": "Mixtral-8x7B", "what": "experts pruned per layer 8 -> 4",
     "figure": "average score down 7.1 points", "source": "Lu et al. 2024, arXiv 2402.14800"},
    {"model": "Qwen1.5-MoE-A2.7B", "what": "the 10 most-used experts blocked on a knowledge task",
     "figure": "43% of the task's MRR lost", "source": "arXiv 2505.24593"},
]


def layer_similarity(adapter, layer: int, hidden: torch.Tensor) -> dict[str, float]:
    """Similarity of layer `layer`'s experts' outputs Y_e [T, H] on its calibration inputs hidden [T, H].

    Mean over pairs e != f of the per-token cosine of Y_e and Y_f, and of linear CKA
    ||Yc_e^T Yc_f||_F^2 / (||Yc_e^T Yc_e||_F ||Yc_f^T Yc_f||_F) (Yc: centred over tokens), plus the mean
    over experts of the largest CKA with another expert.
    """
    E = adapter.num_experts
    outs = torch.stack([adapter.expert_output(layer, e, hidden).double() for e in range(E)])  # [E, T, H]
    unit = outs / outs.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    cos = torch.einsum("eth,fth->ef", unit, unit) / outs.shape[1]  # [E, E] mean per-token cosine
    cen = outs - outs.mean(1, keepdim=True)
    cross = torch.einsum("eti,ftj->efij", cen, cen)  # [E, E, H, H] Yc_e^T Yc_f
    fro2 = (cross ** 2).sum((-1, -2))  # [E, E]
    self_norm = fro2.diagonal().sqrt()
    cka = fro2 / (self_norm[:, None] * self_norm[None, :]).clamp_min(1e-30)
    off = ~torch.eye(E, dtype=torch.bool)
    cka_off = torch.where(off, cka, torch.tensor(-1.0, dtype=cka.dtype))
    return {"cosine_mean": round(float(cos[off].mean()), 4), "cka_mean": round(float(cka[off].mean()), 4),
            "cka_nearest": round(float(cka_off.max(1).values.mean()), 4)}


def calibration_hidden(adapter, blocks, tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """Per MoE layer, the experts' inputs [tokens, H] at a seeded sample of the calibration tokens."""
    B, S = blocks.ids.shape
    sample = torch.from_numpy(np.sort(np.random.default_rng(seed).choice(B * S, size=min(tokens, B * S), replace=False)))
    kept: list[list[torch.Tensor]] = [[] for _ in range(adapter.num_layers)]
    calls = [0] * adapter.num_layers

    def rec(call):
        flat = calls[call.layer] * S * 16  # this batch's first token index (batches of 16 blocks below)
        n = call.hidden.shape[0]
        mask = (sample >= flat) & (sample < flat + n)
        kept[call.layer].append(call.hidden[sample[mask] - flat].float())
        calls[call.layer] += 1

    with torch.no_grad(), adapter.record(rec):
        for i in range(0, B, 16):
            adapter.forward_logits(torch.from_numpy(blocks.ids[i:i + 16]))
    return [torch.cat(v) for v in kept]


def measure(name: str, tokens: int, calib_tokens: int, subst_tokens: int) -> dict:
    """All of the module docstring's measures for packaged model `name`."""
    t0, c0 = time.perf_counter(), time.process_time()
    adapter, tok = load_moe(name), load_tokenizer(name)
    ids = tokenize_blocks([wikitext_test(SHARED)], tok, 256, max_tokens_per_source=tokens).ids
    calib = profile_blocks_for(shared_corpus(SHARED, "heldout"), tok, calib_tokens, 256)
    prof = collect_profile(adapter, calib, name, "shared:heldout", subst_tokens=subst_tokens, progress=False)
    maps = substitute_maps(prof)
    hidden = calibration_hidden(adapter, calib, subst_tokens)
    similarity = [layer_similarity(adapter, layer, h) for layer, h in enumerate(hidden)]

    def ppl(policy=None) -> float:
        return perplexity(token_nll(adapter, ids, policy=policy))

    exact = ppl()
    rows = {"top1_router_similar": ppl(replace_slot(0, maps["router_similar"])),
            "drop_2nd": ppl(drop_slot(1)), "drop_1st": ppl(drop_slot(0))}
    recipe = json.loads((Path(resolve_model_path(name)) / "recipe.json").read_text())
    stats = substitution_error_stats(prof, maps)
    return {
        "model": name,
        "family": adapter.family,
        "experts": adapter.num_experts,
        "top_k": adapter.top_k,
        "checkpoint_mb": round((Path(resolve_model_path(name)) / "model.safetensors").stat().st_size / 1e6, 2),
        "recipe_wikitext2_test_ppl": recipe["heldout_perplexity"]["wikitext2_test"],
        "eval_tokens": int(ids.size),
        "calibration_tokens": prof.num_tokens,
        "similarity_tokens": int(hidden[0].shape[0]),
        "expert_spread": [round(s, 4) for s in expert_spread(adapter.model)],
        "output_similarity": {k: [s[k] for s in similarity] for k in similarity[0]},
        "subst_err": {k: v for k, v in stats.items() if k != "median_err_measured_best"},
        "ppl_exact": round(exact, 3),
        "ppl": {k: round(v, 3) for k, v in rows.items()},
        "ppl_rel_increase": {k: round(v / exact - 1, 4) for k, v in rows.items()},
        "wall_s": round(time.perf_counter() - t0, 1),
        "cpu_s": round(time.process_time() - c0, 1),
    }


# Section 5: where each model's equal-quality run lives (bench/studies/equal_quality.py writes them).
EQUAL_QUALITY = {"default-upcycled": "equal_quality.json", "upcycled-diverged": "equal_quality_ladder_diverged.json",
                 "finegrained-shared": "equal_quality_ladder_finegrained.json", "default": "equal_quality.json"}
CURVE = OUT.parent / "ladder_curve.json"
# issue 19 item 1: the full policy (`ordermoe-full`: per-token stand-ins priced in measured nats) on every ladder
# model, one file (bench.studies.equal_quality --methods ordermoe-full --reuse <the model's file>)
FULL_POLICY = "equal_quality_full.json"


def similarity_verdict(ratio: dict, best: dict) -> str:
    """One plain sentence from OrderMoE's latency over the best baseline's at equal perplexity per point
    (`ratio`, `best`: {"paper": .., "strict": ..}). Within 5% either way counts as level (these runs
    score 1,024-4,096 tokens: a few percent is within their noise)."""
    if any(ratio[pt] is None for pt in ratio):
        return "no baseline's sweep reaches OrderMoE's perplexity at one of the points: no verdict"
    nums = " and ".join(f"{ratio[pt]:.2f}x ({pt}, best {best[pt]})" for pt in ratio)
    faster = [pt for pt in ratio if ratio[pt] < 0.95]
    slower = [pt for pt in ratio if ratio[pt] > 1.05]
    if faster and not slower:
        verdict = f"similarity buys something here (faster than every baseline at {' and '.join(faster)})"
    elif slower and not faster:
        verdict = f"similarity buys nothing here: a baseline is faster at {' and '.join(slower)}" + (
            ", level at the other point" if len(slower) == 1 else "")
    elif faster:
        verdict = f"mixed: faster than every baseline at {faster[0]}, slower than the best at {slower[0]}"
    else:
        verdict = "similarity buys nothing measurable here: level with the best baseline at both points"
    return f"OrderMoE runs at {nums} of the best baseline's mean latency at equal perplexity: {verdict}."


def full_policy_row(name: str) -> dict | None:
    """The full policy's ratios on model `name` from FULL_POLICY (None where that file has no such model)."""
    path = OUT.parent / FULL_POLICY
    doc = json.loads(path.read_text()) if path.is_file() else {}
    entry = next((m for m in doc.get("models", []) if m["model"] == name and "equal_quality_full" in m), None)
    if entry is None:
        return None
    eq = entry["equal_quality_full"]
    ratio = {pt: eq[pt]["ratio_to_best"] for pt in ("paper", "strict")}
    best = {pt: eq[pt]["best_baseline"] for pt in ratio}
    return {"method": "ordermoe-full", "results_file": f"bench/results/{FULL_POLICY}", "eval_tokens": entry["eval_tokens"],
            "calib_tokens": entry["calib_tokens"], "ratio_to_best": ratio, "best_baseline": best,
            "ratio_to_best_field": {pt: eq[pt]["ratio_to_best_field"] for pt in ratio},
            "ordermoe_ppl_rel_increase": {pt: eq[pt]["ordermoe_ppl_rel_increase"] for pt in ratio},
            "verdict": similarity_verdict(ratio, best).replace("OrderMoE runs", "The full policy runs", 1)
                                                      .replace("similarity buys", "its per-token choice buys", 1)}


def curve() -> dict:
    """OrderMoE / best baseline at equal perplexity per ladder model (from the equal-quality files) beside its
    output CKA (ladder.json) -> ladder_curve.json and ladder_curve.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lad = {m["model"]: m for m in json.loads(OUT.read_text())["models"]}
    rows = []
    for name in MODELS:
        path = OUT.parent / EQUAL_QUALITY[name]
        doc = json.loads(path.read_text()) if path.is_file() else None
        entry = next((m for m in (doc or {}).get("models", []) if m["model"] == name), None)
        if entry is None or name not in lad:
            continue
        eq = entry["equal_quality"]
        ratio = {pt: eq[pt]["ratio_to_best"] for pt in ("paper", "strict")}
        rows.append({"model": name, "results_file": f"bench/results/{EQUAL_QUALITY[name]}",
                     "eval_tokens": entry["eval_tokens"], "calib_tokens": entry["calib_tokens"],
                     "output_cka_mean": float(np.mean(lad[name]["output_similarity"]["cka_mean"])),
                     "ratio_to_best": ratio, "best_baseline": {pt: eq[pt]["best_baseline"] for pt in ratio},
                     # against the field's own answers only (skip, reroute, random-local: no OrderMoE machinery)
                     "ratio_to_best_field": {pt: eq[pt]["ratio_to_best_field"] for pt in ratio},
                     "ordermoe_ppl_rel_increase": {pt: eq[pt]["ordermoe_ppl_rel_increase"] for pt in ratio},
                     "verdict": similarity_verdict(ratio, {pt: eq[pt]["best_baseline"] for pt in ratio}),
                     "full_policy": full_policy_row(name)})
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for pt, mark in (("paper", "o-"), ("strict", "s--")):
        pts = [(r["output_cka_mean"], r["ratio_to_best"][pt]) for r in rows if r["ratio_to_best"][pt] is not None]
        if pts:
            ax.plot(*zip(*sorted(pts), strict=True), mark, label=f"{pt} point")
        full = [(r["output_cka_mean"], r["full_policy"]["ratio_to_best"][pt]) for r in rows
                if r.get("full_policy") and r["full_policy"]["ratio_to_best"][pt] is not None]
        if full:
            ax.plot(*zip(*sorted(full), strict=True), mark, alpha=0.5, label=f"{pt} point, ordermoe-full")
    for r in rows:
        ax.annotate(r["model"], (r["output_cka_mean"], r["ratio_to_best"]["paper"] or 1.0), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("mean pairwise output CKA of experts (ladder.json)")
    ax.set_ylabel("OrderMoE / best baseline, mean latency")
    ax.set_title("OrderMoE at equal perplexity, by expert distinctness")
    ax.legend(fontsize=8)
    fig.tight_layout()
    from edgemoe.io import atomic_write_with

    atomic_write_with(OUT.parent / "ladder_curve.png", lambda f: fig.savefig(f, format="png", dpi=120))
    doc = {"what": "OrderMoE's mean latency over the best baseline's at equal perplexity (issue 19 section 5), "
                   "per ladder model, beside its experts' output CKA; ratios copied from each model's equal-quality file",
           "models": rows, "environment": environment()}
    atomic_write_json(CURVE, doc)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32_768, help="WikiText-2 test tokens scored (from the start)")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens for the profile")
    ap.add_argument("--subst-tokens", type=int, default=512, help="tokens per layer for subst_err and similarity")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--curve", action="store_true", help="only section 5: ladder_curve.json/.png from the results files")
    args = ap.parse_args()
    if args.curve:
        for r in curve()["models"]:
            print(f"{r['model']:<20} paper {r['ratio_to_best']['paper']} strict {r['ratio_to_best']['strict']}: {r['verdict']}")
        return
    torch.set_num_threads(1)  # a shared 2-core machine: one thread wastes least waiting
    command = (f"python -m bench.studies.ladder --tokens {args.tokens} --calib-tokens {args.calib_tokens} "
               f"--subst-tokens {args.subst_tokens} --models {' '.join(args.models)}")
    fresh = {}
    for m in args.models:
        fresh[m] = {**measure(m, args.tokens, args.calib_tokens, args.subst_tokens), "command": command,
                    "load_average": os.getloadavg()}
    old = json.loads(args.out.read_text())["models"] if args.out.is_file() else []
    results = [r for r in old if r["model"] not in fresh] + list(fresh.values())
    results.sort(key=lambda r: MODELS.index(r["model"]) if r["model"] in MODELS else len(MODELS))
    result = {
        "what": "the shipped models by expert distinctness: weight spread, output similarity, substitution error "
                "and the perplexity cost of substituting or dropping a routed expert at every token and MoE layer",
        "command": "python -m bench.studies.ladder (each model entry names the command that measured it)",
        "definitions": {
            "expert_spread": "per MoE layer, mean over routed experts of ||W_e - mean W|| / ||mean W||",
            "output_similarity.cosine_mean": "per layer, mean over pairs e != f of the mean per-token cosine of "
                                             "Y_e and Y_f (expert outputs on calibration hidden states)",
            "output_similarity.cka_mean": "per layer, mean over pairs e != f of linear CKA(Y_e, Y_f)",
            "output_similarity.cka_nearest": "per layer, mean over experts of the largest CKA with another expert",
            "subst_err.median_err_router_similar": "per layer, median over experts e of ||Y_s - Y_e|| / ||Y_e||, "
                                                   "s = e's most router-similar expert",
            "subst_err.median_err_all_pairs": "per layer, median over all pairs",
            "subst_err.spearman_sim_vs_err": "per layer, Spearman's rho of router cosine vs error over all pairs "
                                             "(negative: router-similar experts substitute better)",
            "top1_router_similar": "top-1 expert replaced by its router-similar substitute, gate kept",
            "drop_2nd": "2nd routed expert dropped, the others' gates renormalised to the original total",
            "drop_1st": "1st routed expert dropped, likewise",
        },
        "published": PUBLISHED,
        # the runs that measured the entries (possibly several, each entry says which): their CPU and wall s summed
        "wall_s": round(sum(r["wall_s"] for r in results), 1),
        "models": results,
        "environment": environment(torch=torch.__version__, threads=torch.get_num_threads(),
                                   cpu_s=round(sum(r["cpu_s"] for r in results), 1)),
    }
    atomic_write_json(args.out, result)
    for r in results:
        inc = r["ppl_rel_increase"]
        print(f"{r['model']:<20} spread {np.mean(r['expert_spread']):.3f} cka {np.mean(r['output_similarity']['cka_mean']):.3f} "
              f"err sim/all {np.mean(r['subst_err']['median_err_router_similar']):.3f}/"
              f"{np.mean(r['subst_err']['median_err_all_pairs']):.3f} rho {np.mean(r['subst_err']['spearman_sim_vs_err']):.2f} "
              f"ppl {100 * inc['top1_router_similar']:+.1f}% / {100 * inc['drop_2nd']:+.1f}% / {100 * inc['drop_1st']:+.1f}%")


if __name__ == "__main__":
    main()
