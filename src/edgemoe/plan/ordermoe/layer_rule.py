"""The runtime's layer rule in numpy, for a batch of replayed rows: `PathModel`'s one-layer decision.

A mixin of `runtime_model.PathModel`, which sets the tables it reads (module docstring there: topk, gates
[R, L, K], user, home [R], usable [U, N], rt, xfer [N, N], compute [N, L, E], is_cloud [N], miss_s, mode,
budget, kinds, power, max_enum_k, subs [L, E, S], subst_err [L, E, E], row_budget [R]). The compiled twin of
`step` is `replay_kernel.propagate_rows`.
"""

from __future__ import annotations

import numpy as np

from .standins import choose_stand_ins, max_over_kept, prefix_masks, subset_bits


class LayerRule:
    """One layer's decision for rows [R']: each branch's node, the stand-ins, the layer's seconds."""

    def step(self, hosts: np.ndarray, layer: int, rows: np.ndarray, loc: np.ndarray, left: np.ndarray, flip=None,
             record: dict | None = None):
        """Decide `layer` for `rows` [R'] at nodes `loc` [R'] with budget `left` [R'] under hosts [N, L, E].

        flip: None, or (nodes [R'], changed [R', F] (-1 padded), value): row i sees
        hosts[nodes[i], layer, changed[i]] = value (a batch of candidate placements, one call).
        record: a dict that receives the stand-ins taken, "kind" [R', K] (-1: run exactly, else the index into
        KINDS), and their "quality" [R'].
        Returns (latency [R'], next location [R'], budget left after [R']).
        """
        experts = self.topk[rows, layer]  # [R', K]
        gates = self.gates[rows, layer]
        # Only the nodes holding a branch's expert can serve it: [R', K, H] columns of holders (H = most copies
        # of one expert at this layer, a few on a large cluster), not [R', K, N], so a row costs the same
        # whatever the number of nodes.
        cols = self.holders(hosts, layer)[experts]  # [R', K, H], -1 padded
        held = cols >= 0
        local = hosts[loc[:, None], layer, experts]  # [R', K]
        if flip is not None:
            nodes, changed, value = flip
            hit = (experts[:, :, None] == changed[:, None, :]).any(axis=2)  # [R', K]
            # The flipped node leaves the holder columns and comes back as one extra column when it is added.
            held &= ~(hit[:, :, None] & (cols == nodes[:, None, None]))
            cols = np.concatenate([cols, np.broadcast_to(nodes[:, None, None], (*hit.shape, 1))], axis=2)
            held = np.concatenate([held, (hit & value)[:, :, None]], axis=2)
            local = np.where(hit & (loc == nodes)[:, None], value, local)
        node, miss = self._replicas(layer, rows, loc, experts, cols, held, local)
        if self.budget > 0 and self.kinds:
            return self._step_standins(hosts, layer, rows, loc, left, experts, gates, node, miss, flip, record)
        lat, nxt = self._finish(layer, rows, loc, experts, node, miss)
        if record is not None:
            record["kind"], record["quality"] = np.full(experts.shape, -1, np.int64), np.zeros(rows.size)
        return lat, nxt, left

    def holders(self, hosts: np.ndarray, layer: int) -> np.ndarray:
        """[E, H] nodes holding each expert at `layer` under hosts [N, L, E], ascending, -1 padded (H >= 1)."""
        e_idx, n_idx = np.nonzero(hosts[:, layer].T)  # by expert, then node
        count = np.bincount(e_idx, minlength=self.E)
        table = np.full((self.E, max(int(count.max(initial=0)), 1)), -1, dtype=np.int64)
        table[e_idx, np.arange(e_idx.size) - (np.cumsum(count) - count)[e_idx]] = n_idx
        return table

    def _replicas(self, layer, rows, loc, experts, cols, held, local):
        """([R', K] node of each branch, [R', K] bool no usable holder) by the `exact` policy's rule: the token's
        node if it holds the expert (local [R', K]), else the usable holder (cols/held [R', K, H]) of least
        round trip + compute, the cloud only when no other holder is usable; ties to the lowest node index."""
        at = np.maximum(cols, 0)
        cand = held & self.usable[self.user[rows][:, None, None], at]
        if self.is_cloud.any():
            edge = cand & ~self.is_cloud[at]
            cand = np.where(edge.any(axis=2, keepdims=True), edge, cand)
        cost = np.where(cand, self.rt[loc[:, None, None], at] + self.compute[at, layer, experts[:, :, None]], np.inf)
        best = cost.min(axis=2, initial=np.inf)
        node = np.where(cand & (cost == best[..., None]), at, self.N).min(axis=2, initial=self.N)
        # Nothing finite (no usable holder): node 0, what an argmin over all-infinite costs gives.
        node = np.where(np.isfinite(best), node, 0)
        miss = ~cand.any(axis=2) & ~local
        node = np.where(local, loc[:, None], node)
        return node, miss

    def _finish(self, layer, rows, loc, experts, node, miss, skip=None):
        """([R'] layer seconds, [R'] next location) of branches on `node` [R', K] (miss: [R', K] unreachable;
        skip: [R', K] not run, dropped or zeroed)."""
        R = loc.shape[0]
        comp = self.compute[node, layer, experts]
        ready = self.xfer[loc[:, None], node] + comp  # [R', K]
        # An unreachable branch adds the miss penalty on top of the layer (additive, so covering any one
        # missing expert already pays) and takes no part in the max or the meeting; neither does a skipped one.
        penalty = self.miss_s * miss.sum(axis=1)
        if skip is not None:
            miss = miss | skip
        ready = np.where(miss, -np.inf, ready)
        if self.mode == "home":
            back = np.where(miss, 0.0, self.xfer[node, loc[:, None]])
            return np.max(ready + back, axis=1, initial=0.0) + penalty, loc.copy()
        node = np.where(miss, loc[:, None], node)
        cand = np.concatenate([loc[:, None], node], axis=1)  # [R', K+1]
        to = self.xfer[node[:, :, None], cand[:, None, :]]  # [R', K, K+1]
        done = np.maximum(np.max(ready[:, :, None] + to, axis=1), 0.0)  # [R', K+1]
        if layer == self.L - 1:
            done = done + self.xfer[cand, self.home[rows][:, None]]
        pick = done.argmin(axis=1)
        ar = np.arange(R)
        return done[ar, pick] + penalty, cand[ar, pick]

    def _finish_actions(self, layer, rows, loc, experts, node, miss, mask, order, is_sub, sub):
        """([R', M] layer seconds, [R', M] next location) of every action at once: action m runs slot k exactly
        on node [R', K] unless mask [R', M, K] (every subset, order None, or the prefixes in `order` [R', K]:
        `standins.max_over_kept`); a masked slot runs sub [R', K] at the token's node where is_sub [R', M, K],
        else not at all. The same sums and maxima as `_finish` on each action alone: the max over kept exact
        slots, and the max over substitutes of (compute at the token's node) plus the one transfer from there
        (rounding is monotone, so that is the max of the sums); a substitute's node is the token's,
        candidate 0, which wins that tie, so a masked slot is no candidate."""
        R, K = experts.shape
        ready_x = self.xfer[loc[:, None], node] + self.compute[node, layer, experts]  # [R', K]
        here = self.xfer[loc, loc]  # [R'] (0: the token's own node)
        ready_s = here[:, None] + self.compute[loc[:, None], layer, np.maximum(sub, 0)]  # [R', K]
        sub_ready = np.where(is_sub, ready_s[:, None, :], -np.inf).max(axis=2)  # [R', M]
        penalty = self.miss_s * miss.sum(axis=1)
        if self.mode == "home":
            back = np.where(miss, -np.inf, ready_x + self.xfer[node, loc[:, None]])
            lat = np.maximum(max_over_kept(back[:, :, None], mask, order)[:, :, 0], sub_ready + here[:, None])
            lat = np.maximum(lat, 0.0) + penalty[:, None]
            return lat, np.broadcast_to(loc[:, None], lat.shape).copy()
        node = np.where(miss, loc[:, None], node)
        cand = np.concatenate([loc[:, None], node], axis=1)  # [R', K+1]
        arrive = np.where(miss[:, :, None], -np.inf, ready_x[:, :, None] + self.xfer[node[:, :, None], cand[:, None, :]])
        done = max_over_kept(arrive, mask, order)  # [R', M, K+1]
        np.maximum(done, sub_ready[:, :, None] + self.xfer[loc[:, None], cand][:, None, :], out=done)
        np.maximum(done, 0.0, out=done)
        if layer == self.L - 1:
            done = done + self.xfer[cand, self.home[rows][:, None]][:, None, :]
        done[:, :, 1:][mask] = np.inf  # a slot not run exactly is no candidate
        pick = done.argmin(axis=2)  # [R', M]
        lat = np.take_along_axis(done, pick[..., None], 2)[..., 0] + penalty[:, None]
        return lat, np.take_along_axis(cand, pick, 1)

    def _step_standins(self, hosts, layer, rows, loc, left, experts, gates, node, miss, flip, record=None):
        """The ordermoe policy's myopic stand-in choice (H = 0, no pacing weight): among the actions that replace
        a subset of the replaceable branches (those the token's node lacks and some usable node holds) by their
        cheapest stand-in (`standins.choose_stand_ins`: the node's best-ranked group mate, drop and renormalise,
        or zero), the fastest whose quality cost fits what is left; ties to less quality, then to the first
        action (subset index order, the runtime's argmin). record: a dict that receives "kind" [R', K] (-1 exact,
        else the index into KINDS) and "quality" [R'] of the actions taken."""
        R, K = experts.shape
        sub = np.full((R, K), -1, np.int64)
        if "sub" in self.kinds and self.subs.shape[2] > 0:
            # the best-ranked group mate the token's node holds (the runtime's `best_local_substitutes`)
            mates = self.subs[layer, experts]  # [R', K, S]
            ok = hosts[loc[:, None, None], layer, np.maximum(mates, 0)]
            if flip is not None:
                nodes, changed, value = flip
                hit = (mates[..., None] == changed[:, None, None, :]).any(axis=3)  # [R', K, S]
                ok = np.where(hit & (loc == nodes)[:, None, None], value, ok)
            ok &= mates >= 0
            sub = np.where(ok.any(axis=2), np.take_along_axis(mates, ok.argmax(axis=2)[..., None], 2)[..., 0], -1)
        sub_err = np.where(sub >= 0, self.subst_err[layer, experts, np.maximum(sub, 0)], np.inf)
        best_lat, best_nxt = self._finish(layer, rows, loc, experts, node, miss)
        best_q = np.zeros(R)
        kind_taken = np.full((R, K), -1, np.int64)
        replaceable = (node != loc[:, None]) & ~miss  # a missing expert keeps its penalty: never stood in for
        # only these rows have a choice (a row without budget has none: the runtime's has_budget rule)
        some = np.flatnonzero(replaceable.any(axis=1) & (self.row_budget[rows] > 0))
        if some.size:
            if K <= self.max_enum_k:  # every subset (action 0: none, never taken here)
                order, mask = None, np.broadcast_to(subset_bits(K)[None], (some.size, 2 ** K, K))
            else:  # the runtime's prefixes by remote latency (without its queue load: the replay has none)
                ready = self.xfer[loc[some, None], node[some]] + self.compute[node[some], layer, experts[some]]
                order, mask = prefix_masks(ready, replaceable[some])
            lay = np.full(some.size, layer)
            kind, cost = choose_stand_ins(lay, experts[some], gates[some], sub[some], sub_err[some], self.subst_err,
                                          mask, self.kinds, self.power)
            valid = ~(mask & (~replaceable[some][:, None, :] | ~np.isfinite(cost))).any(axis=2)  # [S', M]
            q = np.where(mask, np.where(np.isfinite(cost), cost, 0.0), 0.0).sum(axis=2)
            valid &= q <= left[some][:, None] + 1e-12
            valid[:, 0] = False  # action 0 is the exact execution, already in best_*
            if valid.any():
                is_sub = mask & (kind == 0)
                lat, nxt = self._finish_actions(layer, rows[some], loc[some], experts[some], node[some], miss[some],
                                                mask, order, is_sub, sub[some])
                # the policy's cost with alpha = 1, beta = 0: seconds + EPS x quality; the first least action
                score = np.where(valid, lat + 1e-9 * q, np.inf)  # [S', M]
                pick = score.argmin(axis=1)
                ar = np.arange(some.size)
                # kept only if strictly better than no stand-in (action 0, first in the runtime's argmin)
                better = score[ar, pick] < best_lat[some] + 1e-9 * best_q[some]
                r, ar, pick = some[better], ar[better], pick[better]
                best_lat[r], best_nxt[r], best_q[r] = lat[ar, pick], nxt[ar, pick], q[ar, pick]
                kind_taken[r] = np.where(mask[ar, pick], kind[ar, pick], -1)
        if record is not None:
            record["kind"], record["quality"] = kind_taken, best_q
        return best_lat, best_nxt, left - best_q
