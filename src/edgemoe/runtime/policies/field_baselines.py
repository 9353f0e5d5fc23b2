"""The field's answers to a remote expert, as runtime policies (issue 19; pure numpy, vectorised over rows).

OrderMoE's gain has to be measured against what any serving system can do when a token's expert lives on
another server. Each policy here runs the branches it keeps by `exact`'s rule (the token's node if it holds
the expert, else the cheapest replica with the load it sees; in migrate mode the earliest-finish meeting
node), and may replace *remote* branches (the token's node does not hold the routed expert) within a
budget:

- `skip` (budgeted expert skipping): drop the branch and renormalise the remaining gates. At least one
  branch always runs (there is nothing to renormalise onto otherwise).
- `reroute` (local re-routing, as cache-conditional and capacity-aware routing do): run instead the
  token's next-best *local* expert by its own router logits, with the original gate.
- `random-local` (the control): run a uniformly random local expert instead (seeded), original gate.
  For both: local candidates are the node's experts of the layer that the token did not route to (two
  slots never run one expert); with fewer candidates than replaced slots, the slots left over (lowest
  gates) are dropped and renormalised, as routing among cached experts runs fewer than K when fewer are
  cached. At least one branch always runs.

The budget rule is the same for all three (the field's unit, not OrderMoE's measured error): replacing
slot k costs its gate share |g_k| / sum_j |g_j|, so the top-1 branch is the most expensive and is replaced
only when the budget allows it. A row's budget is `budget` x L (per token-layer allowance, as every
policy's); with `pace` (default) it accrues layer by layer: after layer l the row has spent at most
budget x (l + 1). Within a layer the policy takes the subset of remote slots, affordable from what is
available, that finishes the layer first (ties: the cheaper, then the lower subset index; the empty
subset, exact execution, is always affordable). Subsets are enumerated for K <= MAX_ENUM_K, else the K+1
prefixes of the remote slots by readiness (slowest first), as OrderMoE does.

Where the router logits come from (`reroute`): the `local` backend hands the real ones of every token and
layer (`LayerCall.router_logits`, via `decide(..., router_logits=)`). Backends that replay routing without
logits (the simulator, Ray servers) fall back to the calibration profile: local candidates are ranked by
how often the profile's calibration tokens routed them together with the token's routed experts
(co-selection counts; frequency breaks ties). Assumption: that choice changes only *which* local expert
runs, never the node or the seconds (experts of a layer have equal cost in the shipped models: one FFN
shape), so the simulator's latency equals what the real per-token choice would give; quality is always
measured in the `local` backend with the real logits.

`ordermoe-error-groups` is OrderMoE's runtime with the substitutes taken from groups built on *measured*
substitution error (`edgemoe.profile.groups.error_groups`) instead of the router-cosine groups that the
context carries; everything else (placement, look-ahead, stand-in pricing) is `ordermoe`'s.
`ordermoe-calibrated` is OrderMoE's runtime with each stand-in kind's predicted error rescaled so that
a unit of predicted cost buys the same measured perplexity whichever kind spends it (`kind_scales`).
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.plan.ordermoe.standins import MAX_ENUM_K, prefix_masks, subset_bits
from edgemoe.profile.groups import MAX_ERR, error_groups

from ..context import RuntimeContext, best_local_substitutes
from ..policy import Decision, Policy, TokenState, branch_ready_s, choose_replicas, meeting_node
from .ordermoe import (  # (the co-selection lives with ordermoe's per-token stand-ins)
    OrderMoEPolicy,
    coselection_counts,
)

STAND_INS = ("drop", "reroute", "random")


def gate_share(gates: np.ndarray) -> np.ndarray:
    """[T, K] each slot's share |g_k| / sum_j |g_j| of the row's gate mass (0 where the row has none)."""
    g = np.abs(gates)
    total = g.sum(axis=1, keepdims=True)
    return np.divide(g, total, out=np.zeros_like(g), where=total > 0)


def available_budget(allowance: np.ndarray, layer: np.ndarray, state: TokenState, pace: bool) -> np.ndarray:
    """[T] budget a row may spend at `layer` [T]: what has accrued (allowance x (layer + 1), paced) or all
    that is left (not paced), minus what it has spent; never below 0. allowance: [T] per token-layer."""
    cap = np.minimum(allowance * (layer + 1), state.budget_total) if pace else state.budget_total
    return np.maximum(cap - state.budget_used, 0.0)


def assign_stand_ins(score: np.ndarray, candidate: np.ndarray, mask: np.ndarray, gates: np.ndarray) -> np.ndarray:
    """[T, M, K] the local expert standing in for each replaced slot (-1: not replaced, or no candidate left).

    score: [T, E] preference of each expert (higher first); candidate: [T, E] bool may stand in (local and
    not routed); mask: [T, M, K] slots replaced by each action. Within an action the replaced slots, by
    descending gate (ties: slot order), take the candidates in descending score (ties: lower id), one each,
    so two replaced slots never run the same expert."""
    T, M, K = mask.shape
    ranked = np.argsort(-np.where(candidate, score, -np.inf), axis=1, kind="stable")  # [T, E] best first
    n_cand = candidate.sum(axis=1)  # [T]
    by_gate = np.argsort(-np.abs(gates), axis=1, kind="stable")  # [T, K] slots by descending gate
    ordered = np.take_along_axis(mask, np.broadcast_to(by_gate[:, None, :], mask.shape), axis=2)
    rank_sorted = np.cumsum(ordered, axis=2) - 1  # [T, M, K] rank of each replaced slot, in gate order
    rank = np.empty_like(rank_sorted)
    np.put_along_axis(rank, np.broadcast_to(by_gate[:, None, :], mask.shape), rank_sorted, axis=2)
    ok = mask & (rank < n_cand[:, None, None])
    pick = np.take_along_axis(ranked, np.clip(rank, 0, ranked.shape[1] - 1).reshape(T, -1), axis=1).reshape(T, M, K)
    return np.where(ok, pick, -1)


class RemoteStandInPolicy(Policy):
    """Exact execution, with remote branches replaced within a gate-share budget (see the module docstring).

    Subclasses set `stand_in`: "drop" (skip), "reroute" or "random"."""

    stand_in = "drop"

    def __init__(self, ctx: RuntimeContext, budget=0.05, pace: bool = True, **params):
        super().__init__(ctx, budget=budget, pace=bool(pace), **params)
        self.pace = bool(pace)

    # -- which expert stands in ---------------------------------------------------------------------------
    def stand_in_scores(self, layer: np.ndarray, topk: np.ndarray, gates: np.ndarray) -> np.ndarray:
        """[T, E] preference among local experts (higher first); only `reroute` and `random` use it."""
        raise NotImplementedError

    def choose(self, layer, topk, gates, state, load):
        ctx, loc = self.ctx, state.location
        T, K = topk.shape
        node_x = choose_replicas(ctx, layer, loc, ctx.usable[state.user], topk, load, "fallback")
        remote = node_x != loc[:, None]
        ready_x = branch_ready_s(ctx, layer, loc, topk, node_x, load)
        if K <= MAX_ENUM_K:
            mask = np.broadcast_to(subset_bits(K)[None], (T, 2 ** K, K))
        else:
            _, mask = prefix_masks(ready_x, remote)
        M = mask.shape[1]
        cost = (mask * gate_share(gates)[:, None, :]).sum(axis=2)  # [T, M]
        avail = available_budget(self.allowance[state.user], layer, state, self.pace)
        valid = ~(mask & ~remote[:, None, :]).any(axis=2) & (cost <= avail[:, None] + 1e-12)
        if self.stand_in == "drop":
            experts = np.where(mask, -1, topk[:, None, :])
            if K:
                valid &= ~mask.all(axis=2)  # something must run to renormalise onto
        else:
            held = ctx.hosts[loc[:, None], layer[:, None], np.arange(ctx.num_experts)[None, :]]  # [T, E]
            routed = np.zeros_like(held)
            np.put_along_axis(routed, topk, True, axis=1)
            sub = assign_stand_ins(self.stand_in_scores(layer, topk, gates), held & ~routed, mask, gates)
            # fewer local candidates than replaced slots: the rest are dropped and renormalised, as routing among
            # the cached experts runs fewer than K when fewer are cached; something must still run
            experts = np.where(mask, sub, topk[:, None, :])
            if K:
                valid &= (experts >= 0).any(axis=2)
        node = np.where(experts >= 0, np.where(mask, loc[:, None, None], node_x[:, None, :]), -1)
        lat = np.empty((T, M))
        nxt = np.empty((T, M), np.int64)
        for m in range(M):  # M <= 16: each subset's layer time by `exact`'s own arithmetic
            ready = branch_ready_s(ctx, layer, loc, experts[:, m], node[:, m], load)
            nxt[:, m], lat[:, m] = meeting_node(ctx, layer, loc, state.home, node[:, m], ready)
        # the fastest affordable subset; ties: the cheaper, then the lower index (subset 0 = exact: always valid)
        key = np.where(valid, lat, np.inf)
        best = key.min(axis=1, keepdims=True)
        pick = np.where(key == best, cost, np.inf).argmin(axis=1)
        rows = np.arange(T)
        return Decision(experts=experts[rows, pick], node=node[rows, pick], location=loc.copy(),
                        next_location=nxt[rows, pick], quality_cost=cost[rows, pick], latency_s=lat[rows, pick])


class SkipPolicy(RemoteStandInPolicy):
    """Budgeted expert skipping: remote branches dropped and the rest renormalised, within the budget."""

    name = "skip"
    stand_in = "drop"

    def __init__(self, ctx: RuntimeContext, budget=0.05, pace: bool = True):
        super().__init__(ctx, budget=budget, pace=pace)


class RerouteLocalPolicy(RemoteStandInPolicy):
    """Local re-routing: a remote branch goes to the token's next-best local expert by its router logits."""

    name = "reroute"
    stand_in = "reroute"
    wants_router_logits = True  # the local backend passes `router_logits` to `decide`

    def __init__(self, ctx: RuntimeContext, budget=0.05, pace: bool = True):
        super().__init__(ctx, budget=budget, pace=pace)
        self._logits: np.ndarray | None = None
        self.coselect = coselection_counts(ctx.profile_topk, ctx.num_experts)  # [L, E, E] the fallback's ranking
        self.logit_layers = 0  # layers decided with real router logits (the rest used the profile's ranking)

    def decide(self, layer, topk, gates, state, load_s=None, router_logits=None):
        """`Policy.decide`; router_logits [T, E] (optional): the tokens' real router logits at this layer."""
        if router_logits is not None:
            router_logits = np.asarray(router_logits, dtype=float)
            if router_logits.shape != (len(state), self.ctx.num_experts):
                raise EdgeMoEError(f"router_logits must be [T={len(state)}, E={self.ctx.num_experts}], "
                                   f"got {router_logits.shape}")
            self.logit_layers += 1
        self._logits = router_logits
        try:
            return super().decide(layer, topk, gates, state, load_s)
        finally:
            self._logits = None

    def stand_in_scores(self, layer, topk, gates):
        if self._logits is not None:
            return self._logits
        # no logits: how often calibration tokens routed each expert together with this token's routed ones
        co = self.coselect[layer[:, None], topk].sum(axis=1)  # [T, E]
        freq = self.ctx.freq[layer]  # [T, E] tie-break: the more frequent expert first
        return co + freq / (freq.max() + 1.0)


class RandomLocalPolicy(RemoteStandInPolicy):
    """The control: a remote branch goes to a uniformly random local expert (seeded), original gate."""

    name = "random-local"
    stand_in = "random"

    def __init__(self, ctx: RuntimeContext, budget=0.05, pace: bool = True, seed: int = 0):
        super().__init__(ctx, budget=budget, pace=pace, seed=seed)
        self.rng = np.random.default_rng(seed)

    def stand_in_scores(self, layer, topk, gates):
        return self.rng.random((topk.shape[0], self.ctx.num_experts))


def with_groups(ctx: RuntimeContext, groups) -> RuntimeContext:
    """`ctx` with other substitute groups: the groups and the best local substitute tables rebuilt from them."""
    best_sub, best_err = best_local_substitutes(ctx.hosts, groups.substitute_ids, ctx.subst_err)
    for a in (best_sub, best_err):
        a.setflags(write=False)
    return replace(ctx, groups=groups, best_sub=best_sub, best_sub_err=best_err)


def context_error_groups(ctx: RuntimeContext, max_err: float = MAX_ERR):
    """Measured-error groups from the context's own arrays. The context keeps no router cosine, which
    `error_groups` reads only to break ranking ties (equal measured errors) and to report `substitute_sim`:
    here ties fall to the lower id and `substitute_sim` is 0."""
    view = SimpleNamespace(sim=np.zeros_like(ctx.subst_err), freq=ctx.freq, subst_err=ctx.subst_err)
    return error_groups(view, max_err=max_err)


class OrderMoEErrorGroupsPolicy(OrderMoEPolicy):
    """`ordermoe` with substitutes from measured-error groups (max_err: the largest symmetric error two
    group members may have); every other parameter is `ordermoe`'s."""

    name = "ordermoe-error-groups"

    def __init__(self, ctx: RuntimeContext, budget=0.05, horizon: int = 2, max_err: float = MAX_ERR, **params):
        super().__init__(with_groups(ctx, context_error_groups(ctx, max_err)), budget=budget, horizon=horizon, **params)
        self.params["max_err"] = float(max_err)


def with_error_scales(ctx: RuntimeContext, sub_scale: float = 1.0, drop_scale: float = 1.0) -> RuntimeContext:
    """`ctx` whose predicted stand-in errors are rescaled per kind: a substitute's measured error by sub_scale,
    the routed experts' mutual errors (what dropping is priced with) by drop_scale; zeroing stays at 1."""
    if not (sub_scale > 0 and drop_scale > 0 and np.isfinite([sub_scale, drop_scale]).all()):
        raise EdgeMoEError(f"sub_scale and drop_scale must be finite and > 0, got {sub_scale}, {drop_scale}")
    sub_err, err = ctx.best_sub_err * float(sub_scale), ctx.subst_err * float(drop_scale)
    for a in (sub_err, err):
        a.setflags(write=False)
    return replace(ctx, best_sub_err=sub_err, subst_err=err)


class OrderMoECalibratedPolicy(OrderMoEPolicy):
    """`ordermoe` whose stand-in kinds are priced on one measured scale (issue 19, section 2): sub_scale and
    drop_scale multiply the predicted perturbation of a substitute and of a drop, so that a unit of predicted
    quality cost buys the same measured perplexity whichever kind spends it (`kind_scales` calibrates them
    on calibration text; zeroing is the reference). Every other parameter is `ordermoe`'s."""

    name = "ordermoe-calibrated"

    def __init__(self, ctx: RuntimeContext, budget=0.05, horizon: int = 2, sub_scale: float = 1.0,
                 drop_scale: float = 1.0, **params):
        super().__init__(with_error_scales(ctx, sub_scale, drop_scale), budget=budget, horizon=horizon, **params)
        self.params.update(sub_scale=float(sub_scale), drop_scale=float(drop_scale))


def kind_scales(nats: dict, spent: dict, power: float = 2.0) -> dict:
    """{"sub_scale", "drop_scale"} from one calibration run per stand-in kind: nats[kind] the measured extra
    nats per token with only that kind allowed, spent[kind] the predicted quality cost those runs spent per
    token. Measured nats per unit of cost r_k = nats / spent; the cost is perturbation ** power, so kind k's
    perturbation is rescaled by (r_k / r_zero) ** (1 / power). A kind that spent nothing, or whose measured
    rise is not positive, keeps scale 1 (nothing to learn from)."""
    def rate(kind):
        return nats[kind] / spent[kind] if spent.get(kind, 0) > 0 and nats.get(kind, 0) > 0 else None

    ref = rate("zero")
    out = {}
    for kind in ("sub", "drop"):
        r = rate(kind)
        out[f"{kind}_scale"] = float((r / ref) ** (1.0 / power)) if r and ref else 1.0
    return out


def _with_ordermoe_signature(init, extra: dict):
    """`init`'s signature made of `OrderMoEPolicy.__init__`'s plus `extra` {name: default float}, so parameter
    checks (`policy_params`) see every ordermoe parameter by name rather than a bare **params."""
    base = inspect.signature(OrderMoEPolicy.__init__)
    more = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v, annotation="float") for k, v in extra.items()]
    init.__signature__ = base.replace(parameters=[*base.parameters.values(), *more])
    init.__annotations__ = {**OrderMoEPolicy.__init__.__annotations__, **dict.fromkeys(extra, "float")}
    return init


OrderMoEErrorGroupsPolicy.__init__ = _with_ordermoe_signature(OrderMoEErrorGroupsPolicy.__init__, {"max_err": MAX_ERR})
OrderMoECalibratedPolicy.__init__ = _with_ordermoe_signature(OrderMoECalibratedPolicy.__init__,
                                                             {"sub_scale": 1.0, "drop_scale": 1.0})
