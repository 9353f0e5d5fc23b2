"""Measured cost of each stand-in kind per layer: the `KindCalibration` that prices OrderMoE's stand-ins in
nats (issue 19, section 2).

The profile predicts a stand-in's perturbation of a layer's MoE output from measured output errors (gate x
relative error, `edgemoe.plan.ordermoe.standins.choose_stand_ins`); what that perturbation costs in
perplexity depends on the layer and on the kind of error (a substitute keeps the experts' shared part of the
output, zeroing loses it). Here each kind is measured alone on the real model: at one layer at a time, one
slot of every token gets that stand-in (`VARIANTS`), and the extra nats per token over exact execution are
divided by the mean predicted P ** power the intervention made. Per kind and layer, the pooled ratio
sum(nats) / sum(mean P ** power) over its variants is the calibration; a kind whose measured rise is within
noise of zero is credited with half its standard error (never zero or negative: a free stand-in would be
bought everywhere). Losing a layer's whole MoE output (both slots zeroed) is measured the same way.

Assumptions, named: single-layer effects add up over layers (the policy perturbs several layers per token);
replacing one slot of *every* token prices a stand-in as the policy uses it on a subset of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.plan.ordermoe.standins import KINDS, QUALITY_POWER, KindCalibration

# (name, kind, which substitute): "best" the expert with the least measured error for the routed one, "random" a
# uniformly drawn unrouted expert (seeded); drop and zero need none. Each runs on slot 0 (top-1) and slot 1.
VARIANTS = (("zero", "zero", None), ("drop", "drop", None), ("sub-best", "sub", "best"))
RANDOM_VARIANT = ("sub-random", "sub", "random")  # a second substitute run per slot (`measure_interventions(random_sub=True)`)


@dataclass(frozen=True)
class Intervention:
    """One measured intervention: at `layer`, stand-in `variant` (of `kind`) on slot `slot` of every token
    (slot -1: every slot zeroed, the layer's MoE output lost)."""

    layer: int
    kind: str  # one of KINDS, or "empty"
    variant: str
    slot: int
    pred: float  # mean predicted P ** power per token
    nats: float  # measured extra nats per token over exact execution
    se: float  # its standard error (blocks as the unit)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, row: dict, where: str = "intervention") -> Intervention:
        """The run that `to_dict` wrote, checked: integer layer and slot, a known kind, finite numbers with
        pred and se >= 0 (a results file is read back, never trusted)."""
        if not isinstance(row, dict):
            raise EdgeMoEError(f"{where}: expected an object with {sorted(cls.__dataclass_fields__)}, got "
                               f"{type(row).__name__}")
        missing = sorted(set(cls.__dataclass_fields__) - set(row))
        if missing:
            raise EdgeMoEError(f"{where}: missing field(s) {missing}")
        for f in ("layer", "slot"):
            if not isinstance(row[f], int) or isinstance(row[f], bool) or row[f] < -1:
                raise EdgeMoEError(f"{where}.{f}: expected an integer >= -1, got {row[f]!r}")
        if row["kind"] not in (*KINDS, "empty") or not isinstance(row["variant"], str):
            raise EdgeMoEError(f"{where}.kind: expected one of {[*KINDS, 'empty']}, got {row['kind']!r}")
        for f in ("pred", "nats", "se"):
            v = row[f]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or (f != "nats" and v < 0):
                raise EdgeMoEError(f"{where}.{f}: expected a finite number{'' if f == 'nats' else ' >= 0'}, got {v!r}")
        return cls(row["layer"], row["kind"], row["variant"], row["slot"], float(row["pred"]), float(row["nats"]),
                   float(row["se"]))


def _paired(nll: np.ndarray, nll_exact: np.ndarray) -> tuple[float, float]:
    """(mean extra nats per token, its standard error over the B blocks) of nll vs nll_exact [B, S-1]."""
    d = (np.asarray(nll, float) - np.asarray(nll_exact, float)).mean(axis=1)
    return float(np.mean(nll) - np.mean(nll_exact)), float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


def _stand_in(kind: str, which, slot: int, layer: int, topk: np.ndarray, gates: np.ndarray, subst_err: np.ndarray,
              rng: np.random.Generator, power: float) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(experts [T, K], zeroed [T, K] or None, predicted P ** power [T]) of one variant at one layer, priced as
    `choose_stand_ins` prices it (drop: the other slots' renormalised mix of errors)."""
    T, K = topk.shape
    g = np.abs(gates)
    ex = topk.copy()
    rows = np.arange(T)
    if kind == "empty":
        return np.full_like(topk, -1), np.ones_like(topk, bool), g.sum(axis=1) ** power
    e_k = topk[:, slot]
    if kind == "zero":
        ex[:, slot] = -1
        zeroed = np.zeros_like(topk, bool)
        zeroed[:, slot] = True
        return ex, zeroed, g[:, slot] ** power
    if kind == "drop":
        others = np.delete(np.arange(K), slot)
        w = g[:, others]
        mix = (w * subst_err[layer, e_k[:, None], topk[:, others]]).sum(axis=1) / np.maximum(w.sum(axis=1), 1e-12)
        ex[:, slot] = -1
        return ex, None, (g[:, slot] * mix) ** power
    err = subst_err[layer, e_k].copy()  # [T, E] error of each expert in e_k's place
    np.put_along_axis(err, topk, np.inf, axis=1)  # a routed expert runs in its own slot
    if which == "best":
        sub = err.argmin(axis=1)
    else:
        E = err.shape[1]
        free = np.argsort(np.isinf(err), axis=1, kind="stable")[:, : E - K]  # the unrouted ids, ascending
        sub = free[rows, rng.integers(0, E - K, T)]
    ex[:, slot] = sub
    return ex, None, (g[:, slot] * err[rows, sub]) ** power


def measure_interventions(adapter, subst_err: np.ndarray, ids: np.ndarray, nll_exact: np.ndarray,
                          power: float = QUALITY_POWER, seed: int = 0, empty: bool = True, random_sub: bool = False,
                          log=None) -> list[Intervention]:
    """Every `VARIANTS` entry (and `RANDOM_VARIANT` with random_sub) on every slot of every layer (and, with
    `empty`, every layer's output lost), each
    alone on the real model over ids [B, S] (exact execution's nll_exact [B, S-1]). subst_err: [L, E, E] the
    profile's measured substitution errors."""
    from edgemoe.models import Intervention as ModelIntervention
    from edgemoe.models.scoring import token_scores

    L, K = adapter.num_layers, adapter.top_k
    subst_err = np.asarray(subst_err, float)
    if subst_err.shape[0] != L:
        raise EdgeMoEError(f"calibration: subst_err has {subst_err.shape[0]} layers, the model {L}")
    out = []
    for layer in range(L):
        variants = (*VARIANTS, RANDOM_VARIANT) if random_sub else VARIANTS
        runs = [(v, kind, which, slot) for v, kind, which in variants for slot in range(K)]
        if empty:
            runs.append(("empty", "empty", None, -1))
        for variant, kind, which, slot in runs:
            rng = np.random.default_rng([seed, layer, max(slot, 0)])
            pred: list[np.ndarray] = []

            def policy(call, layer=layer, kind=kind, which=which, slot=slot, rng=rng, pred=pred):
                if call.layer != layer:
                    return None
                topk = call.topk.cpu().numpy().astype(np.int64)
                gates = call.gates.float().cpu().numpy().astype(np.float64)
                ex, zeroed, p = _stand_in(kind, which, slot, layer, topk, gates, subst_err, rng, power)
                pred.append(p)
                return ModelIntervention.from_numpy(ex, zeroed)

            nll, _ = token_scores(adapter, ids, policy=policy)
            nats, se = _paired(nll, nll_exact)
            out.append(Intervention(layer, kind, variant, slot, float(np.concatenate(pred).mean()), nats, se))
            if log:
                log(f"  layer {layer} {variant:<10} slot {slot:>2}: {nats:+.5f} nats (se {se:.5f}), "
                    f"predicted P^{power:g} {out[-1].pred:.4f}")
    return out


def fit_calibration(runs: list[Intervention], num_layers: int, power: float = QUALITY_POWER,
                    empty: bool = True, z: float = 0.0) -> KindCalibration:
    """The `KindCalibration` of measured interventions: per kind and layer, sum(nats) / sum(pred) over its runs,
    with the summed rise floored at half its standard error (a rise within noise of zero is not free).
    Every kind and layer needs at least one run with pred > 0; `empty` False leaves such actions forbidden.
    z > 0 prices each kind and layer at its summed rise plus z standard errors (z = 1.645: the one-sided 95%
    upper bound), so that a kind measured on few tokens is not bought for a cheapness that is only noise."""
    if not np.isfinite(z) or z < 0:
        raise EdgeMoEError(f"calibration: z must be a finite number >= 0, got {z!r}")
    nats = np.zeros((len(KINDS), num_layers))
    emp = np.zeros(num_layers)
    for layer in range(num_layers):
        for i, kind in enumerate((*KINDS, "empty")):
            if kind == "empty" and not empty:
                continue
            mine = [r for r in runs if r.layer == layer and r.kind == kind]
            pred = sum(r.pred for r in mine)
            if not mine or pred <= 0:
                raise EdgeMoEError(f"calibration: no measured run of kind {kind!r} at layer {layer} with a "
                                   f"predicted perturbation > 0")
            se = float(np.sqrt(sum(r.se ** 2 for r in mine)))
            rise = max(sum(r.nats for r in mine) + z * se, 0.5 * se, 1e-9)
            if kind == "empty":
                emp[layer] = rise / pred
            else:
                nats[i, layer] = rise / pred
    return KindCalibration(nats, emp if empty else None, power)


def predicted_nats(runs: list[Intervention], calib: KindCalibration | None) -> np.ndarray:
    """[R] each run's predicted extra nats: calib's nats per unit x its pred (None: the uncalibrated pred
    itself, the profile's units)."""
    if calib is None:
        return np.array([r.pred for r in runs])
    table = {k: np.asarray(calib.nats)[i] for i, k in enumerate(KINDS)}
    if calib.empty is not None:
        table["empty"] = np.asarray(calib.empty)
    return np.array([table[r.kind][r.layer] * r.pred if r.kind in table else np.nan for r in runs])
