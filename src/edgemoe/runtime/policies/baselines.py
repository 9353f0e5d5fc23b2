"""Baseline runtime policies: `exact`, `drop` and `slimcaching` (pure numpy, vectorised over rows).

- exact: every routed expert runs exactly: on the token's node if it holds it, else on the cheapest usable
  replica (round trip + compute + current load), else the cloud.
- slimcaching: SlimCaching's serving rule: the token's own node (the device), else the fastest usable node
  holding the expert, cloud included on equal terms (its objective is min(cloud, edges)); queues ignored,
  as in the paper's latency model.
- drop: experts the token's node does not hold are dropped (-1); the model renormalises the rest.
"""

from __future__ import annotations

import numpy as np

from ..policy import Decision, Policy, TokenState, branch_ready_s, choose_replicas, meeting_node


def exact_decision(ctx, layer: np.ndarray, topk: np.ndarray, state: TokenState, load: np.ndarray, cloud: str = "fallback",
                   use_load: bool = True) -> Decision:
    """The exact-execution decision for [T, K] routed experts at layers [T] (shared by exact, slimcaching, ordermoe)."""
    loc = state.location
    seen_load = load if use_load else np.zeros_like(load)
    usable = ctx.usable[state.user]
    node = choose_replicas(ctx, layer, loc, usable, topk, seen_load, cloud)
    ready = branch_ready_s(ctx, layer, loc, topk, node, seen_load)
    nxt, lat = meeting_node(ctx, layer, loc, state.home, node, ready)
    return Decision(experts=topk.copy(), node=node, location=loc.copy(), next_location=nxt,
                    quality_cost=np.zeros(len(state)), latency_s=lat)


class ExactPolicy(Policy):
    """Exact execution with load-aware replica choice; the cloud only as a fallback."""

    name = "exact"

    def __init__(self, ctx, budget=0.0):
        super().__init__(ctx, budget=budget)

    def compiled_rule(self):
        return self._own_rule(ExactPolicy, "exact")

    def choose(self, layer, topk, gates, state, load):
        return exact_decision(self.ctx, layer, topk, state, load, cloud="fallback", use_load=True)


class SlimCachingPolicy(Policy):
    """Device-local, else the fastest edge or the cloud by static latency (no queue awareness)."""

    name = "slimcaching"

    def __init__(self, ctx, budget=0.0):
        super().__init__(ctx, budget=budget)

    def compiled_rule(self):
        return self._own_rule(SlimCachingPolicy, "slimcaching")

    def choose(self, layer, topk, gates, state, load):
        return exact_decision(self.ctx, layer, topk, state, load, cloud="candidate", use_load=False)


class DropPolicy(Policy):
    """Run what the token's node holds, drop the rest (hivemind-style baseline)."""

    name = "drop"

    def __init__(self, ctx, budget=0.0):
        super().__init__(ctx, budget=budget)

    def compiled_rule(self):
        return self._own_rule(DropPolicy, "drop")

    def choose(self, layer, topk, gates, state, load):
        ctx, loc = self.ctx, state.location
        held = ctx.hosts[loc[:, None], layer[:, None], topk]  # [T, K]
        experts = np.where(held, topk, -1)
        node = np.where(held, loc[:, None], -1)
        ready = branch_ready_s(ctx, layer, loc, experts, node, load)
        nxt, lat = meeting_node(ctx, layer, loc, state.home, node, ready)
        return Decision(experts=experts, node=node, location=loc.copy(), next_location=nxt,
                        quality_cost=np.zeros(len(state)), latency_s=lat)
