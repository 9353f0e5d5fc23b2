"""Exact changes of `PathModel`'s expected latency, by replaying only the rows a change reaches.

A mixin of `runtime_model.PathModel` (its layer rule `LayerRule.step`, its reach `ChangeReach`, and the
tables as there). A change of one node's experts at one layer replays the rows it can reach from that layer
on; a row whose next location and budget come back to the old replay's stops there (the later layers'
hosts did not change, so its old values stand). Compiled in `replay_kernel` where numba imports.
"""

from __future__ import annotations

import numpy as np

from .replay_kernel import propagate_rows
from .replay_state import Replay


class IncrementalReplay:
    """Deltas of single changes and of batches of candidate changes, and the patches that apply them."""

    def delta(self, state: Replay, hosts: np.ndarray, layer: int, experts, rows: np.ndarray | None = None,
              before: np.ndarray | None = None):
        """Change of the expected latency when `hosts` (already modified at `layer` for `experts`) replaces
        the hosts `state` was replayed under. Returns (seconds, patch); `commit(state, patch)` applies it.
        before: [N, E] hosts at `layer` before the change; when given, only the rows it can reach are replayed
        (`affected`), which is what keeps a change's cost from growing with the cluster."""
        rows = self.touched_rows(layer, experts) if rows is None else rows
        if before is not None and rows.size:
            rows = rows[self.affected(state, layer, rows, before, hosts[:, layer])]
        if rows.size == 0:
            return 0.0, None
        d, patch = self._propagate(state, hosts, layer, rows, None)
        return float(d.sum()), patch

    def delta_batch(self, state: Replay, hosts: np.ndarray, layer: int, experts, nodes: np.ndarray,
                    value: bool) -> np.ndarray:
        """[V] change of the expected latency if hosts[nodes[v], layer, experts] were set to `value`
        (one candidate per node, the others untouched), all in one vectorised replay."""
        nodes = np.asarray(nodes, dtype=np.int64)
        changed = np.asarray(list(experts), dtype=np.int64)
        return self._batch(state, hosts, layer, nodes, [changed] * nodes.size, value)

    def delta_singles(self, state: Replay, hosts: np.ndarray, layer: int, node: int, experts: np.ndarray,
                      value: bool) -> np.ndarray:
        """[V] change of the expected latency if hosts[node, layer, experts[v]] alone were set to `value`."""
        experts = np.asarray(experts, dtype=np.int64)
        return self._batch(state, hosts, layer, np.full(experts.size, node), [experts[v:v + 1] for v in range(experts.size)],
                           value)

    def _batch(self, state, hosts, layer, nodes, changed: list, value: bool) -> np.ndarray:
        """[V] deltas of V candidates: candidate v sets hosts[nodes[v], layer, changed[v]] = value."""
        V = nodes.size
        parts = [self.touched_rows(layer, changed[v]) for v in range(V)]
        if V == 0:
            return np.zeros(V)
        rows = np.concatenate(parts)
        vi = np.repeat(np.arange(V), [p.size for p in parts])
        # Only rows whose user may use the node can feel a change there (a device serves its owner).
        near = self.usable[self.user[rows], nodes[vi]]
        rows, vi = rows[near], vi[near]
        if rows.size == 0:
            return np.zeros(V)
        width = max(c.size for c in changed)
        table = np.full((V, width), -1, np.int64)
        for v, c in enumerate(changed):
            table[v, :c.size] = c
        near = self.flip_affected(state, hosts, layer, rows, nodes[vi], table[vi], value)
        rows, vi = rows[near], vi[near]
        if rows.size == 0:
            return np.zeros(V)
        flip = (nodes[vi], table[vi], value)
        d, _ = self._propagate(state, hosts, layer, rows, flip)
        return np.bincount(vi, weights=d, minlength=V)

    def _propagate(self, state: Replay, hosts, layer, rows, flip, groups=None):
        """Replay `rows` [R'] (possibly repeated) from `layer` on; ([R'] weighted delta per row, patch).

        Compiled (`replay_kernel.propagate_rows`, the same bits) where numba imports and the stand-in actions
        are enumerated (K <= max_enum_k); else `_propagate_numpy`, the reference."""
        if not self.compiled:
            return self._propagate_numpy(state, hosts, layer, rows, flip)
        old = state.latency_s[rows, layer:].sum(axis=1)
        new_lat = state.latency_s[rows]  # fancy indexing: copies
        old_loc, old_left = state.location[rows], state.budget_left[rows]
        new_loc, new_left = old_loc.copy(), old_left.copy()
        reuse = state.q_need is not None
        need = state.q_need[rows] if reuse else np.zeros(new_lat.shape)
        block = state.q_block[rows] if reuse else np.zeros(new_lat.shape)
        self._run_kernel(hosts, layer, rows, old_loc[:, layer], old_left[:, layer], new_lat, new_loc, new_left,
                         old_loc, old_left, flip, need, block, reuse)
        diff = self.weight[rows] * (new_lat[:, layer:].sum(axis=1) - old)
        return diff, (rows, new_lat, new_loc, new_left, need, block)

    def holders_all(self, hosts: np.ndarray, first: int = 0) -> np.ndarray:
        """[L, E, H] `holders` of layers `first`.. (the only ones a replay from `first` reads; earlier layers -1),
        -1 padded to the most copies of one expert at any of them.

        Each layer's table is kept by the bytes of hosts[:, layer]: a search evaluates thousands of changes,
        each at one layer, so the other layers' tables repeat and rebuilding them was a tenth of its time."""
        cache = self.__dict__.setdefault("_holders_cache", {})
        if len(cache) > 4 * self.L * 64:
            cache.clear()  # bounded: old hosts never come back once the search has moved on
        tables = []
        for layer in range(first, self.L):
            key = (layer, np.packbits(hosts[:, layer]).tobytes())
            t = cache.get(key)
            if t is None:
                t = cache[key] = self.holders(hosts, layer)
            tables.append(t)
        H = max(t.shape[1] for t in tables)
        out = np.full((self.L, self.E, H), -1, dtype=np.int64)
        for layer, t in enumerate(tables, start=first):
            out[layer, :, :t.shape[1]] = t
        return out

    def _run_kernel(self, hosts, layer, rows, loc0, left0, new_lat, new_loc, new_left, old_loc, old_left, flip,
                    need, block, reuse: bool):
        """`replay_kernel.propagate_rows` on this model's tables (arrays as there; flip as in `step`; need, block
        [R', L] the budget bounds, reused from the old replay when `reuse`)."""
        if flip is None:
            f_node, f_changed, f_value = np.zeros(rows.size, np.int64), np.full((rows.size, 1), -1, np.int64), False
        else:
            f_node, f_changed, f_value = flip
        propagate_rows(np.ascontiguousarray(rows, dtype=np.int64), int(layer), np.ascontiguousarray(loc0),
                       np.ascontiguousarray(left0), new_lat, new_loc, new_left, old_loc, old_left,
                       need, block, bool(reuse), flip is not None, np.ascontiguousarray(f_node, dtype=np.int64),
                       np.ascontiguousarray(f_changed, dtype=np.int64), bool(f_value),
                       np.ascontiguousarray(hosts, dtype=np.bool_), self.holders_all(hosts, int(layer)), self.topk, self.gates,
                       self.user, self.home, self.usable, self.rt, self.xfer, self.compute, self.is_cloud,
                       bool(self.is_cloud.any()), float(self.miss_s), self.mode == "home", self.subs, self.subst_err,
                       self.row_budget, bool(self.budget > 0 and self.kinds), "sub" in self.kinds and self.subs.shape[2] > 0,
                       "drop" in self.kinds, "zero" in self.kinds, float(self.power))

    def _propagate_numpy(self, state: Replay, hosts, layer, rows, flip):
        """`_propagate` in numpy (the reference of `replay_kernel`)."""
        old = state.latency_s[rows, layer:].sum(axis=1)
        lat_l, nxt, left = self.step(hosts, layer, rows, state.location[rows, layer], state.budget_left[rows, layer],
                                     flip)
        new_lat = state.latency_s[rows].copy()
        new_loc = state.location[rows].copy()
        new_left = state.budget_left[rows].copy()
        new_lat[:, layer], new_loc[:, layer + 1], new_left[:, layer + 1] = lat_l, nxt, left
        moved = (nxt != state.location[rows, layer + 1]) | (left != state.budget_left[rows, layer + 1])
        sub = np.flatnonzero(moved)
        for later in range(layer + 1, self.L):
            if sub.size == 0:
                break
            r = rows[sub]
            lat2, nxt2, left2 = self.step(hosts, later, r, new_loc[sub, later], new_left[sub, later])
            new_lat[sub, later] = lat2
            new_loc[sub, later + 1], new_left[sub, later + 1] = nxt2, left2
            # A row back at its old location with its old budget replays the old way from here on (later
            # layers' hosts did not change), and its copied old values already say so.
            back = (nxt2 == state.location[r, later + 1]) & (left2 == state.budget_left[r, later + 1])
            sub = sub[~back]
        diff = self.weight[rows] * (new_lat[:, layer:].sum(axis=1) - old)
        return diff, (rows, new_lat, new_loc, new_left, None, None)

    @staticmethod
    def commit(state: Replay, patch) -> None:
        """Write a `delta` patch into `state` (in place)."""
        if patch is None:
            return
        rows, lat, loc, left, need, block = patch
        state.latency_s[rows] = lat
        state.location[rows] = loc
        state.budget_left[rows] = left
        if state.q_need is not None and need is not None:
            state.q_need[rows] = need
            state.q_block[rows] = block
