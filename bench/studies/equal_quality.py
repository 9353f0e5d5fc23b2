"""OrderMoE against the field's baselines at equal perplexity, and the quality dial (issue 19).

    python -m bench.studies.equal_quality [--eval-tokens 4096] [--calib-tokens 2048] [--models default-upcycled,default] [--quick]

Per model (the shipped `default-upcycled` and `default`), with the demo's settings (edge8, migrate mode,
WikiText-2 test as evaluation text, the shared corpus' held-out split as calibration text, the demo's
simulated workload and dense cost):
- one `ordermoe` placement planned at the demo's default OrderMoE budget (ORDERMOE_BUDGET), shared by every
  method, so the rows differ only in the runtime policy;
- per method (ordermoe H=2 on router-cosine groups, ordermoe-error-groups H=2, skip, reroute, random-local):
  the `paper` and `strict` operating points calibrated on calibration text exactly as the demo calibrates
  OrderMoE's (`calibrate_budget`: the largest budget whose one-sided 95% upper bound fits the target), then a
  budget sweep on evaluation text: mean/p99 latency from the simulator, perplexity increase and the shares of
  slots substituted / dropped / zeroed from the real model (`local` backend);
- equal quality: at the perplexity increase OrderMoE measures at its `paper` and `strict` points, each
  baseline's mean latency interpolated on its sweep (`latency_at_quality`, lower envelope), and OrderMoE's
  latency over the best of them;
- section 2: each stand-in kind's measured nats per unit of predicted cost on calibration text
  (`kind_scales`), `ordermoe-calibrated` (kinds priced on that one scale) swept and compared like OrderMoE,
  and predicted vs measured increase over OrderMoE's sweeps with their rank correlation;
- `ordermoe-token`: OrderMoE with each stand-in chosen per token among every local expert (`stand_in_choice=
  "token"`), compared like OrderMoE (`equal_quality_token`); a per-token policy is simulated with the
  evaluation text's router logits (`simulated_policy`), so that its latency and its perplexity come from the
  same decisions;
- the dial: the dial method's calibration curve on its own calibration text (`edgemoe.eval.dial`; the first
  DIAL_CALIB_TOKENS of the calibration text, isotonic), asked 1%, 3%, 7.8% and 15% mapped to budgets and
  measured on evaluation text and on its first DIAL_EVAL_TOKENS, with block bootstrap intervals.
Writes bench/results/equal_quality.json (commit, load, CPU s, token counts) and prints the table.
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
from edgemoe.eval.dial import calibrate_dial, handoff, rise_interval
from edgemoe.eval.experiment import (
    OPERATING_POINTS,
    ORDERMOE_BUDGET,
    EvalText,
    ExperimentConfig,
    cached_profile,
    calibrate_budget,
    default_specs,
    eval_trace,
    latency_at_quality,
    load_eval_text,
    rise_with_bound,
)
from edgemoe.io import atomic_write_json
from edgemoe.results import environment
from edgemoe.runtime.policies.field_baselines import kind_scales

PART_KEYS = ("environment", "load_average_start", "load_average_end", "cpu_s", "wall_s", "config")  # `--merge`'s record of each part

REPO = Path(__file__).resolve().parents[2]
MODELS = ("default-upcycled", "default")
# (name, policy, fixed params, sweep budgets on evaluation text besides 0 and the calibrated points)
ORDERMOE_SWEEP = (0.05, 0.2, 0.5)  # per token-layer, OrderMoE's unit (gate-weighted measured error, squared)
GATE_SWEEP = (0.5, 1.0, 2.0)  # per token-layer, the baselines' unit (gate share of the replaced slots)
NATS_SWEEP = (0.005, 0.02, 0.05, 0.2)  # per token-layer, a calibrated OrderMoE's unit (measured extra nats)
NATS_LO = 1e-4  # the operating points' bisection starts here in nats (1e-3 nats per token-layer is already ~+1%)
METHODS = (
    ("ordermoe", "ordermoe", {"horizon": 2}, ORDERMOE_SWEEP),
    ("ordermoe-error-groups", "ordermoe-error-groups", {"horizon": 2}, ORDERMOE_SWEEP),
    ("skip", "skip", {}, GATE_SWEEP),
    ("reroute", "reroute", {}, GATE_SWEEP),
    ("random-local", "random-local", {"seed": 0}, GATE_SWEEP),
    # section 2: OrderMoE with its stand-in chosen per token among every local expert (`token_substitutes`)
    ("ordermoe-token", "ordermoe", {"horizon": 2, "stand_in_choice": "token"}, ORDERMOE_SWEEP),
    # issue 19 item 1: per-token stand-ins (every local expert, scored by measured error and the token's router
    # logits; drop; zero) priced in measured nats per kind and layer (the model's KindCalibration, fitted on
    # calibration text by bench.studies.calibration; layers never left without expert output); budget in nats
    ("ordermoe-full", "ordermoe", {"horizon": 2, "stand_in_choice": "token", "calibration": "from-file"},
     NATS_SWEEP),
    # the same myopic and unsteered (H = 0): what the look-ahead's steering adds to the per-token policy
    ("ordermoe-full-h0", "ordermoe", {"horizon": 0, "stand_in_choice": "token", "calibration": "from-file"},
     NATS_SWEEP),
)
CALIBRATION_FILE = RESULTS / "calibration.json"  # where "from-file" takes each model's KindCalibration
CALIBRATION_PRICES = ("point", "upper-bound")
# "from-file" prices each stand-in kind and layer at the one-sided 95% upper bound of its measured rise on
# calibration text, not its mean: the interventions are measured on 1024 tokens, and a kind whose mean is cheap
# by noise (default's zeroed slot at layer 1: +0.006 +- 0.011 nats, calibration.json) was bought everywhere and
# lost the strict point (diagnosed on calibration text; docs/runtime.md, "The full policy")
FULL_CALIBRATION = "upper-bound"
VARIANTS = {"ordermoe": "equal_quality", "ordermoe-calibrated": "equal_quality_calibrated",
            "ordermoe-token": "equal_quality_token", "ordermoe-full": "equal_quality_full",
            "ordermoe-full-h0": "equal_quality_full_h0"}  # OrderMoE variants compared
BASELINES = ("ordermoe-error-groups", "skip", "reroute", "random-local")  # what "the best baseline" is chosen from
FIELD = ("skip", "reroute", "random-local")  # the field's own answers (not OrderMoE's machinery)
DIAL_ASKED = (0.01, 0.03, 0.078, 0.15)
DIAL_GRID = (0.01, 0.02, 0.05, 0.08, 0.12, 0.16, 0.2, 0.3, 0.5, 1.0)  # the dial's budgets (OrderMoE's unit)
# the same for a calibrated method (nats per token-layer): dense where a per-token policy's curve turns steep
# (0.3-1 nats), so that linear interpolation inside a step does not cross a knee; 2 is the operating points' top
NATS_DIAL_GRID = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 2.0)
# the dial's calibration text: the first DIAL_CALIB_TOKENS tokens of the calibration text, more than the operating
# points' (their bound carries the noise; the dial's point estimate must be resolved at the 1% asked: at 2048 tokens
# the curve's block bootstrap interval near +1% is about as wide as the value, bench/results/dial_diagnosis.json)
DIAL_CALIB_TOKENS = 8192
DIAL_EVAL_TOKENS = 16_384  # the dial's budgets measured again on this much evaluation text (the demo's size)
DIAL_CURVE = "isotonic"  # the least-squares monotone fit of the noisy curve (edgemoe.eval.dial.isotonic)
# extra calibration budgets per dial, each bisecting the sharpest turn of the calibration curve below +30%
# (`calibrate_dial(refine=)`, `steepest_step`: a step whose slope is over twice the previous one's and that rises
# by more than a point), a knee that linear interpolation would cross blind (default-upcycled with empty layers:
# +5.1% at 0.8 nats, +121% at 1.0)
DIAL_REFINE = 6
KIND_BUDGET = ORDERMOE_BUDGET  # budget of the per-kind calibration runs (section 2)
CALIB_STEPS = 4  # bisection halvings per operating point (the demo: 6; fewer to fit the run in minutes)


def scoring_setting(profile, cluster, placement, adapter, text: EvalText, cfg: ExperimentConfig):
    """What a study scores its policies on, on edge8 in migrate mode with the model's dense cost: (context,
    simulated workload, evaluation trace, [T] user of each evaluation row, [T'] user of each calibration row).
    Shared with bench.studies.calibration."""
    from edgemoe.runtime import make_context
    from edgemoe.runtime.dense import dense_cost_of_model
    from edgemoe.runtime.sim.workload import Workload

    ctx = make_context(profile, cluster, placement, mode="migrate", dense=dense_cost_of_model(adapter))
    workload = Workload(num_requests=cfg.num_requests, prompt_tokens=cfg.prompt_tokens, gen_tokens=cfg.gen_tokens,
                        rate_per_s=cfg.rate_per_s, seed=cfg.seed)
    trace = eval_trace(text.topk, text.gates, ctx.user_domain, cfg.block_len)
    eval_users = np.arange(len(text.ids)) % ctx.num_users
    calib_users = np.arange(len(text.calib_ids)) % ctx.num_users
    return ctx, workload, trace, eval_users, calib_users


def dial_text(adapter, tokenizer, spec: str, cfg: ExperimentConfig, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The dial's blocks of the text `spec` (its calibration text, or the longer evaluation text): the first
    `tokens` tokens ([B, S] ids, cut into cfg.block_len blocks as load_eval_text cuts them) and exact execution's
    NLL on them [B, S-1]."""
    from edgemoe.data import resolve, tokenize_blocks
    from edgemoe.models.scoring import token_scores

    ids = tokenize_blocks(resolve(spec), tokenizer, cfg.block_len, max_tokens_per_source=tokens).ids
    ids = ids[: max(1, tokens // cfg.block_len)]
    return ids, token_scores(adapter, ids)[0]


def router_logits_of(adapter, ids: np.ndarray, batch_size: int = 8) -> np.ndarray:
    """[B*S, L, E] the model's router logits on ids [B, S] under exact execution, block-major (the order of
    `routing_trace` and of the simulator's trace), float32."""
    import torch

    out: list[list[np.ndarray]] = [[] for _ in range(adapter.num_layers)]

    def rec(call) -> None:
        out[call.layer].append(call.router_logits.float().cpu().numpy())

    with adapter.record(rec), torch.no_grad():
        for i in range(0, len(ids), batch_size):
            adapter.forward_logits(torch.from_numpy(ids[i:i + batch_size]))
    return np.stack([np.concatenate(x) for x in out], 1)


def simulated_policy(policy: str, ctx, params: dict, budget: float, trace_logits: np.ndarray | None):
    """The policy the simulator runs: a per-token OrderMoE gets the evaluation text's router logits
    (`OrderMoEPolicy.replay_logits`), so its simulated decisions price substitutes as the local backend's,
    whose perplexity the row reports; every other policy as made."""
    from edgemoe.runtime import make_policy

    pol = make_policy(policy, ctx, **params, budget=budget)
    if trace_logits is not None and getattr(pol, "per_token", False):
        pol.replay_logits(trace_logits)
    return pol


def model_calibration(model: str, path: Path = CALIBRATION_FILE, price: str = FULL_CALIBRATION,
                      empty: bool = False) -> dict:
    """The model's KindCalibration (`to_dict` form) from bench.studies.calibration's results file, fitted there on
    calibration text only, with `empty` removed (the policy never leaves a layer without expert output) unless
    `empty` (a layer may be left without expert output at its measured cost, priced like the other kinds).
    price "point": the file's fit (each kind and layer at its measured mean); "upper-bound": refitted from the
    file's calibration-text interventions at their one-sided 95% upper bound (`fit_calibration(z=...)`)."""
    from edgemoe.errors import EdgeMoEError
    from edgemoe.eval.calibration import Intervention, fit_calibration
    from edgemoe.eval.experiment import CALIB_CONFIDENCE_Z
    from edgemoe.io import read_json

    if price not in CALIBRATION_PRICES:
        raise EdgeMoEError(f"model_calibration: price must be one of {CALIBRATION_PRICES}, got {price!r}")
    doc = read_json(path, what="calibration results file")
    entry = next((m for m in doc.get("models", []) if m.get("model") == model), None)
    if entry is None or "calibration" not in entry:
        raise EdgeMoEError(f"{path}: no models[].calibration for model {model!r} (run python -m bench.studies.calibration "
                           f"--models {model})")
    if price == "point":
        return {**entry["calibration"], **({} if empty else {"empty": None})}
    rows = entry.get("interventions_calibration_text")
    if not isinstance(rows, list) or not rows:
        raise EdgeMoEError(f"{path}: model {model!r} has no interventions_calibration_text to refit at the upper bound")
    runs = [Intervention.from_dict(r, f"{path}: {model} interventions_calibration_text[{i}]") for i, r in enumerate(rows)]
    num_layers = len(entry["calibration"]["nats"][0])
    fit = fit_calibration(runs, num_layers, power=entry["calibration"]["power"], z=CALIB_CONFIDENCE_Z)
    return {**fit.to_dict(), **({} if empty else {"empty": None})}


def check_reusable(entry: dict, out: dict, path: str) -> None:
    """Raise unless `entry` (a model of another equal-quality file) was measured on what `out` measures: the same
    evaluation and calibration tokens, exact perplexity and placement, so its sweeps compare with this run's."""
    from edgemoe.errors import EdgeMoEError

    same = (entry.get("eval_tokens") == out["eval_tokens"] and entry.get("calib_tokens") == out["calib_tokens"]
            and abs(entry.get("ppl_exact", -1.0) - out["ppl_exact"]) <= 1e-6 * out["ppl_exact"]
            and entry.get("placement", {}).get("copies") == out["placement"]["copies"])
    if not same:
        raise EdgeMoEError(f"--reuse {path}: model {out['model']!r} there was measured on other text, tokens or placement "
                           f"(eval/calib tokens {entry.get('eval_tokens')}/{entry.get('calib_tokens')}, here "
                           f"{out['eval_tokens']}/{out['calib_tokens']}); its sweeps cannot be compared with this run's")


def run_model(model: str, cfg: ExperimentConfig, log, methods: set | None = None, reuse: dict | None = None,
              dial_method: str = "ordermoe", dial_calib_tokens: int = DIAL_CALIB_TOKENS,
              dial_eval_tokens: int = DIAL_EVAL_TOKENS, dial_beyond: bool = False) -> dict:
    """One model's comparison. methods: the method names to run (None: all of METHODS and ordermoe-calibrated);
    reuse: (path, model entry) of an earlier results file whose other methods, measured on the same text and
    placement (`check_reusable`), are copied in; dial_method: the method whose dial is measured, calibrated on the
    first dial_calib_tokens tokens of the calibration text and measured on the evaluation text and on its first
    dial_eval_tokens tokens (0: not); dial_beyond: an asked increase beyond what the dial method can cost on
    calibration text (`saturated`) is served by the same policy with empty layers allowed at their measured cost,
    through that policy's own dial on the same calibration text (`beyond_saturation`)."""
    from edgemoe.cluster.load import load_cluster
    from edgemoe.errors import EdgeMoEError
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
    text: EvalText = load_eval_text(adapter, tokenizer, cfg, eval_spec, calib_spec, log)
    cluster = load_cluster("edge8")
    problem = plan_problem(profile, cluster)
    t0 = time.perf_counter()
    placement = plan(problem, "ordermoe", budget=ORDERMOE_BUDGET)
    plan_s = time.perf_counter() - t0
    ctx, workload, trace, eval_users, calib_users = scoring_setting(profile, cluster, placement, adapter, text, cfg)
    trace_logits = router_logits_of(adapter, text.ids)  # [T, L, E] the trace's router logits (`simulated_policy`)
    log(f"{model}: placement planned in {plan_s:.0f} s; {text.ids.size} evaluation, {text.calib_ids.size} calibration tokens")

    def evaluate(policy: str, params: dict, budget: float) -> dict:
        pol = make_policy(policy, ctx, **params, budget=budget)
        nll, top1, dec = score_local(adapter, pol, text.ids, eval_users)
        q = quality_metrics(nll, top1, text.nll, text.top1)
        sim = simulate(ctx, simulated_policy(policy, ctx, params, budget, trace_logits), trace, workload)
        sub = dec.substituted()
        return {"budget": budget, "latency_ms_mean": sim.latency_ms["mean"], "latency_ms_p99": sim.latency_ms["p99"],
                "ppl": q["ppl"], "ppl_rel_increase": q["ppl_rel_increase"], "top1_agreement": q["top1_agreement"],
                "slots_substituted": float(sub.mean()), "slots_dropped": float(((dec.experts < 0) & ~dec.zeroed).mean()),
                "slots_zeroed": float(dec.zeroed.mean()), "spent_per_token": float(dec.quality_cost.sum(axis=1).mean()),
                "sim_substitution_ratio": sim.substitution_ratio,
                "sim_drop_ratio": sim.drop_ratio}

    def calib_rise(policy: str, params: dict, trials: dict):
        def at(b: float) -> tuple[float, float]:
            if b not in trials:
                nll, _, _ = score_local(adapter, make_policy(policy, ctx, **params, budget=b), text.calib_ids, calib_users)
                trials[b] = rise_with_bound(nll, text.calib_nll)
            return trials[b]
        return at

    exact = evaluate("exact", {}, 0.0)
    dial_policy = None
    out: dict = {"model": model, "placement": {"planner": "ordermoe", "budget": ORDERMOE_BUDGET, "plan_s": round(plan_s, 1),
                                                "copies": placement.replicas().tolist()},
                 "eval_tokens": int(text.ids.size), "calib_tokens": int(text.calib_ids.size),
                 "ppl_exact": float(np.exp(text.nll.mean())), "exact": exact, "methods": {}}
    run = (lambda name: True) if methods is None else (lambda name: name in methods)
    if reuse is not None:
        check_reusable(reuse[1], out, reuse[0])
        out["reused_from"] = {"file": reuse[0], "methods": sorted(k for k in reuse[1]["methods"] if not run(k))}
    if run("ordermoe-calibrated") or reuse is None or "kind_calibration" not in reuse[1]:
        # section 2: price every stand-in kind on one measured scale. One calibration run per kind alone (and the
        # full policy) at the demo's default budget: measured extra nats per token over predicted cost spent
        kinds: dict = {"budget": KIND_BUDGET, "nats": {}, "spent": {}}
        for kind in ("sub", "drop", "zero", "sub,drop,zero"):
            pol = make_policy("ordermoe", ctx, horizon=2, substitutes=kind, budget=KIND_BUDGET)
            nll, _, dec = score_local(adapter, pol, text.calib_ids, calib_users)
            kinds["nats"][kind] = float(nll.mean() - text.calib_nll.mean())
            kinds["spent"][kind] = float(dec.quality_cost.sum(axis=1).mean())
        kinds["scales"] = kind_scales(kinds["nats"], kinds["spent"])
        kinds["nats_per_unit_full_policy"] = kinds["nats"]["sub,drop,zero"] / max(kinds["spent"]["sub,drop,zero"], 1e-12)
        log(f"  stand-in kinds on one scale: {kinds['scales']} (nats/unit: "
            + ", ".join(f"{k} {kinds['nats'][k] / max(kinds['spent'][k], 1e-12):.3g}" for k in kinds["nats"]) + ")")
    else:
        kinds = reuse[1]["kind_calibration"]
    full = kinds["nats_per_unit_full_policy"]
    out["kind_calibration"] = kinds
    all_methods = [*METHODS, ("ordermoe-calibrated", "ordermoe-calibrated", {"horizon": 2, **kinds["scales"]}, ORDERMOE_SWEEP)]
    for name, policy, params, sweep in all_methods:
        if not run(name):
            if reuse is not None and name in reuse[1]["methods"]:
                out["methods"][name] = reuse[1]["methods"][name]
            continue
        if params.get("calibration") == "from-file":
            params = {**params, "calibration": model_calibration(model)}
        t0 = time.perf_counter()
        trials: dict = {}
        at = calib_rise(policy, params, trials)
        points = {}
        for point, target in OPERATING_POINTS:
            b = calibrate_budget(adapter, ctx, policy, params, text, target, trials, steps=CALIB_STEPS,
                                 **({"lo": NATS_LO} if "calibration" in params else {}))
            points[point] = {"budget": b, "target": target, "calib_ppl_rel_increase": at(b)[0],
                             "calib_upper95": at(b)[1]}
        budgets = sorted({*sweep, *(p["budget"] for p in points.values())})
        rows = [dict(exact, budget=0.0)] + [evaluate(policy, params, b) for b in budgets]
        for pt in points.values():
            pt["eval"] = next(r for r in rows if r["budget"] == pt["budget"])
        if name == dial_method:
            dial_policy = (policy, params)
        out["methods"][name] = {"policy": policy, "params": params, "points": points, "sweep": rows,
                                "calib_trials": [{"budget": b, "ppl_rel_increase": r, "upper95": u}
                                                 for b, (r, u) in sorted(trials.items())],
                                "seconds": round(time.perf_counter() - t0, 1)}
        log(f"  {name:<22} paper b={points['paper']['budget']:.4g} {points['paper']['eval']['latency_ms_mean']:.2f} ms "
            f"+{100 * points['paper']['eval']['ppl_rel_increase']:.2f}%; strict b={points['strict']['budget']:.4g} "
            f"{points['strict']['eval']['latency_ms_mean']:.2f} ms +{100 * points['strict']['eval']['ppl_rel_increase']:.2f}% "
            f"({time.perf_counter() - t0:.0f} s)")
    for name, key in VARIANTS.items():
        if name in out["methods"]:
            out[key] = equal_quality(out, name)
    out["predicted_vs_measured"] = predicted_vs_measured(out, full)
    # the dial: the method's calibration curve (point estimates) on calibration text, then asked vs measured
    t0 = time.perf_counter()
    if dial_policy is None:
        log(f"  no dial: {dial_method} did not run here")
        out["seconds"] = round(time.perf_counter() - t_model, 1)
        return out
    dial_ids, dial_nll = dial_text(adapter, tokenizer, calib_spec, cfg, dial_calib_tokens)
    dial_users = np.arange(len(dial_ids)) % ctx.num_users

    def rise_on_dial_text(policy: str, params: dict, trials: dict):
        """budget -> the policy's increase on the dial's calibration text; trials[budget] keeps (increase, one-sided
        95% upper bound)."""
        def at(b: float) -> float:
            nll, _, _ = score_local(adapter, make_policy(policy, ctx, **params, budget=b), dial_ids, dial_users)
            trials[b] = rise_with_bound(nll, dial_nll)
            return trials[b][0]
        return at

    trials: dict = {}
    grid = NATS_DIAL_GRID if "calibration" in dial_policy[1] else DIAL_GRID
    dial = calibrate_dial(rise_on_dial_text(*dial_policy, trials), grid, policy=dial_method,
                          calib_tokens=int(dial_ids.size), curve=DIAL_CURVE, refine=DIAL_REFINE)
    beyond = None  # (policy, params, dial) serving the asked values the dial method cannot reach, decided on calibration text
    if dial_beyond and any(a > dial.envelope[-1] for a in DIAL_ASKED):
        if "calibration" not in dial_policy[1]:
            raise EdgeMoEError(f"--dial-beyond needs a calibrated dial method (ordermoe-full), not {dial_method!r}")
        wide = (dial_policy[0], {**dial_policy[1], "calibration": model_calibration(model, empty=True)})
        trials_wide: dict = {}
        beyond = (*wide, calibrate_dial(rise_on_dial_text(*wide, trials_wide), grid, policy=f"{dial_method}+empty",
                                        calib_tokens=int(dial_ids.size), curve=DIAL_CURVE, refine=DIAL_REFINE))
    # the same budgets also on a longer evaluation text (its first blocks are the evaluation text): how much of a
    # miss is the evaluation sample's own noise (block bootstrap 90% intervals of both)
    long_ids, long_nll = dial_text(adapter, tokenizer, eval_spec, cfg, dial_eval_tokens) if dial_eval_tokens else (None, None)
    if long_ids is not None and not np.array_equal(long_ids[:len(text.ids)], text.ids):
        raise EdgeMoEError(f"--dial-eval-tokens {dial_eval_tokens}: the longer evaluation text does not begin with the "
                           "evaluation text (fewer tokens than --eval-tokens?)")
    rows = []
    for asked in DIAL_ASKED:
        # asked more harm than the policy causes at the grid's top budget: the dial gives its fastest point, or
        # (dial_beyond) hands the asked value to the policy that may also leave layers empty
        saturated = bool(asked > dial.envelope[-1])
        wide_used, b = handoff(asked, dial, beyond[2] if beyond is not None else None)
        served = (beyond[0], beyond[1]) if wide_used else dial_policy
        r = evaluate(*served, b)
        row = {"asked": asked, "budget": b, "measured": r["ppl_rel_increase"], "ratio": r["ppl_rel_increase"] / asked,
               "latency_ms_mean": r["latency_ms_mean"], "in_target": bool(0.5 <= r["ppl_rel_increase"] / asked <= 1.2),
               "saturated": saturated, "empty_layers": wide_used}
        if wide_used:
            row["saturated_beyond"] = bool(asked > beyond[2].envelope[-1])
        if long_ids is not None:
            nll, _, _ = score_local(adapter, make_policy(served[0], ctx, **served[1], budget=b), long_ids,
                                    np.arange(len(long_ids)) % ctx.num_users)
            d = (nll.astype(np.float64) - long_nll).mean(axis=1)  # [B] extra nats per block
            short = len(text.ids)
            row.update({"measured_boot90": list(rise_interval(d[:short])), "measured_long": float(np.expm1(d.mean())),
                        "measured_long_boot90": list(rise_interval(d)), "ratio_long": float(np.expm1(d.mean())) / asked})
        rows.append(row)
        log(f"  dial asked {100 * asked:.1f}% -> budget {b:.4g} -> measured {100 * r['ppl_rel_increase']:+.2f}%"
            + (f" ({100 * row['measured_long']:+.2f}% on {long_ids.size} tokens)" if long_ids is not None else ""))
    out["dial"] = {**dial.to_dict(), "calib_upper95": [trials[b][1] if b in trials else 0.0 for b in dial.budgets],
                   "method": dial_method, "asked_vs_measured": rows, "eval_long_tokens": int(long_ids.size) if long_ids is not None else 0,
                   "calib_max_rise": float(dial.envelope[-1]),  # what the policy can cost at most (its fastest point)
                   "measured_monotone": bool(all(b["measured"] >= a["measured"] - 1e-4 for a, b in pairwise(rows))),
                   "target": "measured in [0.5x, 1.2x] of asked, on evaluation text", "seconds": round(time.perf_counter() - t0, 1)}
    if beyond is not None:
        out["dial"]["beyond_saturation"] = {
            **beyond[2].to_dict(), "calib_upper95": [trials_wide[b][1] if b in trials_wide else 0.0 for b in beyond[2].budgets],
            "calibration": beyond[1]["calibration"], "calib_max_rise": float(beyond[2].envelope[-1]),
            "rule": "asked above the dial method's largest increase on calibration text (calib_max_rise) is served by "
                    "the same policy with empty layers allowed at their measured cost, through this dial"}
    out["seconds"] = round(time.perf_counter() - t_model, 1)
    return out


def predicted_vs_measured(doc: dict, nats_per_unit: float) -> dict:
    """Per OrderMoE variant, over its sweep: the predicted increase expm1(nats_per_unit x predicted cost spent
    per token) (nats_per_unit from the full policy's calibration run; 1 for a variant priced in measured nats,
    `calibration=`) beside the measured one, and the Spearman rank correlation of predicted cost and measured
    increase."""
    from scipy.stats import spearmanr

    out = {}
    for name in (n for n in VARIANTS if n in doc["methods"]):
        unit = 1.0 if "calibration" in doc["methods"][name]["params"] else nats_per_unit
        rows = [r for r in doc["methods"][name]["sweep"] if r["budget"] > 0]
        pred = [float(np.expm1(unit * r.get("spent_per_token", 0.0))) for r in rows]
        meas = [r["ppl_rel_increase"] for r in rows]
        rho = spearmanr([r.get("spent_per_token", 0.0) for r in rows], meas).statistic if len(rows) > 2 else None
        out[name] = {"budgets": [r["budget"] for r in rows], "predicted": pred, "measured": meas,
                     "spearman": None if rho is None or not np.isfinite(rho) else float(rho)}
    return out


def equal_quality(doc: dict, method: str = "ordermoe") -> dict:
    """At `method`'s measured increase at each operating point: every baseline's interpolated mean latency
    and the method's latency over the best baseline's (None where no baseline's sweep reaches that increase)."""
    om = doc["methods"][method]
    table = {}
    for point in ("paper", "strict"):
        ev = om["points"][point]["eval"]
        rise = ev["ppl_rel_increase"]
        at = {name: latency_at_quality(doc["methods"][name]["sweep"], rise)
              for name in BASELINES if name in doc["methods"]}
        reach = {k: v for k, v in at.items() if v is not None}
        best = min(reach, key=reach.get) if reach else None
        field_reach = {k: v for k, v in reach.items() if k in FIELD}
        best_field = min(field_reach, key=field_reach.get) if field_reach else None
        table[point] = {"ordermoe_ppl_rel_increase": rise, "ordermoe_latency_ms_mean": ev["latency_ms_mean"],
                        "exact_latency_ms_mean": doc["exact"]["latency_ms_mean"],
                        "baselines_latency_ms_at_same_ppl": at, "best_baseline": best,
                        "ratio_to_best": ev["latency_ms_mean"] / reach[best] if best else None,
                        "best_field_baseline": best_field,
                        "ratio_to_best_field": ev["latency_ms_mean"] / field_reach[best_field] if best_field else None}
    return table


def print_table(models: list[dict]) -> None:
    print("\nmodel | point | ordermoe ms (ppl +%) | best baseline at same ppl (ms) | ratio | best field (skip/reroute/random) | ratio")
    for m in models:
        for point, row in m.get("equal_quality", {}).items():
            bb, bf = row["best_baseline"], row["best_field_baseline"]
            at = row["baselines_latency_ms_at_same_ppl"]
            print(f"{m['model']} | {point} | {row['ordermoe_latency_ms_mean']:.2f} (+{100 * row['ordermoe_ppl_rel_increase']:.2f}%) | "
                  f"{bb}: {at[bb]:.2f} | {row['ratio_to_best']:.2f}x | {bf}: {at[bf]:.2f} | {row['ratio_to_best_field']:.2f}x"
                  if bb and bf else f"{m['model']} | {point} | no baseline reaches that increase")
    for key, heading in (("equal_quality_calibrated", "ordermoe-calibrated (kinds on one measured scale)"),
                         ("equal_quality_token", "ordermoe-token (stand-ins chosen per token among every local expert)"),
                         ("equal_quality_full", "ordermoe-full (per-token stand-ins priced in measured nats)"),
                         ("equal_quality_full_h0", "ordermoe-full-h0 (the same, myopic and unsteered)")):
        print(f"\n{heading} at equal perplexity:")
        for m in models:
            for point, row in m.get(key, {}).items():
                if row["best_baseline"] and row["best_field_baseline"]:
                    print(f"{m['model']} | {point} | {row['ordermoe_latency_ms_mean']:.2f} (+{100 * row['ordermoe_ppl_rel_increase']:.2f}%) "
                          f"| {row['best_baseline']} | {row['ratio_to_best']:.2f}x | {row['best_field_baseline']} | {row['ratio_to_best_field']:.2f}x")
    print("\npredicted vs measured increase over the sweep (Spearman of predicted cost and measured increase):")
    for m in models:
        for name, r in m["predicted_vs_measured"].items():
            pairs = ", ".join(f"{100 * p:.1f}/{100 * q:.1f}%" for p, q in zip(r["predicted"], r["measured"], strict=True))
            print(f"{m['model']} | {name} | rho {r['spearman']} | {pairs}")
    print("\nmodel | dial | asked | budget | measured | ratio")
    for m in models:
        for r in m.get("dial", {}).get("asked_vs_measured", []):
            print(f"{m['model']} | {m['dial']['method']} | {100 * r['asked']:.1f}% | {r['budget']:.4g} | {100 * r['measured']:+.2f}% | {r['ratio']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1024 evaluation and calibration tokens")
    ap.add_argument("--out", default=str(RESULTS / "equal_quality.json"))
    ap.add_argument("--note", default="", help="a sentence stored in the results file (why this run, what it covers)")
    ap.add_argument("--methods", help="comma-separated method names to run (default: all)")
    ap.add_argument("--reuse", nargs="+", default=[], help="earlier results files (same tokens, text and placement) whose "
                                                        "other methods are copied in instead of run again")
    ap.add_argument("--merge", nargs="+", help="only join these results files' models into --out (runs made apart)")
    ap.add_argument("--dial-method", default="ordermoe", help="the method whose quality dial is measured")
    ap.add_argument("--dial-beyond", action="store_true",
                    help="serve asked increases beyond the dial method's reach on calibration text with empty layers "
                         "allowed at their measured cost (a calibrated dial method only)")
    ap.add_argument("--dial-calib-tokens", type=int, default=DIAL_CALIB_TOKENS,
                    help="calibration tokens the dial's curve is measured on (the first of the calibration text)")
    ap.add_argument("--dial-eval-tokens", type=int, default=DIAL_EVAL_TOKENS,
                    help="evaluation tokens the dial's budgets are also measured on (0: only the evaluation text)")
    args = ap.parse_args()
    methods = None if not args.methods else set(args.methods.split(","))
    known = {m[0] for m in METHODS} | {"ordermoe-calibrated"}
    if methods is not None and not methods <= known:
        ap.error(f"--methods: unknown {sorted(methods - known)}; expected some of {sorted(known)}")
    from edgemoe.io import read_json

    if args.merge:
        doc = merge_results(args.merge, PART_KEYS)
        atomic_write_json(Path(args.out), doc)
        print_table(doc["models"])
        return
    reused = {}  # model -> (file, its entry there): the first file naming the model
    for path in args.reuse:
        for m in read_json(path, what="--reuse results file")["models"]:
            reused.setdefault(m["model"], (path, m))
    ev, ca = (1024, 1024) if args.quick else (args.eval_tokens, args.calib_tokens)
    cfg = ExperimentConfig(shared_data=str(REPO.parent / "shared" / "data"), cache_dir=str(REPO / "runs" / "cache"),
                           eval_tokens=ev, calib_quality_tokens=ca)
    load0, c0, w0 = os.getloadavg(), time.process_time(), time.perf_counter()
    models = []
    for model in args.models.split(","):
        models.append(run_model(model, replace(cfg, model=model), print, methods, reused.get(model), args.dial_method,
                                min(args.dial_calib_tokens, ca) if args.quick else args.dial_calib_tokens,
                                0 if args.quick else args.dial_eval_tokens, args.dial_beyond))
    doc = {"schema": "edgemoe.bench.equal_quality/1", "environment": environment(),
           "load_average_start": list(load0), "load_average_end": list(os.getloadavg()),
           "cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1),
           "config": {"cluster": "edge8", "mode": "migrate", "eval_tokens": ev, "calib_quality_tokens": ca,
                      "num_requests": cfg.num_requests, "prompt_tokens": cfg.prompt_tokens, "gen_tokens": cfg.gen_tokens,
                      "rate_per_s": cfg.rate_per_s, "operating_points": dict(OPERATING_POINTS),
                      "calibration_steps": CALIB_STEPS, "dial_grid": DIAL_GRID, "dial_asked": DIAL_ASKED,
                      "baselines": BASELINES, "field_baselines": FIELD, "methods_run": args.methods or "all",
                      "reuse": args.reuse, "dial_method": args.dial_method, "dial_beyond": args.dial_beyond,
                      "dial_calib_tokens": args.dial_calib_tokens, "dial_eval_tokens": args.dial_eval_tokens, "dial_curve": DIAL_CURVE, "dial_refine": DIAL_REFINE, "nats_dial_grid": NATS_DIAL_GRID},
           "models": models, **({"note": args.note} if args.note else {})}
    atomic_write_json(Path(args.out), doc)
    print_table(models)
    print(f"\nwrote {args.out} ({doc['wall_s']:.0f} s wall, {doc['cpu_s']:.0f} s CPU, load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
