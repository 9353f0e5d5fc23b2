"""SlimCaching for K = 1: lazy greedy over (node, expert) pairs (ALGORITHMS.md §2.5.1).

With K = 1 a layer's latency is the latency of its one expert, so F(S) is a sum of facility-location
terms: monotone submodular. Marginal gains only shrink as S grows, which makes lazy evaluation exact:
a stale gain is an upper bound, so an element whose refreshed gain still tops the heap is the argmax.
The ratio rule (gain per byte) and the plain rule (gain) are both run and the better result is kept;
with equal expert sizes they coincide and one run is made.

Guarantees (what is proven, and reported per run in `params["guarantee"]`):
- equal expert sizes: every node's constraint is a cardinality, together a partition matroid, and greedy
  gets >= 1/2 of the optimum (Fisher, Nemhauser & Wolsey 1978); with a single cache node, 1 - 1/e.
- unequal sizes: ratio greedy alone has no constant bound (brute force found 0.500 and 0.575 of the
  optimum). So we also run the *locally greedy* partial enumeration: node by node, with the nodes before
  it fixed, try every feasible seed of up to `seeds` = 3 of the node's items, complete each seed by ratio
  greedy, keep the best (Sviridenko 2004: 1 - 1/e for one knapsack). Locally greedy with an
  alpha-approximate block solver gets alpha / (1 + alpha) over the blocks (Fisher et al. 1978; Goundan &
  Schulz 2007), so with several nodes (1 - 1/e) / (2 - 1/e) ~= 0.387, and 1 - 1/e with one node. The
  best of all runs is kept, so these bounds hold for the result. When a node has too many items for
  `max_seeds` seeds of size 3, smaller seeds are used and no constant is claimed.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

from ..base import PlanProblem, empty_hosts
from ..nodes import cache_nodes
from ..objective import SlimModel, expert_latency, latency_per_user_from_tau, marginal_prob

GAIN_TOL = 1e-15  # seconds: gains at or below this count as zero


def greedy_k1(problem: PlanProblem, model: SlimModel, rule: str) -> np.ndarray:
    """hosts [N, L, E] from lazy greedy with `rule` "ratio" (gain per byte) or "plain" (gain)."""
    L, E = problem.expert_bytes.shape
    size = np.maximum(problem.expert_bytes, 1).astype(np.float64)  # padding experts have 0 bytes
    hosts = empty_hosts(problem)
    tau = expert_latency(model, hosts)  # [U, L, E]
    weighted = marginal_prob(model, E) * model.weight[:, None, None]  # [U, L, E] w_u p_u(l, e)
    nodes = cache_nodes(problem)
    free = problem.capacity_bytes.astype(np.int64).copy()
    users = {int(n): model.node_users(n) for n in nodes}
    calls = {int(n): model.node_call(n)[users[int(n)]] for n in nodes}
    heap = []
    for n in nodes:
        u = users[int(n)]
        gain = (weighted[u] * np.maximum(tau[u] - calls[int(n)], 0.0)).sum(axis=0)  # [L, E]
        key = gain / size if rule == "ratio" else gain
        for layer, e in zip(*np.nonzero(gain > GAIN_TOL), strict=True):
            heap.append((-key[layer, e], int(n), int(layer), int(e)))
    heapq.heapify(heap)
    while heap:
        _, n, layer, e = heapq.heappop(heap)
        if problem.expert_bytes[layer, e] > free[n]:
            continue  # capacity only shrinks: it will never fit
        u = users[n]
        gain = float(weighted[u, layer, e] @ np.maximum(tau[u, layer, e] - calls[n][:, layer, e], 0.0))
        if gain <= GAIN_TOL:
            continue
        key = gain / size[layer, e] if rule == "ratio" else gain
        if heap and key < -heap[0][0] * (1 - 1e-12):
            heapq.heappush(heap, (-key, n, layer, e))  # stale: re-queue with its true, smaller gain
            continue
        hosts[n, layer, e] = True
        free[n] -= problem.expert_bytes[layer, e]
        tau[u, layer, e] = np.minimum(tau[u, layer, e], calls[n][:, layer, e])
    return hosts


def complete_by_ratio(weighted: np.ndarray, tau: np.ndarray, call: np.ndarray, sizes: np.ndarray,
                      free: int, chosen: np.ndarray) -> tuple[np.ndarray, float]:
    """Ratio greedy on one node from the seed `chosen` [L, E] bool; returns (chosen, total gain).

    weighted, tau, call: [U_n, L, E] (w_u p_u, current call seconds, seconds on the node); sizes [L, E]
    bytes; free: bytes left after the seed. Items that no longer fit are skipped, not a reason to stop.
    """
    chosen = chosen.copy()
    cur = np.where(chosen[None], np.minimum(tau, call), tau)
    total = float((weighted * (tau - cur)).sum())
    while True:
        gain = (weighted * np.maximum(cur - call, 0.0)).sum(axis=0)  # [L, E]
        ok = ~chosen & (sizes <= free) & (gain > GAIN_TOL)
        if not ok.any():
            return chosen, total
        layer, e = np.unravel_index(int(np.argmax(np.where(ok, gain / np.maximum(sizes, 1), -np.inf))), gain.shape)
        chosen[layer, e] = True
        free -= int(sizes[layer, e])
        total += float(gain[layer, e])
        cur[:, layer, e] = np.minimum(cur[:, layer, e], call[:, layer, e])


def seed_size(num_items: int, seeds: int, max_seeds: int) -> int:
    """Largest s <= seeds with sum_{i<=s} C(num_items, i) <= max_seeds."""
    for s in range(seeds, -1, -1):
        if sum(math.comb(num_items, i) for i in range(s + 1)) <= max_seeds:
            return s
    return 0


def local_enumeration(problem: PlanProblem, model: SlimModel, seeds: int, max_seeds: int) -> tuple[np.ndarray, int]:
    """Locally greedy with partial enumeration (see module docstring). Returns (hosts [N, L, E], least seed size)."""
    L, E = problem.expert_bytes.shape
    sizes = problem.expert_bytes.astype(np.int64)
    hosts = empty_hosts(problem)
    tau = expert_latency(model, hosts)  # [U, L, E]
    weighted = marginal_prob(model, E) * model.weight[:, None, None]
    least = seeds
    for n in cache_nodes(problem):
        users = model.node_users(n)
        if users.size == 0:
            continue
        call = model.node_call(n)[users]
        w, t = weighted[users], tau[users]
        cap = int(problem.capacity_bytes[n])
        useful = np.argwhere(((w * np.maximum(t - call, 0.0)).sum(axis=0) > GAIN_TOL) & (sizes <= cap))
        size = seed_size(len(useful), seeds, max_seeds)
        least = min(least, size)
        best, best_gain = np.zeros((L, E), bool), -1.0
        for r in range(size + 1):
            for combo in itertools.combinations(range(len(useful)), r):
                seed = np.zeros((L, E), bool)
                cells = useful[list(combo)]
                seed[cells[:, 0], cells[:, 1]] = True
                used = int(sizes[seed].sum())
                if used > cap:
                    continue
                chosen, gain = complete_by_ratio(w, t, call, sizes, cap - used, seed)
                if gain > best_gain + GAIN_TOL:
                    best, best_gain = chosen, gain
        hosts[n] = best
        tau[users] = np.where(best[None], np.minimum(t, call), t)
    return hosts, least


def k1_guarantee(problem: PlanProblem, equal_sizes: bool, seed_used: int | None) -> tuple[float, str]:
    """(ratio, reason): the fraction of the optimal latency reduction the K = 1 result is proven to reach."""
    single = len(cache_nodes(problem)) == 1
    if equal_sizes:
        return (1 - 1 / math.e, "greedy, one cardinality constraint") if single else \
            (0.5, "greedy on a partition matroid (equal sizes)")
    if seed_used is not None and seed_used >= 3:
        a = 1 - 1 / math.e
        return (a, "partial enumeration, one knapsack") if single else \
            (a / (1 + a), "locally greedy with partial enumeration per node")
    return 0.0, "no constant proven (unequal sizes without full partial enumeration)"


def slimcaching_k1(problem: PlanProblem, model: SlimModel, seeds: int = 3,
                   max_seeds: int = 5000) -> tuple[np.ndarray, dict]:
    """Best of ratio greedy, plain greedy and (unequal sizes) locally greedy partial enumeration.

    Returns (hosts [N, L, E], info); info["guarantee"] is the proven fraction of the optimal reduction.
    """
    equal_sizes = np.unique(problem.expert_bytes).size == 1
    results = {}
    for rule in ("ratio",) if equal_sizes else ("ratio", "plain"):
        results[rule] = greedy_k1(problem, model, rule)
    seed_used = None
    if not equal_sizes and seeds > 0:
        results["enumeration"], seed_used = local_enumeration(problem, model, seeds, max_seeds)
    value = {r: float(model.weight @ latency_per_user_from_tau(model, expert_latency(model, h)))
             for r, h in results.items()}
    best = min(value, key=lambda r: value[r])
    ratio, reason = k1_guarantee(problem, equal_sizes, seed_used)
    info = {"algorithm": "greedy-k1", "rule": best, "rules_run": list(results), "rule_objective_s": value,
            "seed_size": seed_used, "guarantee": ratio, "guarantee_reason": reason}
    return results[best], info
