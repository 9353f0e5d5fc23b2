"""How substitutable are the experts? `default` (trained as an MoE) next to `default-upcycled` (upcycled).

Per model, on WikiText-2 test (never trained on): perplexity with exact execution and with one routed
slot changed at every token in every MoE layer:
  - top-1 (or top-2) expert replaced by its most router-similar expert (largest router-logit cosine
    `sim`, the paper's grouping), by its measured-best substitute (smallest `subst_err`), or per token by
    the expert whose output is closest (an oracle: the limit of any selector), gate kept;
  - the slot zeroed (gate 0, the other gate unchanged);
  - the slot dropped and the remaining gate renormalised.
Both substitute maps and the per-layer substitution errors come from a calibration profile on the shared
corpus' held-out split (`edgemoe profile`'s collector), never from the evaluation text.

Writes bench/results/upcycle.json (entries of models not in --models are kept) and prints a table:
    python -m bench.studies.upcycle [--tokens 40960] [--calib-tokens 16384] [--models default default-upcycled]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

from bench.common import environment
from edgemoe.data import shared_corpus, tokenize_blocks, wikitext_test
from edgemoe.io import atomic_write_json
from edgemoe.models import load_moe, load_tokenizer
from edgemoe.models.base import Intervention
from edgemoe.models.loader import resolve_model_path
from edgemoe.models.scoring import perplexity, token_nll
from edgemoe.models.upcycle import expert_spread
from edgemoe.profile.collect import collect_profile, profile_blocks_for

OUT = Path(__file__).resolve().parents[1] / "results" / "upcycle.json"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def substitute_maps(prof) -> dict[str, np.ndarray]:
    """[L, E] substitute of each expert: most router-similar, and smallest measured output error (never itself)."""
    E = prof.E
    eye = np.eye(E, dtype=bool)[None]
    sim = np.where(eye, -np.inf, prof.sim)
    err = np.where(eye, np.inf, prof.subst_err)
    return {"router_similar": sim.argmax(-1), "measured_best": err.argmin(-1)}


def substitution_error_stats(prof, maps: dict[str, np.ndarray]) -> dict:
    """Per layer: median over experts of the chosen substitute's measured error, and Spearman(sim, err)."""
    L, E = prof.L, prof.E
    off = ~np.eye(E, dtype=bool)
    rows = np.arange(E)
    out = {f"median_err_{name}": [round(float(np.median(prof.subst_err[layer, rows, m[layer]])), 4) for layer in range(L)]
           for name, m in maps.items()}
    out["median_err_all_pairs"] = [round(float(np.median(prof.subst_err[layer][off])), 4) for layer in range(L)]
    out["spearman_sim_vs_err"] = [round(float(spearmanr(prof.sim[layer][off], prof.subst_err[layer][off])[0]), 4)
                                  for layer in range(L)]
    return out


def replace_slot(slot: int, sub: np.ndarray):
    """Policy: at every token and layer, run sub[layer, expert] in place of the expert in `slot` (gate kept)."""
    table = torch.from_numpy(sub)

    def policy(call):
        experts = call.topk.clone()
        experts[:, slot] = table[call.layer][experts[:, slot]]
        return Intervention(experts)

    return policy


def drop_slot(slot: int):
    """Policy: drop `slot` everywhere; the adapter renormalises the remaining gate to the original total."""
    def policy(call):
        experts = call.topk.clone()
        experts[:, slot] = -1
        return Intervention(experts)

    return policy


def oracle_slot(adapter, slot: int):
    """Policy: per token, the expert whose output on this token's hidden state is closest to the one in `slot`.

    The limit any per-expert substitute map can reach (it knows every expert's output for every token).
    """
    def policy(call):
        T = call.hidden.shape[0]
        rows = torch.arange(T)
        outs = torch.stack([adapter.expert_output(call.layer, e, call.hidden) for e in range(adapter.num_experts)])
        own = call.topk[:, slot]
        dist = ((outs - outs[own, rows][None]) ** 2).sum(-1)  # [E, T]
        dist[own, rows] = float("inf")
        experts = call.topk.clone()
        experts[:, slot] = dist.argmin(0)
        return Intervention(experts)

    return policy


@contextmanager
def zeroed_slot(adapter, slot: int):
    """Within the block, slot `slot`'s gate is 0 at every MoE layer and the other gates stay as they are.

    A forward pre-hook on each Mixtral experts module, registered after the adapter's own (which does
    nothing without a policy), rewrites the `top_k_weights` argument.
    """
    def hook(module, args, kwargs):
        hidden, index, weights = args
        weights = weights.clone()
        weights[:, slot] = 0
        return (hidden, index, weights), kwargs

    handles = [b.experts.register_forward_pre_hook(hook, with_kwargs=True) for b in adapter.blocks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def measure(name: str, tokens: int, calib_tokens: int, subst_tokens: int) -> dict:
    adapter, tok = load_moe(name), load_tokenizer(name)
    if adapter.family != "mixtral":
        raise SystemExit(f"{name}: this benchmark edits Mixtral's experts call; got {adapter.family}")
    ids = tokenize_blocks([wikitext_test(SHARED)], tok, 256, max_tokens_per_source=tokens).ids
    calib = profile_blocks_for(shared_corpus(SHARED, "heldout"), tok, calib_tokens, 256)
    t0 = time.perf_counter()
    prof = collect_profile(adapter, calib, name, "shared:heldout", subst_tokens=subst_tokens, progress=False)
    maps = substitute_maps(prof)

    def ppl(policy=None) -> float:
        return perplexity(token_nll(adapter, ids, policy=policy))

    exact = ppl()
    rows = {}
    for slot, label in ((0, "top1"), (1, "top2")):
        for kind, m in maps.items():
            rows[f"{label}_{kind}"] = ppl(replace_slot(slot, m))
        rows[f"{label}_oracle"] = ppl(oracle_slot(adapter, slot))
        with zeroed_slot(adapter, slot):
            rows[f"{label}_zero"] = ppl()
        rows[f"{label}_renormalise"] = ppl(drop_slot(slot))
    recipe = json.loads((Path(resolve_model_path(name)) / "recipe.json").read_text())
    return {
        "model": name,
        "recipe_wikitext2_test_ppl": recipe["heldout_perplexity"]["wikitext2_test"],
        "eval_tokens": int(ids.size),
        "calibration_tokens": prof.num_tokens,
        "ppl_exact": round(exact, 3),
        "ppl": {k: round(v, 3) for k, v in rows.items()},
        "ppl_rel_increase": {k: round(v / exact - 1, 4) for k, v in rows.items()},
        "subst_err": substitution_error_stats(prof, maps),
        "expert_spread": [round(s, 4) for s in expert_spread(adapter.model)],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=40_960, help="WikiText-2 test tokens scored (from the start)")
    ap.add_argument("--calib-tokens", type=int, default=16_384, help="calibration tokens for the profile")
    ap.add_argument("--subst-tokens", type=int, default=1024, help="tokens per layer measuring subst_err")
    ap.add_argument("--models", nargs="+", default=["default", "default-upcycled"])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread wastes least waiting
    command = (f"python -m bench.studies.upcycle --tokens {args.tokens} --calib-tokens {args.calib_tokens} "
               f"--subst-tokens {args.subst_tokens} --models {' '.join(args.models)}")
    fresh = {m: {**measure(m, args.tokens, args.calib_tokens, args.subst_tokens), "command": command}
             for m in args.models}
    # Models measured by an earlier run (another --models) are kept, each with the command that measured it.
    old = json.loads(args.out.read_text())["models"] if args.out.is_file() else []
    results = [r for r in old if r["model"] not in fresh] + list(fresh.values())
    result = {
        "what": "expert substitutability: perplexity on WikiText-2 test when one routed slot is substituted, zeroed "
                "or dropped at every token and MoE layer; measured substitution error from a calibration profile",
        "command": "python -m bench.studies.upcycle (each model entry names the command that measured it)",
        "definitions": {
            "router_similar": "substitute = argmax over e' != e of the router-logit cosine sim[l, e, e']",
            "measured_best": "substitute = argmin over e' != e of subst_err[l, e, e'] (calibration hidden states)",
            "oracle": "per token, the expert e' != e whose output on that token is closest to e's (the limit)",
            "zero": "the slot's gate set to 0, the other gate unchanged",
            "renormalise": "the slot dropped, the other gate rescaled to the original gate total (1)",
            "median_err_*": "per MoE layer, median over experts of ||Y_sub - Y_e|| / ||Y_e|| for that substitute",
            "expert_spread": "per MoE layer, mean over experts of ||W_e - mean W|| / ||mean W||",
        },
        "models": results,
        "load_average": os.getloadavg(),
        "environment": {**environment(), "torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    atomic_write_json(args.out, result)
    kinds = list(results[0]["ppl"])
    print(f"{'variant':<26}" + "".join(f"{r['model']:>20}" for r in results))
    print(f"{'ppl exact':<26}" + "".join(f"{r['ppl_exact']:>20.2f}" for r in results))
    for k in kinds:
        print(f"{k:<26}" + "".join(f"{100 * r['ppl_rel_increase'][k]:>19.1f}%" for r in results))
    for k in results[0]["subst_err"]:
        print(f"{k:<26}" + "".join(f"{str(r['subst_err'][k]):>36}" for r in results))


if __name__ == "__main__":
    main()
