"""The policies a home decides with, and the load it believes each node has.

A home decides every MoE layer of its passes with the deployment's policy on the context of the servers that
are up (a membership change rebuilds it on the degraded context), or, for the rows of requests that ask for
exact execution, with the exact policy on the same context. Rows of one pass may belong to both: `decide`
calls each policy on its own rows and merges the two decisions. The load estimate is the latest time each
node's accelerator was reported busy until (from the replies of the home's calls).
"""

from __future__ import annotations

import threading

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.runtime.policy import Decision

from .repair import degraded_context

KINDS = ("deployment", "exact")  # the policy of the deployment, and the exact one (requests that ask for it)


def merge_decisions(parts: list, shape: tuple) -> Decision:
    """One Decision for T rows from per-group decisions [(rows [R], Decision of those R rows)] covering them;
    shape: (T, K)."""
    T, _ = shape
    experts, node = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64)
    location, next_location = np.zeros(T, np.int64), np.zeros(T, np.int64)
    quality_cost, latency_s = np.zeros(T), np.zeros(T)
    zeroed = np.zeros(shape, bool) if any(d.zeroed is not None for _, d in parts) else None
    for rows, d in parts:
        experts[rows], node[rows], location[rows], next_location[rows] = d.experts, d.node, d.location, d.next_location
        quality_cost[rows], latency_s[rows] = d.quality_cost, d.latency_s
        if zeroed is not None:
            zeroed[rows] = d.zero_mask
    return Decision(experts, node, location, next_location, quality_cost, latency_s, zeroed)


class HomePolicies:
    """Policies per membership version and kind (KINDS), made on first use; the home's load estimate.

    cfg: the ServerConfig (policy, params, use_load); membership: the home's Membership."""

    def __init__(self, cfg, membership):
        self.cfg, self.ctx, self.membership = cfg, cfg.ctx, membership
        self._lock = threading.Lock()
        self._made: dict[tuple[int, str], object] = {}  # (membership version, kind) -> policy
        # Latest time each node's accelerator was reported busy until (replies): the home's load estimate.
        self.free_seen = np.full(self.ctx.num_nodes, -np.inf)

    def get(self, kind: str = "deployment"):
        """(policy of `kind` for the current membership, alive [N])."""
        from edgemoe.runtime import make_policy

        alive, version = self.membership.snapshot()
        with self._lock:
            if (version, kind) not in self._made:
                self._made = {k: v for k, v in self._made.items() if k[0] == version}  # older versions are done
                ctx = self.ctx if alive.all() else degraded_context(self.ctx, alive)
                name, params = (self.cfg.policy, self.cfg.params) if kind == "deployment" else ("exact", {})
                try:
                    self._made[version, kind] = make_policy(name, ctx, **params)
                except EdgeMoEError:  # e.g. look-ahead tables on a context with holes: exact + repair instead
                    self._made[version, kind] = make_policy("exact", ctx)
            return self._made[version, kind], alive

    def use(self, policy, kind: str = "deployment") -> None:
        """Decide with `policy` (a caller's own, e.g. one wrapped to record its feedback) until the membership
        changes."""
        _, version = self.membership.snapshot()
        with self._lock:
            self._made[version, kind] = policy

    def row_allowances(self, reqs, owner, positions) -> np.ndarray:
        """[T] quality allowance per token-layer of each token row (owner [T]: its request in reqs [B]; positions
        [T]: its token position): edgemoe.distributed.batching.row_allowance under the deployment's ceiling."""
        from .batching import row_allowance

        policy, _ = self.get()
        return row_allowance(policy.allowance, reqs, owner, positions)

    def decide(self, layer: int, topk: np.ndarray, gates: np.ndarray, state, groups, load_s) -> Decision:
        """The decision for a pass's rows at `layer` (topk, gates [T, K]; state: the rows' TokenState).

        groups: None (the deployment policy decides every row on `state`) or [(kind, rows [R], state of those
        rows)]: one call per group, each on its own state from the rows' current locations, merged in row order."""
        if groups is None:
            policy, _ = self.get()
            return policy.decide(layer, topk, gates, state, load_s)
        parts = []
        for kind, rows, st in groups:
            policy, _ = self.get(kind)
            st.location = state.location[rows].copy()
            parts.append((rows, policy.decide(layer, topk[rows], gates[rows], st, load_s)))
        return merge_decisions(parts, topk.shape)

    def row_groups(self, node: int, state, S: int, allowance, exact) -> list | None:
        """A batched pass's row groups (for `decide`) for per-row allowances [B x S] and exact flags [B], rows
        B x S in batch-major order, every row at `node`; None when neither is given (the deployment's policy
        decides every row of `state` at its own budget)."""
        if allowance is None and (exact is None or not np.any(exact)):
            return None
        row_exact = np.repeat(np.zeros(len(state) // S, bool) if exact is None else np.asarray(exact, bool), S)
        groups = []
        for kind, flag in zip(KINDS, (False, True), strict=True):
            rows = np.flatnonzero(row_exact == flag)
            if len(rows) == 0:
                continue
            st = self.get(kind)[0].start(state.user[rows])
            st.home[:] = node
            st.location[:] = node
            if allowance is not None:
                st.budget_total = np.asarray(allowance, float)[rows] * self.ctx.num_layers
            groups.append((kind, rows, st))
        return groups

    def load_s(self, t: float) -> np.ndarray | None:
        """[N] backlog each node had at nominal time t, as far as the replies told (None: the load is off)."""
        if not self.cfg.use_load:
            return None
        with self._lock:
            return np.maximum(self.free_seen - t, 0.0)

    def busy_until(self, node: int, free_at: float) -> None:
        """A reply said `node`'s accelerator is busy until nominal time free_at."""
        with self._lock:
            self.free_seen[node] = max(self.free_seen[node], free_at)

    def retime(self, cfg) -> None:
        """A new clock (and load setting): free times on another clock scale mean nothing."""
        self.cfg = cfg
        with self._lock:
            self.free_seen[:] = -np.inf
