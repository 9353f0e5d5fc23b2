"""What may stand in for an exact expert branch, and at what predicted quality cost (pure numpy).

Shared by the ordermoe runtime policy (`edgemoe.runtime.policies.ordermoe.stand_in_costs`, `layer_options`) and the
planner's runtime model (`edgemoe.plan.ordermoe.runtime_model.PathModel`), so the planner prices a placement with the very
stand-in choice the policy will make. It lives in `plan` because the runtime may import the planner's layer
and not the other way round (tests/test_layers.py).
"""

from __future__ import annotations

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
                     power: float = QUALITY_POWER) -> tuple[np.ndarray, np.ndarray]:
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
    if K:
        p = np.where((mask & (kind != 0)).all(axis=2, keepdims=True), np.inf, p)
    if power == 1.0:
        return kind, p
    layer_p = np.where(mask, p, 0.0).sum(axis=2, keepdims=True)  # [R, M, 1] the action's perturbation P
    with np.errstate(invalid="ignore"):  # inf x 0 in slots or actions not taken (replaced by the where)
        share = np.where(np.isfinite(layer_p), p * layer_p ** (power - 1.0), np.inf)
    return kind, np.where(mask, share, p ** power)
