"""OrderMoE's latency search: place experts so the runtime's expected per-token latency is least (pure numpy).

The objective is `PathModel.expected_latency`: sampled calibration paths replayed through the runtime's own
layer rule in the chosen token-location mode, so Top-K co-activation (a layer waits for its slowest branch),
token migration and substitution under the budget are all priced as the runtime will meet them. Every
step below evaluates exact changes of that objective (incrementally: only the rows a change touches).

1. Greedy construction by marginal gain per byte (lazy): candidates are single copies (n, l, e) and set
   completions (n, l, A): the missing members of a frequent Top-K set A on node n, because with K >= 2 one
   member alone often saves nothing while its partner stays remote. An expert no usable node holds costs
   the miss penalty, so uncovered experts with any demand come first.
2. Coverage (no cloud): experts the sampled paths never use still get one copy, on the node where making
   room costs least (the cheapest duplicate to evict): rare members parked where they hurt least.
3. Local search, in rounds until nothing helps or the evaluation budget is spent: exchange two nodes'
   whole contents at one layer (migrate mode: a token should find layer l's set and layer l+1's on nodes
   along its way); then per node, drop the copy whose removal costs least and add the missing one whose
   addition gains most, if the pair lowers the objective.

Budgets are counted in evaluations (`max_evals`), never seconds, so the result is deterministic.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..base import PlanProblem
from .runtime_model import PathModel, Replay


def frequent_sets(model: PathModel, per_layer: int) -> list[list[tuple[int, ...]]]:
    """Per layer, the `per_layer` Top-K sets with the most sampled weight (ties: smaller ids first)."""
    out = []
    for layer in range(model.L):
        sets = np.sort(model.topk[:, layer], axis=1)
        keys, inverse = np.unique(sets, axis=0, return_inverse=True)
        mass = np.bincount(inverse.ravel(), weights=model.weight, minlength=len(keys))
        order = np.lexsort((np.arange(len(keys)), -mass))[:per_layer]
        out.append([tuple(int(e) for e in keys[i]) for i in order if mass[i] > 0 and keys.shape[1] > 1])
    return out


class LatencySearch:
    """Mutable search state: hosts [N, L, E], the replay under them, free bytes per node."""

    def __init__(self, problem: PlanProblem, model: PathModel, hosts: np.ndarray, fillable: np.ndarray,
                 max_evals: int, neighbours: int = 7):
        self.problem, self.model, self.fillable = problem, model, fillable
        self.hosts = hosts.copy()
        self.sizes = np.asarray(problem.expert_bytes, dtype=np.int64)
        used = (self.hosts * self.sizes[None]).sum(axis=(1, 2))
        self.free = np.where(fillable, np.asarray(problem.capacity_bytes, dtype=np.int64) - used, 0)
        self.state: Replay = model.replay(self.hosts)
        self.evals_left = int(max_evals)
        self.neighbours = max(1, int(neighbours))
        self.evals = 0
        self.accepted = 0

    @property
    def objective_s(self) -> float:
        return float(self.model.weight @ self.state.latency_s.sum(axis=1)) + self.model.dense_token_s

    # -------------------------------------------------------------------------------------------- moves
    def missing_bytes(self, node: int, layer: int, experts) -> int:
        return int(sum(self.sizes[layer, e] for e in experts if not self.hosts[node, layer, e]))

    def try_set(self, node: int, layer: int, experts, value: bool, commit_if=None) -> float:
        """Exact change of the objective when hosts[node, layer, experts] = value; kept when
        commit_if(delta) is true (the bytes are booked), else undone. Returns the delta (seconds)."""
        experts = [e for e in experts if self.hosts[node, layer, e] != value]
        if not experts:
            return 0.0
        before = self.hosts[:, layer].copy()
        self.hosts[node, layer, experts] = value
        delta, patch = self.model.delta(self.state, self.hosts, layer, experts, before=before)
        self.evals += 1
        self.evals_left -= 1
        if commit_if is not None and commit_if(delta):
            self.model.commit(self.state, patch)
            sign = 1 if value else -1
            self.free[node] -= sign * int(self.sizes[layer, experts].sum())
            self.accepted += 1
        else:
            self.hosts[node, layer, experts] = not value
        return delta

    def add_gains(self, layer: int, experts, nodes: np.ndarray) -> np.ndarray:
        """[V] seconds saved (>0 good) by adding `experts` at `layer` on each of `nodes` (one batched replay)."""
        self.evals += 1
        self.evals_left -= 1
        return -self.model.delta_batch(self.state, self.hosts, layer, experts, nodes, True)

    # ------------------------------------------------------------------------------------- 1. greedy
    def greedy(self, cands: list[tuple[int, tuple[int, ...]]], nodes: np.ndarray, refreshes: int = 8,
               cover: np.ndarray | None = None) -> None:
        """Lazy greedy on gain per byte over `cands` (layer, experts) on `nodes` (module docstring).

        cover: [N] bool nodes; when given, only experts none of them holds yet are candidates (coverage).

        Gains are not submodular (a set member alone may save nothing until its partner arrives), so when
        the heap runs dry every gain is computed afresh, up to `refreshes` times, until none is positive.
        """
        for _ in range(refreshes):
            if cover is not None:
                cands = [c for c in cands if not self.hosts[cover, c[0], c[1][0]].any()]
            heap = self._gain_heap(cands, nodes)
            if not heap:
                return
            while heap and self.evals_left > 0:
                _, ci, n = heapq.heappop(heap)
                layer, experts = cands[ci]
                need = self.missing_bytes(n, layer, experts)
                if need == 0 or need > self.free[n] or (cover is not None and self.hosts[cover, layer, experts[0]].any()):
                    continue
                bar = -heap[0][0] if heap else 0.0
                delta = self.try_set(n, layer, experts, True,
                                     commit_if=lambda d, need=need, bar=bar: d < 0 and -d / need >= bar * (1 - 1e-9))
                if delta < 0 and not self.hosts[n, layer, list(experts)].all():
                    heapq.heappush(heap, (delta / need, ci, n))
            if self.evals_left <= 0:
                return

    def _gain_heap(self, cands, nodes) -> list:
        heap = []
        for ci, (layer, experts) in enumerate(cands):
            if self.evals_left <= 0:
                break
            need = np.array([self.missing_bytes(int(n), layer, experts) for n in nodes])
            ok = (need > 0) & (need <= self.free[nodes])
            if not ok.any():
                continue
            gains = self.add_gains(layer, experts, nodes[ok])
            for n, g, b in zip(nodes[ok], gains, need[ok], strict=True):
                if g > 0:
                    heap.append((-g / b, ci, int(n)))
        heapq.heapify(heap)
        return heap

    # ------------------------------------------------------------------------------------ 2. coverage
    def park_unused(self, edge: np.ndarray, demand: np.ndarray) -> None:
        """Experts the sampled paths never use ([L, E] demand 0) get one copy each on the edge server with the
        largest free share of its memory: they cost nothing there, and the search keeps that memory free."""
        capacity = np.maximum(np.asarray(self.problem.capacity_bytes, dtype=np.float64), 1.0)
        for layer, e in np.argwhere(demand <= 0):
            fits = edge & self.fillable & (self.free >= self.sizes[layer, e])
            if self.hosts[edge, layer, e].any() or not fits.any():
                continue
            n = int(np.argmax(np.where(fits, self.free / capacity, -np.inf)))
            self.hosts[n, layer, e] = True
            self.free[n] -= int(self.sizes[layer, e])

    # ---------------------------------------------------------------------------------- 3. swaps
    def swaps(self, edge_cover: np.ndarray | None, rounds: int) -> None:
        """Rounds over the nodes: exchange a node's least useful copy (any layer) for its most useful missing
        expert while that lowers the objective; `edge_cover` [N] (no cloud): a sole edge copy stays."""
        for _ in range(rounds):
            improved = self._exchanges()
            for n in np.flatnonzero(self.fillable):
                while self.evals_left > 0 and self._swap_node(int(n), edge_cover):
                    improved = True
            if not improved or self.evals_left <= 0:
                return

    def _exchanges(self) -> bool:
        """Swap two nodes' whole contents at one layer when both still fit and the objective falls: in migrate
        mode a token that runs layer l on node a and layer l+1 on node b wants the layers' sets on the nodes
        it passes, and no single-copy exchange gets there. Coverage is unchanged by construction."""
        improved = False
        # Devices serve only their owners: exchanging their contents helps nobody else, so only servers swap.
        nodes = np.flatnonzero(self.fillable & np.array([k == "edge" for k in self.problem.node_kind]))
        cap = np.asarray(self.problem.capacity_bytes, dtype=np.int64)
        # Tokens hop between near servers: each server exchanges with its `neighbours` nearest only (by
        # round trip, ties by index), which keeps a round linear in the number of servers.
        rt = self.model.rt[np.ix_(nodes, nodes)]
        near = np.argsort(np.where(np.eye(len(nodes), dtype=bool), np.inf, rt), axis=1, kind="stable")
        near = near[:, :min(self.neighbours, len(nodes) - 1)]
        pairs = sorted({(min(i, int(j)), max(i, int(j))) for i in range(len(nodes)) for j in near[i]})
        # A change is kept when it lowers the objective by more than this (relative to the round's objective,
        # at least 1 s: computing the objective per move would cost a pass over every row).
        tol = 1e-12 * max(1.0, self.objective_s)
        for i, j in pairs:
            a, b = int(nodes[i]), int(nodes[j])
            improved |= self._swap_nodes(a, b, cap, tol)
            for layer in range(self.sizes.shape[0]):
                improved |= self._swap_layer(a, b, layer, cap, tol)
        return improved

    def _swap_layer(self, a: int, b: int, layer: int, cap: np.ndarray, tol: float) -> bool:
        """Exchange what nodes a and b hold at `layer` (if both fit afterwards); kept if the objective falls."""
        ha, hb = self.hosts[a, layer].copy(), self.hosts[b, layer].copy()
        if np.array_equal(ha, hb) or self.evals_left <= 0:
            return False
        grow = int(self.sizes[layer][hb].sum() - self.sizes[layer][ha].sum())  # bytes node a gains
        used = cap - self.free
        if used[a] + grow > cap[a] or used[b] - grow > cap[b]:
            return False
        before = self.hosts[:, layer].copy()
        self.hosts[a, layer], self.hosts[b, layer] = hb, ha
        delta, patch = self.model.delta(self.state, self.hosts, layer, np.flatnonzero(ha != hb), before=before)
        self._count()
        if delta < -tol:
            self.model.commit(self.state, patch)
            self.free[a] -= grow
            self.free[b] += grow
            self.accepted += 1
            return True
        self.hosts[a, layer], self.hosts[b, layer] = ha, hb
        return False

    def _swap_nodes(self, a: int, b: int, cap: np.ndarray, tol: float) -> bool:
        """Exchange everything nodes a and b hold (if both fit afterwards), layer by layer; kept if better."""
        used = cap - self.free
        if used[a] > cap[b] or used[b] > cap[a] or self.evals_left <= 0:
            return False
        layers = [layer for layer in range(self.sizes.shape[0]) if not np.array_equal(self.hosts[a, layer], self.hosts[b, layer])]
        if len(layers) < 2:
            return False  # one layer: the per-layer exchange covers it
        saved = (self.hosts[a].copy(), self.hosts[b].copy())
        undo = []  # the replay's old values of every row a layer's exchange rewrote, to put back if rejected
        total = 0.0
        for layer in layers:
            before = self.hosts[:, layer].copy()
            ha, hb = before[a].copy(), before[b].copy()
            self.hosts[a, layer], self.hosts[b, layer] = hb, ha
            delta, patch = self.model.delta(self.state, self.hosts, layer, np.flatnonzero(ha != hb), before=before)
            self._count()
            if patch is not None:
                rows = patch[0]
                undo.append((rows, *(None if a is None else a[rows] for a in self._state_arrays())))
            self.model.commit(self.state, patch)
            total += delta
        if total < -tol:
            self.free[a], self.free[b] = cap[a] - used[b], cap[b] - used[a]
            self.accepted += 1
            return True
        self.hosts[a], self.hosts[b] = saved
        for rows, *saved_rows in reversed(undo):
            for a, old in zip(self._state_arrays(), saved_rows, strict=True):
                if a is not None:
                    a[rows] = old
        return False

    def _state_arrays(self) -> tuple:
        """The replay's per-row arrays (the budget bounds None on the numpy path)."""
        st = self.state
        return st.latency_s, st.location, st.budget_left, st.q_need, st.q_block

    def _swap_node(self, n: int, edge_cover: np.ndarray | None) -> bool:
        """One exchange on node n: drop its cheapest copy, add the best missing one; undone unless the
        objective falls."""
        victim = self._cheapest_copy(n, edge_cover)
        if victim is None:
            return False
        loss = self.try_set(n, victim[0], [victim[1]], False, commit_if=lambda d: True)
        gain, layer, experts = self._best_add(n, singles=True, exclude=victim)
        if experts is not None and gain > loss + 1e-12 * max(1.0, abs(loss)):
            self.try_set(n, layer, experts, True, commit_if=lambda d: True)
            return True
        self.try_set(n, victim[0], [victim[1]], True, commit_if=lambda d: True)  # undo the removal
        self.accepted -= 2
        return False

    def _cheapest_copy(self, n: int, edge_cover: np.ndarray | None):
        """(layer, expert) of node n whose removal raises the objective least, or None (sole copies stay)."""
        best = (np.inf, None)
        for layer in range(self.sizes.shape[0]):
            held = np.flatnonzero(self.hosts[n, layer])
            if edge_cover is not None and edge_cover[n]:
                held = held[self.hosts[edge_cover, layer][:, held].sum(axis=0) >= 2]
            if held.size == 0:
                continue
            self._count()
            loss = self.model.delta_singles(self.state, self.hosts, layer, n, held, False)
            k = int(np.argmin(loss))
            if loss[k] < best[0]:
                best = (float(loss[k]), (layer, int(held[k])))
        return best[1]

    def _best_add(self, n: int, singles: bool, exclude):
        """(gain, layer, experts) of the best single copy that fits on n (not `exclude`)."""
        best = (0.0, -1, None)
        for layer in range(self.sizes.shape[0]):
            missing = np.flatnonzero(~self.hosts[n, layer] & (self.sizes[layer] <= self.free[n]))
            missing = missing[~((layer == exclude[0]) & (missing == exclude[1]))]
            options = [np.array([e]) for e in missing]
            if not options:
                continue
            self._count()
            gain = -self.model._batch(self.state, self.hosts, layer, np.full(len(options), n), options, True)
            k = int(np.argmax(gain))
            if gain[k] > best[0]:
                best = (float(gain[k]), layer, [int(e) for e in options[k]])
        return best

    def _count(self) -> None:
        self.evals += 1
        self.evals_left -= 1
