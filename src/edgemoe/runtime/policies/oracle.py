"""The hindsight oracle: OrderMoE's runtime with each token's true future routing known (the limit of look-ahead).

Same placement, same stand-ins and quality costs, same budget rule (a row may spend allowance x L) as the
`ordermoe` policy; what differs is knowledge. At `start` the oracle reads every row's true routing for all
L layers (`routing[tokens]`) and solves its path by dynamic programming over (layer, node the token is at,
remaining budget level), with static costs (no queues):

    V[L](c, b) = 0
    V[l](c, b) = min over actions a at (l, c) feasible for b of  lat(a) + eps q(a) + V[l+1](next(a), b - q(a))

Actions are the steered ones of `layer_options` (migrate mode: stand-in subsets x meeting node and
replicas; home mode: stand-in subsets). Online, at layer l it takes the action minimising the current
layer's latency under the load it sees plus V[l+1]: exact future knowledge, the present's queues.
Budget levels as `BudgetGrid` (a remaining budget maps to the level at or below it, never above).
"""

from __future__ import annotations

import numpy as np

from edgemoe.errors import EdgeMoEError, require_in_range

from ..context import RuntimeContext
from ..policy import Policy, TokenState
from .ordermoe import (
    EPS_S_PER_Q,
    MAX_ENUM_K,
    QUALITY_POWER,
    STEER_REPLICAS,
    BudgetGrid,
    check_kinds,
    layer_options,
    pick_decision,
)

CHUNK_CELLS = 1 << 21  # rows x actions x levels per DP block (about 16 MB per float array)


class OraclePolicy(Policy):
    """Hindsight oracle. routing: (topk [T', L, K], gates [T', L, K]) the true routing of the tokens the caller
    replays; `start(users, tokens)` must name each row's token in it. Parameters as `ordermoe`'s."""

    name = "oracle"

    def __init__(self, ctx: RuntimeContext, budget=0.05, routing=None, substitutes="sub,drop,zero", levels: int = 24,
                 max_enum_k: int = MAX_ENUM_K, steer_replicas: int = STEER_REPLICAS,
                 quality_power: float = QUALITY_POWER):
        kinds = check_kinds(substitutes)
        super().__init__(ctx, budget=budget, substitutes=",".join(kinds), levels=levels, max_enum_k=max_enum_k,
                         steer_replicas=steer_replicas, quality_power=quality_power)
        self.power = float(quality_power)
        if routing is None:
            raise EdgeMoEError("oracle: needs routing=(topk [T, L, K], gates [T, L, K]), the tokens' true routing")
        topk, gates = (np.asarray(routing[0], np.int64), np.asarray(routing[1], float))
        if topk.ndim != 3 or topk.shape[1:] != (ctx.num_layers, ctx.top_k) or gates.shape != topk.shape:
            raise EdgeMoEError(f"oracle: routing must be two [T, L={ctx.num_layers}, K={ctx.top_k}] arrays, got "
                               f"{topk.shape} and {gates.shape}")
        require_in_range(topk, 0, ctx.num_experts, "oracle: routing's topk must hold expert ids")
        if not np.isfinite(gates).all():
            raise EdgeMoEError("oracle: routing's gates hold NaN or infinite values")
        if levels < 2:
            raise EdgeMoEError(f"oracle: levels must be >= 2, got {levels}")
        self.topk, self.gates = topk, gates
        self.kinds, self.max_enum_k, self.steer_replicas = kinds, int(max_enum_k), int(steer_replicas)
        self.steer = ctx.mode == "migrate"
        self.grid = BudgetGrid(float(self.allowance.max()) * ctx.num_layers, levels)
        self.value = np.zeros((0, ctx.num_layers + 1, ctx.num_nodes, self.grid.levels))

    def start(self, users, tokens=None) -> TokenState:
        state = super().start(users)
        if tokens is None:
            raise EdgeMoEError("oracle: start(users, tokens) needs each row's token index in the routing")
        tokens = np.asarray(tokens, np.int64)
        if tokens.shape != state.user.shape or ((tokens < 0) | (tokens >= self.topk.shape[0])).any():
            raise EdgeMoEError(f"oracle: tokens must be [T={len(state)}] indices into the routing's "
                               f"{self.topk.shape[0]} tokens")
        self.value = self.path_values(state.user, tokens, state.budget_total > 0)
        return state

    def path_values(self, users: np.ndarray, tokens: np.ndarray, has_budget: np.ndarray) -> np.ndarray:
        """[T, L+1, N, m] optimal static seconds from layer l to the end for a row at node c with budget level b."""
        ctx, grid = self.ctx, self.grid
        T, L, N, m = len(users), ctx.num_layers, ctx.num_nodes, grid.levels
        value = np.zeros((T, L + 1, N, m))
        home = ctx.user_home[users]
        usable = ctx.usable[users]
        nodes = np.arange(N)
        # rows of one DP block: (row, node c) pairs; a row's cells are size x actions x levels
        actions = (2 ** ctx.top_k if ctx.top_k <= self.max_enum_k else ctx.top_k + 1) * (
            1 + max(N, ctx.top_k * (self.steer_replicas + 1)) if self.steer else 1)
        per = max(1, CHUNK_CELLS // (N * actions * m))
        for layer in range(L - 1, -1, -1):
            nxt = value[:, layer + 1]  # [T, N, m]
            for lo in range(0, T, per):
                r = np.arange(lo, min(T, lo + per))
                rr = np.repeat(r, N)
                loc = np.tile(nodes, len(r))
                # a device that is another user's cannot hold the token: those states stay unreachable (inf)
                ok = usable[rr, loc]
                opt = layer_options(ctx, np.full(len(rr), layer), loc, home[rr], usable[rr], self.topk[tokens[rr], layer],
                                    self.gates[tokens[rr], layer], np.zeros(N), self.max_enum_k, self.kinds, self.steer,
                                    self.steer_replicas, self.power)
                quality = opt.quality
                left = grid.values[None, None, :] - quality[:, :, None]  # [R, A, m]
                feasible = opt.valid[:, :, None] & (left >= -1e-12) & (~opt.any_replaced | has_budget[rr][:, None])[:, :, None]
                future = nxt[rr[:, None, None], opt.next_location[:, :, None], grid.index(np.maximum(left, 0.0))]
                cost = opt.latency_s[:, :, None] + EPS_S_PER_Q * quality[:, :, None] + future
                best = np.where(feasible, cost, np.inf).min(axis=1)  # [R, m]
                best[~ok] = np.inf
                value[r, layer] = best.reshape(len(r), N, m)
        return value

    def choose(self, layer, topk, gates, state, load):
        ctx = self.ctx
        if len(state) and not (state.row.min() >= 0 and state.row.max() < self.value.shape[0]):
            raise EdgeMoEError(f"oracle: state.row must index the {self.value.shape[0]} rows of the last `start`, got "
                               f"[{state.row.min()}, {state.row.max()}]")
        loc = state.location
        opt = layer_options(ctx, layer, loc, state.home, ctx.usable[state.user], topk, gates, load, self.max_enum_k,
                            self.kinds, self.steer, self.steer_replicas, self.power)
        quality = opt.quality
        left = state.budget_left[:, None] - quality
        feasible = opt.valid & (left >= -1e-12) & (~opt.any_replaced | (state.budget_total > 0)[:, None])
        future = self.value[state.row[:, None], layer[:, None] + 1, opt.next_location,
                            self.grid.index(np.maximum(left, 0.0))]
        cost = opt.latency_s + future + EPS_S_PER_Q * quality
        pick = np.where(feasible, cost, np.inf).argmin(axis=1)
        return pick_decision(opt, pick, loc)
