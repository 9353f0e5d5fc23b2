"""OrderMoE's runtime: quality- and trajectory-aware server-expert selection (ALGORITHMS.md §3.4.4).

Per token row and layer, with the token at node c, routed experts A [K] and gates g [K]:

- exact option: each branch on c if c holds it, else the cheapest usable replica (the `exact` policy);
- a non-local branch k may instead run c's best-ranked local substitute e'(k) (same similarity group,
  lowest measured error first) with the original gate; its quality cost is q_k = g_k * subst_err[l, e, e'];
- actions X are subsets of the substitutable branches: all 2^K subsets for K <= `max_enum_k`, otherwise the
  K+1 prefixes of the branches ordered by remote latency (the only Pareto-optimal subsets for the max);
- feasible iff q(X) <= remaining budget of the row (and the row has a budget at all);
- choose argmin J(X) = alpha * (lat(X) + Phi_H[l+1](next(X), top1(A), b - q(X))) + (beta + eps) * q(X).

Phi_H is the expected latency of the next H layers when they spend the remaining budget as well as possible,
from precomputed tables (`LookAhead`), so the online step is a lookup. H = 0 is the myopic ablation.
alpha grows with observed queueing / latency excess; beta paces the budget (docs/runtime.md).
With a zero budget every substitution is infeasible and the decision is exactly `exact`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError

from .baselines import exact_decision
from .context import RuntimeContext
from .policy import (
    Decision,
    Policy,
    TokenState,
    branch_ready_s,
    choose_replicas,
    meeting_node,
    top1,
)

EPS_S_PER_Q = 1e-9  # tie-break: between equally fast actions, spend no budget
MAX_ENUM_K = 4  # enumerate all 2^K subsets up to K = 4 (16 actions); prefixes beyond


@dataclass(frozen=True)
class Options:
    """The actions of R rows at one layer. M actions per row."""

    mask: np.ndarray  # [R, M, K] bool: slot substituted
    valid: np.ndarray  # [R, M] bool: only substitutable slots substituted
    experts: np.ndarray  # [R, M, K]
    node: np.ndarray  # [R, M, K]
    next_location: np.ndarray  # [R, M]
    latency_s: np.ndarray  # [R, M]
    quality: np.ndarray  # [R, M]


def layer_options(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, home: np.ndarray, usable: np.ndarray,
                  topk: np.ndarray, gates: np.ndarray, load: np.ndarray, max_enum_k: int = MAX_ENUM_K) -> Options:
    """Every substitution action for R rows (layer, location, home [R]; usable [R, N]; topk, gates [R, K])."""
    R, K = topk.shape
    node_x = choose_replicas(ctx, layer, location, usable, topk, load, "fallback")
    local = node_x == location[:, None]
    sub = ctx.best_sub[location[:, None], layer[:, None], topk]  # [R, K]
    can = ~local & (sub >= 0)
    q_slot = np.where(can, np.abs(gates) * np.where(can, ctx.best_sub_err[location[:, None], layer[:, None], topk], 0.0), 0.0)
    if K <= max_enum_k:
        bits = ((np.arange(2 ** K)[:, None] >> np.arange(K)[None, :]) & 1).astype(bool)  # [M, K]
        mask = np.broadcast_to(bits[None], (R, 2 ** K, K))
    else:
        ready_x = branch_ready_s(ctx, layer, location, topk, node_x, load)
        order = np.argsort(-np.where(can, ready_x, -np.inf), axis=1, kind="stable")  # substitutable, slowest first
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(K)[None, :].repeat(R, 0), axis=1)
        mask = rank[:, None, :] < np.arange(K + 1)[None, :, None]  # prefix j substitutes the j slowest
    valid = ~(mask & ~can[:, None, :]).any(axis=2)
    experts = np.where(mask, sub[:, None, :], topk[:, None, :])
    node = np.where(mask, location[:, None, None], node_x[:, None, :])
    M = mask.shape[1]
    loc_m = np.broadcast_to(location[:, None], (R, M))
    layer_m = np.broadcast_to(layer[:, None], (R, M))
    ready = branch_ready_s(ctx, layer_m, loc_m, experts, node, load)
    nxt, lat = meeting_node(ctx, layer_m, loc_m, np.broadcast_to(home[:, None], (R, M)), node, ready)
    quality = (mask * q_slot[:, None, :]).sum(axis=2)
    return Options(mask=mask, valid=valid, experts=experts, node=node, next_location=nxt, latency_s=lat, quality=quality)


class BudgetGrid:
    """m levels 0, d, 2d, ... of remaining budget; a remaining budget maps to the level at or below it."""

    def __init__(self, max_budget: float, levels: int):
        self.levels = int(levels) if max_budget > 0 else 1
        self.step = max_budget / (self.levels - 1) if self.levels > 1 else 1.0
        self.values = np.arange(self.levels) * self.step  # [m]

    def index(self, remaining: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(np.asarray(remaining) / self.step + 1e-9), 0, self.levels - 1).astype(np.int64)


@dataclass(frozen=True)
class SetStats:
    """Representative Top-K sets of one layer given the previous layer's top-1 expert (calibration trace)."""

    experts: np.ndarray  # [M, K] sorted expert ids of each distinct set kept
    gates: np.ndarray  # [M, K] mean gates aligned with `experts`
    prob: np.ndarray  # [E, M] P(set | previous top-1), rows sum to 1


def set_stats(topk: np.ndarray, gates: np.ndarray, layer: int, num_experts: int, per_prev: int) -> SetStats:
    """The `per_prev` most frequent Top-K sets at `layer` after each top-1 expert at layer-1 (topk, gates [T, L, K]).

    Previous experts never seen as top-1 fall back to the layer's overall set frequencies.
    """
    E = num_experts
    order = np.argsort(topk[:, layer], axis=1)
    sets = np.take_along_axis(topk[:, layer], order, 1)
    set_gates = np.take_along_axis(gates[:, layer], order, 1)
    prev = top1(topk[:, layer - 1], gates[:, layer - 1])
    keys, inverse = np.unique(sets, axis=0, return_inverse=True)
    inverse = inverse.ravel()
    counts = np.zeros((E, len(keys)))
    np.add.at(counts, (prev, inverse), 1.0)
    overall = counts.sum(axis=0)
    counts[counts.sum(axis=1) == 0] = overall
    keep_rank = np.argsort(-counts, axis=1, kind="stable")[:, :per_prev]  # [E, S]
    kept_cols = np.unique(keep_rank)
    trimmed = np.zeros_like(counts)
    np.put_along_axis(trimmed, keep_rank, np.take_along_axis(counts, keep_rank, 1), 1)
    trimmed = trimmed[:, kept_cols]
    prob = trimmed / trimmed.sum(axis=1, keepdims=True)
    mean_gates = np.zeros((len(keys), sets.shape[1]))
    np.add.at(mean_gates, inverse, set_gates)
    mean_gates /= np.maximum(np.bincount(inverse, minlength=len(keys)), 1)[:, None]
    return SetStats(experts=keys[kept_cols], gates=mean_gates[kept_cols], prob=prob)


class LookAhead:
    """Cost-to-go tables phi[l] [N, E, m]: expected seconds of layers l .. l+H-1 for a token at node c whose
    previous-layer top-1 expert was e, with remaining budget level b, when those layers act optimally.

    Built once per (context, budget grid, H) by the truncated recursion of ALGORITHMS.md §3.4.4 with static
    costs (no queues); `phi(l)` is zero for l >= L and for H = 0.
    """

    def __init__(self, ctx: RuntimeContext, grid: BudgetGrid, horizon: int, sets_per_prev: int = 4,
                 max_enum_k: int = MAX_ENUM_K):
        self.ctx, self.grid, self.horizon = ctx, grid, int(horizon)
        N, L, E = ctx.num_nodes, ctx.num_layers, ctx.num_experts
        self.zero = np.zeros((N, E, grid.levels))
        self.tables: dict[int, np.ndarray] = {}
        self.stacked = np.zeros((L + 1, N, E, grid.levels))  # [L+1, N, E, m]: phi(l) for every l
        if self.horizon <= 0 or L < 2:
            return
        stats = {layer: set_stats(ctx.profile_topk, ctx.profile_gates, layer, E, sets_per_prev) for layer in range(1, L)}
        # values[l] for each depth: one layer's expected optimal cost over its sets, recursively.
        prev_depth: dict[int, np.ndarray] = {}
        for _depth in range(1, self.horizon + 1):
            cur = {}
            for layer in range(1, L):
                nxt = prev_depth.get(layer + 1, self.zero)
                cur[layer] = self._layer_table(layer, stats[layer], nxt, max_enum_k)
            prev_depth = cur
        self.tables = prev_depth
        for layer, table in self.tables.items():
            self.stacked[layer] = table

    def phi(self, layer: int) -> np.ndarray:
        """[N, E, m] table for decisions that start at `layer` (zeros past the end or with H = 0)."""
        return self.tables.get(layer, self.zero)

    def _layer_table(self, layer: int, stats: SetStats, phi_next: np.ndarray, max_enum_k: int) -> np.ndarray:
        ctx, grid = self.ctx, self.grid
        N, M = ctx.num_nodes, stats.experts.shape[0]
        loc = np.repeat(np.arange(N), M)  # rows = (node, set)
        experts = np.tile(stats.experts, (N, 1))
        gates = np.tile(stats.gates, (N, 1))
        # A token at c may use every non-device node and c itself (other users' devices serve no one else).
        is_device = np.array([k == "device" for k in ctx.node_kind])
        usable = ~is_device[None, :] | (np.arange(N)[None, :] == loc[:, None])
        opt = layer_options(ctx, np.full(len(loc), layer), loc, loc, usable, experts, gates, np.zeros(N), max_enum_k)
        t1 = top1(experts, gates)  # [R]
        b = grid.values  # [m]
        left = b[None, None, :] - opt.quality[:, :, None]  # [R, A, m]
        feasible = opt.valid[:, :, None] & (left >= -1e-12)
        future = phi_next[opt.next_location[:, :, None], t1[:, None, None], grid.index(np.maximum(left, 0.0))]
        value = opt.latency_s[:, :, None] + EPS_S_PER_Q * opt.quality[:, :, None] + future
        best = np.where(feasible, value, np.inf).min(axis=1)  # [R, m]
        best = best.reshape(N, M, grid.levels)
        return np.einsum("es,nsm->nem", stats.prob, best)


class OrderMoEPolicy(Policy):
    """OrderMoE runtime policy. Parameters (defaults and units in docs/runtime.md):

    budget: quality allowance per token-layer (gate-weighted substitution error), scalar or [U];
    horizon: look-ahead depth H; levels: budget grid size m; quality_price: beta_0 in seconds per unit of
    quality cost (None: half the median round trip per token-layer allowance); pressure_gain: kappa of the
    latency weight; sets_per_prev: Top-K sets kept per previous top-1 in the tables; max_enum_k.
    """

    name = "ordermoe"

    def __init__(self, ctx: RuntimeContext, budget=0.05, horizon: int = 2, levels: int = 24,
                 quality_price: float | None = None, pressure_gain: float = 1.0, sets_per_prev: int = 4,
                 max_enum_k: int = MAX_ENUM_K, ewma: float = 0.1):
        super().__init__(ctx, budget=budget, horizon=horizon, levels=levels, quality_price=quality_price,
                         pressure_gain=pressure_gain, sets_per_prev=sets_per_prev, max_enum_k=max_enum_k, ewma=ewma)
        if horizon < 0 or levels < 2:
            raise EdgeMoEError(f"ordermoe: horizon must be >= 0 and levels >= 2, got {horizon}, {levels}")
        self.horizon, self.max_enum_k, self.ewma = int(horizon), int(max_enum_k), float(ewma)
        self.rt_med = max(ctx.median_round_trip_s(), 1e-6)
        mean_allowance = float(self.allowance.mean())
        self.quality_price = (0.5 * self.rt_med / mean_allowance if mean_allowance > 0 else 0.0) \
            if quality_price is None else float(quality_price)
        self.pressure_gain = float(pressure_gain)
        self.grid = BudgetGrid(float(self.allowance.max()) * ctx.num_layers, levels)
        self.lookahead = LookAhead(ctx, self.grid, self.horizon, sets_per_prev, max_enum_k)
        self.queue_pressure = 0.0  # EWMA of mean queueing delay / (it + median round trip)
        self.latency_excess = 0.0  # EWMA of max(observed / estimated layer latency - 1, 0)
        self._estimate = None  # EWMA of the policy's own layer-latency estimates

    @property
    def alpha(self) -> float:
        """Latency weight: 1 without pressure, up to 1 + 2 * pressure_gain under heavy queues / slow links."""
        return 1.0 + self.pressure_gain * (self.queue_pressure + min(self.latency_excess, 1.0))

    def beta(self, layer: np.ndarray, state: TokenState) -> np.ndarray:
        """[T] quality weight: quality_price x (share of budget used) / (share of layers done). layer: [T]."""
        progress = (layer + 0.5) / self.ctx.num_layers
        used = np.divide(state.budget_used, state.budget_total, out=np.zeros(len(state)), where=state.budget_total > 0)
        return self.quality_price * used / progress

    def observe(self, layer_latency_s) -> None:
        obs = np.asarray(layer_latency_s, dtype=float)
        if obs.size and self._estimate:
            ratio = float(obs.mean()) / self._estimate - 1.0
            self.latency_excess += self.ewma * (max(ratio, 0.0) - self.latency_excess)

    def choose(self, layer, topk, gates, state, load):
        ctx = self.ctx
        if len(state) == 0 or not (state.budget_total > 0).any():
            dec = exact_decision(ctx, layer, topk, state, load)  # budget 0: exactly `exact`
            self._track(load, dec.latency_s)
            return dec
        loc = state.location
        opt = layer_options(ctx, layer, loc, state.home, ctx.usable[state.user], topk, gates, load, self.max_enum_k)
        left = state.budget_left[:, None] - opt.quality  # [T, M]
        any_sub = opt.mask.any(axis=2)
        feasible = opt.valid & (left >= -1e-12) & (~any_sub | (state.budget_total[:, None] > 0))
        future = self.lookahead.stacked[layer[:, None] + 1, opt.next_location, top1(topk, gates)[:, None],
                                        self.grid.index(np.maximum(left, 0.0))]
        beta = self.beta(layer, state)[:, None]
        cost = self.alpha * (opt.latency_s + future) + (beta + EPS_S_PER_Q) * opt.quality
        pick = np.where(feasible, cost, np.inf).argmin(axis=1)  # action 0 (no substitution) is always feasible
        rows = np.arange(len(state))
        dec = Decision(experts=opt.experts[rows, pick], node=opt.node[rows, pick], location=loc.copy(),
                       next_location=opt.next_location[rows, pick], quality_cost=opt.quality[rows, pick],
                       latency_s=opt.latency_s[rows, pick])
        self._track(load, dec.latency_s)
        return dec

    def _track(self, load: np.ndarray, latency: np.ndarray) -> None:
        mean_load = float(load.mean()) if load.size else 0.0
        self.queue_pressure += self.ewma * (mean_load / (mean_load + self.rt_med) - self.queue_pressure)
        if latency.size:
            est = float(latency.mean())
            self._estimate = est if self._estimate is None else self._estimate + self.ewma * (est - self._estimate)
