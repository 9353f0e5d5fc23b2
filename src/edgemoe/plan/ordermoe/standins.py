"""What may stand in for an exact expert branch, and at what predicted quality cost (pure numpy).

Shared by the ordermoe runtime policy (`edgemoe.runtime.policies.ordermoe.stand_in_costs`, `layer_options`) and the
planner's runtime model (`edgemoe.plan.ordermoe.runtime_model.PathModel`), so the planner prices a placement with the very
stand-in choice the policy will make. It lives in `plan` because the runtime may import the planner's layer
and not the other way round (tests/test_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError

KINDS = ("sub", "drop", "zero")  # what may stand in for an exact branch; on equal quality cost, the first wins
QUALITY_POWER = 2.0  # quality cost = (gate x relative output error) ** QUALITY_POWER (see choose_stand_ins)
MAX_ENUM_K = 4  # enumerate all 2^K subsets up to K = 4 (16 actions); prefixes beyond

_BITS: dict[int, np.ndarray] = {}


def check_kinds(kinds) -> tuple[str, ...]:
    """The stand-in kinds as a tuple in preference order; raises on unknown names."""
    kinds = tuple(kinds.split(",") if isinstance(kinds, str) else kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise EdgeMoEError(f"substitutes: unknown kind(s) {bad}; expected a subset of {list(KINDS)}")
    return tuple(k for k in KINDS if k in kinds)


def subset_bits(K: int) -> np.ndarray:
    """[2^K, K] bool: bit k of subset index m (action m replaces the slots whose bit is set)."""
    if K not in _BITS:
        _BITS[K] = ((np.arange(2 ** K)[:, None] >> np.arange(K)[None, :]) & 1).astype(bool)
        _BITS[K].setflags(write=False)
    return _BITS[K]


def prefix_masks(ready: np.ndarray, replaceable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([R, K] order, [R, K+1, K] masks): the actions tried when K is too large to enumerate: prefix j replaces
    the j slowest replaceable slots (ready [R, K] seconds of each exact branch; replaceable [R, K] bool), the
    others ranked last in slot order (they make the longer prefixes invalid)."""
    R, K = ready.shape
    order = np.argsort(-np.where(replaceable, ready, -np.inf), axis=1, kind="stable")  # slowest first
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(K)[None, :].repeat(R, 0), axis=1)
    return order, rank[:, None, :] < np.arange(K + 1)[None, :, None]


def max_over_kept(x: np.ndarray, mask: np.ndarray, order: np.ndarray | None) -> np.ndarray:
    """[R, M, G] max over the slots k that action m keeps (mask[r, m, k] false) of x[r, k, g] (-inf: none kept).

    x: [R, K, G]. Enumerated subsets (order None, mask = `subset_bits` for every row): the max over every
    subset of slots is built once by adding one slot at a time (2^K - 1 maxima of [R, G]), and action m keeps
    the complement of m, i.e. subset 2^K - 1 - m. Prefixes (order [R, K]: slot replaced i-th): action j keeps
    the slots ranked j and later, a running max from the end. Max is exact, so this equals the direct max."""
    R, K, G = x.shape
    if order is None:
        M = 2 ** K
        sub = np.empty((R, M, G))
        sub[:, 0] = -np.inf
        for m in range(1, M):
            low = (m & -m).bit_length() - 1
            np.maximum(sub[:, m & (m - 1)], x[:, low], out=sub[:, m])
        return sub[:, ::-1]
    ranked = np.take_along_axis(x, order[:, :, None], 1)  # [R, K, G] by replacement rank
    out = np.full((R, K + 1, G), -np.inf)
    out[:, :K] = np.maximum.accumulate(ranked[:, ::-1], axis=1)[:, ::-1]
    return out


def choose_stand_ins(layer: np.ndarray, topk: np.ndarray, gates: np.ndarray, sub: np.ndarray, sub_err: np.ndarray,
                     subst_err: np.ndarray, mask: np.ndarray, kinds: tuple[str, ...],
                     power: float = QUALITY_POWER, scale: np.ndarray | None = None,
                     empty: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per replaced slot, the stand-in with the least predicted quality cost, and that cost.

    layer: [R]; topk, gates: [R, K]; sub, sub_err: [R, K] the token's node's best-ranked local group member of
    each slot's expert and its measured error (-1 / inf: none, or "sub" not allowed); subst_err [L, E, E];
    mask: [R, M, K] slots replaced by each action. Quality cost, in units of gate x relative output error
    ||Y - Y_e|| / ||Y_e|| (profile calibration):
    - sub: the local member e' with the original gate: |g_k| * subst_err[l, e_k, e'];
    - zero: the branch's output is lost, the other gates stay: |g_k| * 1;
    - drop: the remaining gates are renormalised, so the slot's share goes to the exactly run slots j of the
      action: |g_k| * sum_j w_j subst_err[l, e_k, e_j] with w the renormalised weights (a triangle-inequality
      bound; for K = 2 it is exact: dropping k runs the other routed expert in its place).
    The cost charged is the power `power` of the *layer's* perturbation, not of each slot's: the slots'
    perturbations p_k add up (triangle bound) to the layer's P = sum_k p_k over the action's replaced slots,
    and the action costs P ** power, shared among its slots in proportion to p_k (slot k is charged
    p_k * P ** (power - 1), so the slots' costs sum to the action's). 2 (default) is the second-order view
    (extra nats per token grow with the square of a small output perturbation), so one large perturbation,
    such as losing a top-1 expert, costs much more than several small ones; 1 is the linear proxy. Squaring
    each slot's share and adding the squares instead (before issue 19) priced zeroing every branch of a layer
    at sum_k g_k ** 2 (0.5 for two equal gates) although the layer then loses its whole MoE output (P = 1):
    with a few tenths of budget the policy bought exactly that, and perplexity jumped by orders of magnitude.
    The kind of each slot is the one with the least perturbation (the same order as the least cost). An
    action that runs no expert at all at the layer (every slot dropped or zeroed) gets cost inf: zeroing the
    whole MoE output is P = 1, where the square law says nothing (it still cost a few hundred percent of
    perplexity at budgets that allowed it once per token).
    Calibrated (`KindCalibration`, off when scale is None): scale [R, 3] multiplies each kind's perturbation
    (KINDS order) at the row's layer before the kinds are compared and the layer's P is formed, so that
    P ** power is measured extra nats per token; empty [R] (or None: not allowed) is the measured cost of an
    action that leaves the layer no expert output, shared among its slots in proportion to p_k.
    Returns (kind [R, M, K] index into KINDS, cost [R, M, K] (inf: no stand-in allowed)).
    """
    R, K = topk.shape
    M = mask.shape[1]
    lk = layer[:, None]
    g = np.abs(gates)
    q_sub = np.where(sub >= 0, g * np.where(sub >= 0, sub_err, 0.0), np.inf) if "sub" in kinds \
        else np.full((R, K), np.inf)
    q_zero = g if "zero" in kinds else np.full((R, K), np.inf)
    if "drop" in kinds and K > 1:
        err = subst_err[lk[:, :, None], topk[:, :, None], topk[:, None, :]]  # [R, K, K] err of e_k -> e_j
        w = np.where(mask, 0.0, g[:, None, :])  # [R, M, K] weight of the slots run exactly
        wsum = w.sum(axis=2, keepdims=True)
        mix = np.einsum("rmj,rkj->rmk", w, err)
        q_drop = np.where(wsum > 0, g[:, None, :] * mix / np.where(wsum > 0, wsum, 1.0), np.inf)
    else:
        q_drop = np.full((R, M, K), np.inf)
    if scale is not None:  # calibrated: each kind's perturbation in units whose power is measured nats
        q_sub, q_drop, q_zero = q_sub * scale[:, :1], q_drop * scale[:, None, 1:2], q_zero * scale[:, 2:3]
    # the least of (sub, drop, zero), first on ties, as an argmin over the three would give; sub and zero do not
    # depend on the action, so they are compared once per slot [R, K]
    sub_first = q_sub <= q_zero
    kind_sz = np.where(sub_first, 0, 2)
    q_sz = np.where(sub_first, q_sub, q_zero)[:, None, :]
    take_drop = (q_drop < q_sz) | ((q_drop == q_sz) & ~sub_first[:, None, :])  # [R, M, K]
    kind = np.where(take_drop, 1, kind_sz[:, None, :])
    p = np.where(take_drop, q_drop, q_sz)  # [R, M, K] each slot's perturbation
    # an action that leaves the layer no expert output at all (every slot dropped or zeroed) is not allowed: it
    # is far outside the small-perturbation view the cost rests on (it was the cliff of issue 19)
    no_output = (mask & (kind != 0)).all(axis=2, keepdims=True) if K else None
    if K and empty is None:
        p = np.where(no_output, np.inf, p)
    if power == 1.0 and empty is None:
        return kind, p
    layer_p = np.where(mask, p, 0.0).sum(axis=2, keepdims=True)  # [R, M, 1] the action's perturbation P
    with np.errstate(invalid="ignore"):  # inf x 0 in slots or actions not taken (replaced by the where)
        share = np.where(np.isfinite(layer_p), p * layer_p ** (power - 1.0), np.inf)
        if empty is not None and K:  # the measured cost of losing the layer's MoE output, shared by p_k / P
            part = np.divide(p, layer_p, out=np.full_like(p, 1.0 / K), where=layer_p > 0)
            share = np.where(no_output & np.isfinite(layer_p), part * empty[:, None, None], share)
    return kind, np.where(mask, share, p ** power)


@dataclass(frozen=True)
class KindCalibration:
    """Measured extra nats per unit of predicted perturbation, per stand-in kind and layer (issue 19, section 2).

    nats[i, l]: extra nats per token that a perturbation P ** power of kind KINDS[i] costs at layer l, fitted on
    calibration text by replacing one slot of every token at that layer alone (`edgemoe.eval.calibration`);
    empty[l]: extra nats per token per unit (sum |g|) ** power of leaving layer l no expert output at all
    (None: such actions stay forbidden). `choose_stand_ins` multiplies kind i's perturbation at layer l by
    nats[i, l] ** (1 / power), so the predicted cost is in nats and the kinds are compared on what they were
    measured to cost. L layers."""

    nats: np.ndarray  # [3, L] > 0
    empty: np.ndarray | None = None  # [L] > 0, or None
    power: float = QUALITY_POWER

    def __post_init__(self):
        nats = np.asarray(self.nats, dtype=float)
        if nats.ndim != 2 or nats.shape[0] != len(KINDS) or not (np.isfinite(nats).all() and (nats > 0).all()):
            raise EdgeMoEError(f"calibration: nats must be [{len(KINDS)}, L] finite and > 0 (kinds {list(KINDS)}), "
                               f"got shape {nats.shape}")
        if self.empty is not None:
            empty = np.asarray(self.empty, dtype=float)
            if empty.shape != (nats.shape[1],) or not (np.isfinite(empty).all() and (empty > 0).all()):
                raise EdgeMoEError(f"calibration: empty must be [L={nats.shape[1]}] finite and > 0, or null")
        if not (np.isfinite(self.power) and self.power > 0):
            raise EdgeMoEError(f"calibration: power must be finite and > 0, got {self.power}")

    @property
    def num_layers(self) -> int:
        return int(np.shape(self.nats)[1])

    def scale(self, layer: np.ndarray) -> np.ndarray:
        """[R, 3] the multiplier of each kind's perturbation at the rows' layers `layer` [R]."""
        return (np.asarray(self.nats, float) ** (1.0 / self.power))[:, layer].T

    def empty_cost(self, layer: np.ndarray, gates: np.ndarray) -> np.ndarray | None:
        """[R] the nats of an action that runs no expert at the rows' layers (None: not allowed). gates: [R, K]."""
        if self.empty is None:
            return None
        return np.asarray(self.empty, float)[layer] * np.abs(gates).sum(axis=1) ** self.power

    def to_dict(self) -> dict:
        return {"kinds": list(KINDS), "nats": np.asarray(self.nats, float).tolist(),
                "empty": None if self.empty is None else np.asarray(self.empty, float).tolist(), "power": float(self.power)}

    @classmethod
    def from_dict(cls, doc: dict, what: str = "calibration") -> KindCalibration:
        """From `to_dict`'s form (a results file's `calibration`); raises EdgeMoEError naming `what` on bad input."""
        if not isinstance(doc, dict) or "nats" not in doc:
            raise EdgeMoEError(f"{what}: expected an object with 'nats' [3][L] (and optional 'empty', 'power')")
        if list(doc.get("kinds", KINDS)) != list(KINDS):
            raise EdgeMoEError(f"{what}: kinds must be {list(KINDS)} in that order, got {doc.get('kinds')}")
        try:
            nats = np.asarray(doc["nats"], dtype=float)
            empty = None if doc.get("empty") is None else np.asarray(doc["empty"], dtype=float)
            power = float(doc.get("power", QUALITY_POWER))
        except (TypeError, ValueError) as exc:
            raise EdgeMoEError(f"{what}: nats, empty and power must be numbers ({exc})") from None
        try:
            return cls(nats, empty, power)
        except EdgeMoEError as exc:
            raise EdgeMoEError(f"{what}: {exc}") from None
