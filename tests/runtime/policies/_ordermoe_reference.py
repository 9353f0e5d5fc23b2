"""The ordermoe decision as it was before the hot path was restructured (commit cd54dbb), kept verbatim as
the reference that `test_ordermoe_equivalence.py` compares the optimised policy and oracle with: every action
materialised as [R, A] arrays and every stand-in kind as [R, M, K, 3]."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgemoe.runtime.context import RuntimeContext
from edgemoe.runtime.policies.baselines import exact_decision
from edgemoe.runtime.policies.oracle import OraclePolicy
from edgemoe.runtime.policies.ordermoe import (
    EPS_S_PER_Q,
    KINDS,
    MAX_ENUM_K,
    QUALITY_POWER,
    STEER_ALL_NODES,
    STEER_REPLICAS,
    OrderMoEPolicy,
)
from edgemoe.runtime.policy import Decision, branch_ready_s, choose_replicas, meeting_node, replica_shortlist


@dataclass(frozen=True)
class Options:
    """The actions of R rows at one layer: M stand-in subsets, each with G meeting choices (G = 1 unsteered),
    A = M x G actions; action a is subset a // G with meeting choice a % G. Per-subset arrays are kept once
    (not repeated G times): only the chosen action's are gathered (`pick_decision`)."""

    mask: np.ndarray  # [R, M, K] bool: slot not run exactly (substituted, dropped or zeroed)
    valid_m: np.ndarray  # [R, M] bool: only replaceable slots replaced, each by an allowed stand-in
    experts: np.ndarray  # [R, M, K] expert run (-1: not run)
    node_m: np.ndarray  # [R, M, K] node running it (unsteered), or where a replaced slot runs (-1: not run)
    zeroed: np.ndarray  # [R, M, K] bool: not run and zeroed (else, when not run, dropped and renormalised)
    quality_m: np.ndarray  # [R, M]
    next_location: np.ndarray  # [R, A]
    latency_s: np.ndarray  # [R, A]
    exact_node: np.ndarray | None = None  # [R, G, K] steered: replica of each exact slot for meeting choice g

    @property
    def G(self) -> int:
        return 1 if self.exact_node is None else int(self.exact_node.shape[1])

    def per_action(self, x: np.ndarray) -> np.ndarray:
        """[R, M] -> [R, A]."""
        return x if self.G == 1 else np.repeat(x, self.G, axis=1)

    @property
    def quality(self) -> np.ndarray:
        return self.per_action(self.quality_m)

    @property
    def valid(self) -> np.ndarray:
        return self.per_action(self.valid_m)

    @property
    def any_replaced(self) -> np.ndarray:
        return self.per_action(self.mask.any(axis=2))


def stand_in_costs(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, topk: np.ndarray, gates: np.ndarray,
                   mask: np.ndarray, kinds: tuple[str, ...], power: float = QUALITY_POWER):
    """Per replaced slot, the stand-in with the least predicted quality cost, and that cost.

    layer, location: [R]; topk, gates: [R, K]; mask: [R, M, K] slots replaced by each action.
    Quality cost, in units of gate x relative output error ||Y - Y_e|| / ||Y_e|| (profile calibration):
    - sub: c's best-ranked local group member e' with the original gate: |g_k| * subst_err[l, e_k, e'];
    - zero: the branch's output is lost, the other gates stay: |g_k| * 1;
    - drop: the remaining gates are renormalised, so the slot's share goes to the exactly run slots j of the
      action: |g_k| * sum_j w_j subst_err[l, e_k, e_j] with w the renormalised weights (a triangle-inequality
      bound; for K = 2 it is exact: dropping k runs the other routed expert in its place).
    The cost charged is the power `power` of the layer's perturbation (the sum over the action's replaced
    slots), shared among them in proportion to each slot's perturbation (`standins.choose_stand_ins`).
    Returns (kind [R, M, K] index into KINDS, cost [R, M, K] (inf: no stand-in allowed), sub [R, K] ids).
    """
    R, K = topk.shape
    M = mask.shape[1]
    lk = layer[:, None]
    g = np.abs(gates)
    sub = ctx.best_sub[location[:, None], lk, topk] if "sub" in kinds else np.full((R, K), -1, np.int64)
    q_sub = np.where(sub >= 0, g * np.where(sub >= 0, ctx.best_sub_err[location[:, None], lk, topk], 0.0), np.inf)
    q_zero = g if "zero" in kinds else np.full((R, K), np.inf)
    if "drop" in kinds and K > 1:
        err = ctx.subst_err[lk[:, :, None], topk[:, :, None], topk[:, None, :]]  # [R, K, K] err of e_k -> e_j
        w = np.where(mask, 0.0, g[:, None, :])  # [R, M, K] weight of the slots run exactly
        wsum = w.sum(axis=2, keepdims=True)
        mix = np.einsum("rmj,rkj->rmk", w, err)
        q_drop = np.where(wsum > 0, g[:, None, :] * mix / np.where(wsum > 0, wsum, 1.0), np.inf)
    else:
        q_drop = np.full((R, M, K), np.inf)
    costs = np.stack([np.broadcast_to(q_sub[:, None, :], (R, M, K)), q_drop,
                      np.broadcast_to(q_zero[:, None, :], (R, M, K))], axis=-1)  # [R, M, K, 3] in KINDS order
    kind = costs.argmin(axis=-1)
    p = np.take_along_axis(costs, kind[..., None], -1)[..., 0]
    if K:  # no action may leave the layer without any expert output
        p = np.where((mask & (kind != 0)).all(axis=2, keepdims=True), np.inf, p)
    if power != 1.0:  # the power of the layer's perturbation, shared among its slots (issue 19)
        layer_p = np.where(mask, p, 0.0).sum(axis=2, keepdims=True)
        with np.errstate(invalid="ignore"):
            p = np.where(mask, np.where(np.isfinite(layer_p), p * layer_p ** (power - 1.0), np.inf), p ** power)
    return kind, p, sub


def layer_options(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, home: np.ndarray, usable: np.ndarray,
                  topk: np.ndarray, gates: np.ndarray, load: np.ndarray, max_enum_k: int = MAX_ENUM_K,
                  kinds: tuple[str, ...] = KINDS, steer: bool = False, steer_replicas: int = STEER_REPLICAS,
                  power: float = QUALITY_POWER) -> Options:
    """Every action for R rows (layer, location, home [R]; usable [R, N]; topk, gates [R, K]; load [N]).

    An action replaces a subset X of the non-local slots by their cheapest stand-in (`stand_in_costs`) and
    runs the others exactly. Unsteered (the myopic rule): exact slots go where `exact` sends them and the
    token meets its outputs by `meeting_node`'s earliest-finish rule. Steered (migrate mode): the action also
    names the meeting node g among the token's node and each slot's candidate replicas (exact's choice + the
    `steer_replicas` statically cheapest), and each exact slot runs on the replica whose output reaches g
    first; the token continues from g (which may hold none of this layer's experts: it is positioned for
    the next layers). A = M subsets unsteered, M x G steered with G = 1 + K (steer_replicas + 1).
    """
    R, K = topk.shape
    node_x = choose_replicas(ctx, layer, location, usable, topk, load, "fallback")
    local = node_x == location[:, None]
    if K <= max_enum_k:
        bits = ((np.arange(2 ** K)[:, None] >> np.arange(K)[None, :]) & 1).astype(bool)  # [M, K]
        mask = np.broadcast_to(bits[None], (R, 2 ** K, K))
    else:
        ready_x = branch_ready_s(ctx, layer, location, topk, node_x, load)
        order = np.argsort(-np.where(~local, ready_x, -np.inf), axis=1, kind="stable")  # non-local, slowest first
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(K)[None, :].repeat(R, 0), axis=1)
        mask = rank[:, None, :] < np.arange(K + 1)[None, :, None]  # prefix j replaces the j slowest
    M = mask.shape[1]
    kind, q_alt, sub = stand_in_costs(ctx, layer, location, topk, gates, mask, kinds, power)
    valid = ~(mask & (local[:, None, :] | ~np.isfinite(q_alt))).any(axis=2)
    is_sub = mask & (kind == 0)
    experts = np.where(mask, np.where(is_sub, sub[:, None, :], -1), topk[:, None, :])
    zeroed = mask & (kind == 2)
    quality = np.where(mask, np.where(np.isfinite(q_alt), q_alt, 0.0), 0.0).sum(axis=2)
    stand_node = np.where(is_sub, location[:, None, None], -1)  # [R, M, K] where a replaced slot runs
    if not steer or ctx.mode == "home":
        node = np.where(mask, stand_node, node_x[:, None, :])
        loc_m = np.broadcast_to(location[:, None], (R, M))
        layer_m = np.broadcast_to(layer[:, None], (R, M))
        ready = branch_ready_s(ctx, layer_m, loc_m, experts, node, load)
        nxt, lat = meeting_node(ctx, layer_m, loc_m, np.broadcast_to(home[:, None], (R, M)), node, ready)
        return Options(mask=mask, valid_m=valid, experts=experts, node_m=node, zeroed=zeroed, quality_m=quality,
                       next_location=nxt, latency_s=lat)
    # -- steered: candidate runners per slot [R, K, J] and meeting nodes [R, G]
    xfer, comp = ctx.xfer_s, ctx.compute_s
    short, real = replica_shortlist(ctx, "fallback").candidates(layer, location, topk, steer_replicas)
    cand = np.concatenate([node_x[:, :, None], short], axis=2)  # exact's own choice first
    ok = np.concatenate([np.ones((R, K, 1), bool), real], axis=2)
    ok &= np.take_along_axis(usable[:, None, :], cand.reshape(R, 1, -1), 2).reshape(cand.shape)
    cand = np.where(ok, cand, node_x[:, :, None])
    J = cand.shape[2]
    lk = layer[:, None, None]
    base = xfer[location[:, None, None], cand] + load[cand] + comp[cand, lk, topk[:, :, None]]  # [R, K, J]
    base = np.where(ok, base, np.inf)
    if ctx.num_nodes <= STEER_ALL_NODES:  # every node it may use (location first)
        meet = np.concatenate([location[:, None], np.broadcast_to(np.arange(ctx.num_nodes), (R, ctx.num_nodes))], 1)
        meet = np.where(np.take_along_axis(usable, meet, 1), meet, location[:, None])
    else:
        meet = np.concatenate([location[:, None], cand.reshape(R, K * J)], axis=1)  # [R, G]
    G = meet.shape[1]
    N = ctx.num_nodes
    arrive = base[..., None] + xfer.reshape(-1).take(cand[..., None] * N + meet[:, None, None, :])  # [R, K, J, G]
    best_j = arrive.argmin(axis=2)  # [R, K, G]
    exact_node = np.take_along_axis(cand, best_j, 2)  # [R, K, G] replica that serves meeting node g
    exact_arr = np.take_along_axis(arrive, best_j[:, :, None, :], 2)[:, :, 0, :]  # [R, K, G]
    sub_ok = sub >= 0
    sub_arr = (load[location][:, None] + comp[location[:, None], layer[:, None], np.where(sub_ok, sub, 0)])[:, :, None] \
        + xfer[location[:, None, None], meet[:, None, :]]  # [R, K, G]
    ex = np.moveaxis(exact_arr, 1, 2)[:, None]  # [R, 1, G, K]
    sa = np.moveaxis(sub_arr, 1, 2)[:, None]
    m4, s4 = mask[:, :, None, :], is_sub[:, :, None, :]
    arr = np.where(m4, np.where(s4, sa, -np.inf), ex)  # [R, M, G, K]
    lat = np.max(arr, axis=-1, initial=0.0)  # [R, M, G]
    last = layer == ctx.num_layers - 1
    if last.any():
        lat = lat + np.where(last[:, None], xfer[meet, home[:, None]], 0.0)[:, None, :]
    return Options(mask=mask, valid_m=valid, experts=experts, node_m=stand_node, zeroed=zeroed, quality_m=quality,
                   next_location=np.broadcast_to(meet[:, None, :], (R, M, G)).reshape(R, M * G),
                   latency_s=lat.reshape(R, M * G), exact_node=np.moveaxis(exact_node, 1, 2))


def pick_decision(opt: Options, pick: np.ndarray, location: np.ndarray) -> Decision:
    """The Decision made of action `pick` [T] of each row of `opt`."""
    rows = np.arange(len(pick))
    m, g = np.divmod(pick, opt.G)
    mask = opt.mask[rows, m]
    node = opt.node_m[rows, m] if opt.exact_node is None else np.where(mask, opt.node_m[rows, m], opt.exact_node[rows, g])
    zeroed = opt.zeroed[rows, m]
    return Decision(experts=opt.experts[rows, m], node=node, location=location.copy(),
                    next_location=opt.next_location[rows, pick], quality_cost=opt.quality_m[rows, m],
                    latency_s=opt.latency_s[rows, pick], zeroed=zeroed if zeroed.any() else None)


class ReferenceOrderMoE(OrderMoEPolicy):
    """`ordermoe` with the reference decision (same tables, same adaptive weights)."""

    def choose(self, layer, topk, gates, state, load):  # the pre-optimisation decision, verbatim but the weights
        ctx = self.ctx
        # the adaptive weights as the policy has them now: the queue pressure steps once per row
        # (`OrderMoEPolicy.pressures`), where at cd54dbb it stepped once per call after the decision
        pressure = self.pressures(load, len(state))
        has_budget = state.budget_total > 0
        if len(state) == 0 or not (self.steer or has_budget.any()):
            return exact_decision(ctx, layer, topk, state, load)  # no budget and no steering: exactly `exact`
        loc = state.location
        opt = layer_options(ctx, layer, loc, state.home, ctx.usable[state.user], topk, gates, load, self.max_enum_k,
                            self.kinds, self.steer, self.steer_replicas, self.power)
        quality = opt.quality
        left = state.budget_left[:, None] - quality  # [T, A]
        feasible = opt.valid & (left >= -1e-12) & (~opt.any_replaced | has_budget[:, None])
        key = self.lookahead.keys.keys(layer, topk, gates)
        _, N, C, m = self.lookahead.stacked.shape
        flat = (((layer[:, None] + 1) * N + opt.next_location) * C + key[:, None]) * m + self.grid.index(np.maximum(left, 0.0))
        future = self.lookahead.stacked.reshape(-1).take(flat)  # [T, A]: one flat gather
        beta = self.beta(layer, state)[:, None]
        alpha = self.latency_weights(pressure, state.user)
        cost = alpha[:, None] * (opt.latency_s + future) + (beta + EPS_S_PER_Q) * quality
        pick = np.where(feasible, cost, np.inf).argmin(axis=1)  # action 0 (no substitution) is always feasible
        return pick_decision(opt, pick, loc)


class ReferenceOracle(OraclePolicy):
    """`oracle` whose dynamic program and decisions use the reference actions."""

    def path_values(self, users, tokens, has_budget):
        return _with_reference_actions(OraclePolicy.path_values, self, users, tokens, has_budget)

    def choose(self, layer, topk, gates, state, load):
        return _with_reference_actions(OraclePolicy.choose, self, layer, topk, gates, state, load)


def _with_reference_actions(fn, *args):
    import edgemoe.runtime.policies.oracle as oracle

    saved = oracle.layer_options, oracle.pick_decision
    oracle.layer_options, oracle.pick_decision = layer_options, pick_decision
    try:
        return fn(*args)
    finally:
        oracle.layer_options, oracle.pick_decision = saved
