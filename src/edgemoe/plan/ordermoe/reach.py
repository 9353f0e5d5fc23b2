"""Which replayed rows a change of the hosts can reach: the filter that keeps an incremental evaluation's cost
from growing with the cluster.

A mixin of `runtime_model.PathModel` (tables as there, plus rows_with[l][e], the rows whose Top-K set at
layer l contains e; servers [S] and is_server [N], the shared servers; device [R], each row's own device).
"""

from __future__ import annotations

import numpy as np

from .replay_kernel import flip_affected_rows
from .replay_state import Replay


class ChangeReach:
    """Rows a change of (layer, experts) touches, and among them those whose decision it may alter."""

    def touched_rows(self, layer: int, experts) -> np.ndarray:
        """[R'] rows whose set at `layer` contains one of `experts` (or, with substitution, a group mate)."""
        if len(experts) == 1:  # the common case (a search prices single copies by the thousand): one lookup
            rows = self._touched.get((layer, int(next(iter(experts)))))
            if rows is not None:
                return rows
        experts = set(int(e) for e in experts)
        if len(experts) == 1 and self._touched.get((layer, *experts)) is not None:
            return self._touched[(layer, *experts)]
        key = (layer, *experts) if len(experts) == 1 else None
        if self.budget > 0 and "sub" in self.kinds:
            for e in list(experts):
                experts |= {int(m) for m in self.subs[layer, e] if m >= 0}
                experts |= {int(m) for m in np.flatnonzero((self.subs[layer] == e).any(axis=1))}
        parts = [self.rows_with[layer][e] for e in sorted(experts)]
        rows = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        if key is not None:
            self._touched[key] = rows
        return rows

    # ------------------------------------------------------------------------- who a change reaches
    def holder_table(self, held: np.ndarray, layer: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([N, X] node, [N, X] seconds): for a token at each node c, the shared server (not a device, not the
        cloud) the exact rule would send a branch of experts[x] to among the holders in held [N, E] at `layer`:
        least round trip + compute, first index on ties (as `_replicas`); node -1 where none is finite."""
        s = self.servers
        cost = self.rt[:, s, None] + self.compute[s][:, layer, experts][None]  # [N, S, X]
        cost = np.where(held[s][:, experts][None], cost, np.inf)
        if s.size == 0:
            return np.full((self.N, len(experts)), -1), np.full((self.N, len(experts)), np.inf)
        pick = cost.argmin(axis=1)  # [N, X]
        best = np.take_along_axis(cost, pick[:, None], axis=1)[:, 0]
        return np.where(np.isfinite(best), s[pick], -1), best

    def affected(self, state: Replay, layer: int, rows: np.ndarray, before: np.ndarray,
                 after: np.ndarray) -> np.ndarray:
        """[R'] bool: rows whose decision at `layer` may differ between hosts before and after ([N, E] at
        `layer`). A superset, so deltas stay exact: the others run the same branches on the same nodes and
        keep their old values bit for bit. A row can only feel a change when it sits on a changed node (local
        hits, substitutes), owns a changed device, or one of its branches' experts changed and the shared server
        that branch goes to (`holder_table`) is not the same before and after while the token's node lacks it."""
        diff = before != after
        nodes = diff.any(axis=1)  # [N]
        if (nodes & self.is_cloud).any():
            return np.ones(rows.size, bool)  # the cloud is everyone's fallback: no cheap test
        loc = state.location[rows, layer]
        dev = self.device[rows]
        keep = nodes[loc] | ((dev >= 0) & nodes[np.maximum(dev, 0)])
        experts = np.flatnonzero(diff.any(axis=0))
        if experts.size == 0:
            return keep
        old_n, old_c = self.holder_table(before, layer, experts)
        new_n, new_c = self.holder_table(after, layer, experts)
        moved = (old_n != new_n) | ~np.isfinite(old_c) | ~np.isfinite(new_c)  # [N, X]
        pos = np.full(self.E, -1)
        pos[experts] = np.arange(experts.size)
        ek = self.topk[rows, layer]  # [R', K]
        x = pos[ek]
        hit = (x >= 0) & moved[loc[:, None], np.maximum(x, 0)]  # [R', K] the branch's server changed
        return keep | (hit & ~before[loc[:, None], ek]).any(axis=1)

    def flip_affected(self, state: Replay, hosts: np.ndarray, layer: int, rows: np.ndarray, nodes: np.ndarray,
                      changed: np.ndarray, value: bool) -> np.ndarray:
        """[R'] bool: `affected` for a batch of candidates, row i seeing hosts[nodes[i], layer, changed[i]] = value
        (changed [R', W], -1 padded). Adding a server copy reaches a branch only if that server is at least as
        fast as the branch's current server (or there is none); removing one only if it was that server."""
        loc = state.location[rows, layer]
        keep = (loc == nodes) | (self.device[rows] == nodes) | ~self.is_server[nodes]
        experts = np.unique(changed[changed >= 0])
        if experts.size == 0:
            return keep
        held = hosts[:, layer]
        old_n, old_c = self.holder_table(held, layer, experts)
        pos = np.full(self.E, -1)
        pos[experts] = np.arange(experts.size)
        if self.compiled:
            return flip_affected_rows(rows, int(layer), loc, nodes, changed, bool(value), self.device, self.is_server,
                                      self.topk, np.ascontiguousarray(held), old_n, old_c, pos, self.rt, self.compute)
        ek = self.topk[rows, layer]  # [R', K]
        xs = np.maximum(pos[ek], 0)
        mine = (ek[:, :, None] == changed[:, None, :]).any(axis=2)  # [R', K] the branch's expert flips
        server = old_n[loc[:, None], xs]  # [R', K]
        if value:
            cost = self.rt[loc, nodes][:, None] + self.compute[nodes[:, None], layer, ek]
            moved = (server < 0) | (cost <= old_c[loc[:, None], xs])
        else:
            moved = (server < 0) | (server == nodes[:, None])
        return keep | (mine & moved & ~held[loc[:, None], ek]).any(axis=1)
