"""SlimCaching for K = 1: lazy greedy over (node, expert) pairs (ALGORITHMS.md §2.5.1).

With K = 1 a layer's latency is the latency of its one expert, so F(S) is a sum of facility-location
terms: monotone submodular. Marginal gains only shrink as S grows, which makes lazy evaluation exact:
a stale gain is an upper bound, so an element whose refreshed gain still tops the heap is the argmax.
The ratio rule (gain per byte) and the plain rule (gain) are both run and the better result is kept;
with equal expert sizes they coincide and one run is made.
"""

from __future__ import annotations

import heapq

import numpy as np

from .base import PlanProblem, empty_hosts
from .objective import SlimModel, expert_latency, latency_per_user_from_tau, marginal_prob

GAIN_TOL = 1e-15  # seconds: gains at or below this count as zero


def cache_nodes(problem: PlanProblem) -> np.ndarray:
    """[N'] node indices that a planner fills: edge servers and user devices (never the cloud)."""
    return np.array([n for n, k in enumerate(problem.node_kind) if k in ("edge", "device")], dtype=np.int64)


def greedy_k1(problem: PlanProblem, model: SlimModel, rule: str) -> np.ndarray:
    """hosts [N, L, E] from lazy greedy with `rule` "ratio" (gain per byte) or "plain" (gain)."""
    L, E = problem.expert_bytes.shape
    size = problem.expert_bytes.astype(np.float64)
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


def slimcaching_k1(problem: PlanProblem, model: SlimModel) -> tuple[np.ndarray, dict]:
    """Best of ratio-greedy and plain greedy. Returns (hosts [N, L, E], info)."""
    equal_sizes = np.unique(problem.expert_bytes).size == 1
    rules = ("ratio",) if equal_sizes else ("ratio", "plain")
    results = {}
    for rule in rules:
        hosts = greedy_k1(problem, model, rule)
        results[rule] = (float(model.weight @ latency_per_user_from_tau(model, expert_latency(model, hosts))), hosts)
    best = min(results, key=lambda r: results[r][0])
    info = {"algorithm": "greedy-k1", "rule": best, "rules_run": list(rules),
            "rule_objective_s": {r: v[0] for r, v in results.items()}}
    return results[best][1], info
