"""The `local` backend: the real model in one process with a runtime policy's decisions applied.

At every MoE layer of every forward pass the adapter hands the real routing (computed from the real
hidden states) to the policy; the policy's `experts [T, K]` become an `Intervention` (substitute or
drop), so perplexity and the cost model's latency/traffic come from the very same decisions.
`replay_decisions` runs the same policy on a recorded routing trace without the model (numpy only), which
is how the simulator and this backend are checked to decide identically.

A policy whose decisions are charged (`edgemoe.runtime.decision_cost`) adds each decide call's modelled CPU
seconds at the home to every row of the call (`TraceDecisions.decision_s`; the rows wait for the call):
the same model the simulator charges, never a clock read, so replays stay deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.models import Intervention, LayerCall, MoEAdapter

from .decision_cost import decision_cost_of
from .policy import Decision, Policy


@dataclass(frozen=True)
class TraceDecisions:
    """Decisions for T token rows over L layers. K slots."""

    users: np.ndarray  # [T] user of each row
    topk: np.ndarray  # [T, L, K] routed experts
    gates: np.ndarray  # [T, L, K] routed gates
    experts: np.ndarray  # [T, L, K] expert run (-1 not run: dropped, or zeroed where `zeroed`)
    node: np.ndarray  # [T, L, K] node running it (-1 dropped)
    location: np.ndarray  # [T, L] where the token was when each layer started
    next_location: np.ndarray  # [T, L]
    quality_cost: np.ndarray  # [T, L]
    latency_s: np.ndarray  # [T, L] the policy's cost-model latency of each layer (no queueing)
    zeroed: np.ndarray  # [T, L, K] bool slot zeroed (other gates kept) rather than dropped
    decision_s: np.ndarray  # [T, L] the decide call's charged CPU seconds at the home (0: not charged)

    @property
    def token_latency_s(self) -> np.ndarray:
        """[T] seconds through all MoE layers: the sum of the layers' latencies and decision times."""
        return (self.latency_s + self.decision_s).sum(axis=1)

    def substituted(self) -> np.ndarray:
        """[T, L, K] bool."""
        return (self.experts >= 0) & (self.experts != self.topk)


def _stack(users, topk_l, gates_l, decisions: list[Decision], policy: Policy) -> TraceDecisions:
    cost = decision_cost_of(policy)
    T = len(users)
    charge = 0.0 if cost is None else float(cost.seconds(T))  # one call of the T rows per layer
    return TraceDecisions(
        users=np.asarray(users), topk=np.stack(topk_l, 1), gates=np.stack(gates_l, 1),
        experts=np.stack([d.experts for d in decisions], 1), node=np.stack([d.node for d in decisions], 1),
        location=np.stack([d.location for d in decisions], 1),
        next_location=np.stack([d.next_location for d in decisions], 1),
        quality_cost=np.stack([d.quality_cost for d in decisions], 1),
        latency_s=np.stack([d.latency_s for d in decisions], 1),
        zeroed=np.stack([d.zero_mask for d in decisions], 1),
        decision_s=np.full((T, len(decisions)), charge),
    )


def replay_decisions(policy: Policy, users: np.ndarray, topk: np.ndarray, gates: np.ndarray,
                     tokens: np.ndarray | None = None) -> TraceDecisions:
    """Run `policy` layer by layer on a routing trace topk/gates [T, L, K] for rows of `users` [T] (tokens [T]:
    each row's index in the routing a future-knowing policy was given; default 0..T-1)."""
    state = policy.start(users, tokens=np.arange(len(users)) if tokens is None else tokens)
    decisions = [policy.decide(layer, topk[:, layer], gates[:, layer], state) for layer in range(topk.shape[1])]
    return _stack(users, list(topk.transpose(1, 0, 2)), list(gates.transpose(1, 0, 2)), decisions, policy)


def concat(parts: list[TraceDecisions]) -> TraceDecisions:
    """Join decisions of consecutive batches along the token axis."""
    return TraceDecisions(**{f: np.concatenate([getattr(p, f) for p in parts]) for f in TraceDecisions.__dataclass_fields__})


class _PolicyBridge:
    """Turns model LayerCalls into policy decisions for one forward pass at a time."""

    def __init__(self, policy: Policy, num_layers: int):
        self.policy, self.num_layers = policy, num_layers
        self.users: np.ndarray | None = None
        self.tokens: np.ndarray | None = None
        self.allowance: np.ndarray | None = None
        self.parts: list[TraceDecisions] = []
        self._reset()

    def _reset(self):
        self.state, self.topk, self.gates, self.decisions = None, [], [], []

    def begin(self, users_of_rows: np.ndarray, tokens: np.ndarray | None = None,
              allowance: np.ndarray | None = None) -> None:
        """The next pass's rows: their users [T], tokens [T] and (None: the policy's per-user one) allowances [T]."""
        self.users, self.tokens, self.allowance = users_of_rows, tokens, allowance

    def __call__(self, call: LayerCall) -> Intervention | None:
        if call.layer == 0:
            self._reset()
            self.state = self.policy.start(self.users, tokens=self.tokens)
            if self.allowance is not None:  # the rows' own budgets, as a server grants a request's (serve.engine)
                self.state.budget_total = self.allowance * self.num_layers
        topk = call.topk.cpu().numpy().astype(np.int64)
        gates = call.gates.float().cpu().numpy().astype(np.float64)
        # a policy that ranks stand-ins by the token's own router (`reroute`) gets the real logits
        extra = {"router_logits": call.router_logits.float().cpu().numpy().astype(np.float64)} \
            if getattr(self.policy, "wants_router_logits", False) else {}
        dec = self.policy.decide(call.layer, topk, gates, self.state, **extra)
        self.topk.append(topk)
        self.gates.append(gates)
        self.decisions.append(dec)
        if call.layer == self.num_layers - 1:
            self.parts.append(_stack(self.users, self.topk, self.gates, self.decisions, self.policy))
        if np.array_equal(dec.experts, topk):
            return None  # nothing changes: let the model run untouched
        return Intervention.from_numpy(dec.experts, dec.zeroed)


@torch.no_grad()
def run_local(adapter: MoEAdapter, policy: Policy, ids: np.ndarray, row_users: np.ndarray,
              batch_size: int = 8) -> tuple[np.ndarray, TraceDecisions]:
    """Score blocks ids [B, S] with `policy` applied; row_users [B] is the user of each block.

    Returns (nll [B, S-1] of every next token, decisions for the B*S token rows in block-major order).
    """
    nll, _, dec = score_local(adapter, policy, ids, row_users, batch_size)
    return nll, dec


@torch.no_grad()
def score_local(adapter: MoEAdapter, policy: Policy, ids: np.ndarray, row_users: np.ndarray,
                batch_size: int = 8, row_allowance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, TraceDecisions]:
    """`run_local` plus the most likely next token at every position: (nll [B, S-1], top1 [B, S-1], decisions).
    Row r of the decisions is token r of the blocks in block-major order (the `tokens` a policy is started with).
    row_allowance: [B] each block's own quality allowance per token-layer, or [B, S] each token's, set on its rows
    after `start` as a server sets a request's budget (`edgemoe.serve.engine`; [B, S]: a budget mix, dealt by
    edgemoe.distributed.batching.mix_rows); None: the policy's allowance of the block's user."""
    from edgemoe.models.scoring import token_scores

    S = ids.shape[1]
    if row_allowance is not None:
        row_allowance = np.asarray(row_allowance, dtype=float)
        if row_allowance.shape not in ((len(ids),), ids.shape) or not np.isfinite(row_allowance).all() \
                or (row_allowance < 0).any():
            raise EdgeMoEError(f"score_local: row_allowance must be [B={len(ids)}] or [B, S={S}] finite and >= 0")
        row_allowance = np.broadcast_to(row_allowance.reshape(len(ids), -1), ids.shape)
    bridge = _PolicyBridge(policy, adapter.num_layers)

    def begin(i: int, j: int) -> None:
        allow = None if row_allowance is None else row_allowance[i:j].ravel()
        bridge.begin(np.repeat(row_users[i:j], S), np.arange(i * S, j * S), allow)

    nll, top1 = token_scores(adapter, ids, policy=bridge, batch_size=batch_size, on_batch=begin)
    return nll, top1, concat(bridge.parts)


def routing_trace(adapter: MoEAdapter, ids: np.ndarray, batch_size: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The model's own routing on ids [B, S] -> (topk [B*S, L, K], gates [B*S, L, K])."""
    rec, stacked = _routing_recorder(adapter.num_layers)
    with adapter.record(rec), torch.no_grad():
        for i in range(0, len(ids), batch_size):
            adapter.forward_logits(torch.from_numpy(ids[i:i + batch_size]))
    return stacked()


def exact_scores_and_routing(adapter: MoEAdapter, ids: np.ndarray, batch_size: int = 8):
    """Exact execution on ids [B, S] in one pass: (nll [B, S-1], top1 [B, S-1], topk [B*S, L, K], gates [B*S, L, K]),
    bit for bit `token_scores` and `routing_trace` (the recorder only reads the routing, and the batches are the
    same), at the cost of one forward pass instead of two."""
    from edgemoe.models.scoring import token_scores

    rec, stacked = _routing_recorder(adapter.num_layers)
    with adapter.record(rec):
        nll, top1 = token_scores(adapter, ids, batch_size=batch_size)
    return (nll, top1, *stacked())


def _routing_recorder(num_layers: int):
    """(a recorder of every MoE layer's routing, a function returning what it saw as [T, L, K] topk and gates)."""
    topk: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
    gates: list[list[np.ndarray]] = [[] for _ in range(num_layers)]

    def rec(call: LayerCall) -> None:
        topk[call.layer].append(call.topk.cpu().numpy().astype(np.int64))
        gates[call.layer].append(call.gates.float().cpu().numpy().astype(np.float64))

    def stacked() -> tuple[np.ndarray, np.ndarray]:
        return (np.stack([np.concatenate(t) for t in topk], 1), np.stack([np.concatenate(g) for g in gates], 1))

    return rec, stacked
