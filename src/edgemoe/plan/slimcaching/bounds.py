"""The approximation bounds SlimCaching states, computed for one instance (ALGORITHMS.md [S]).

The source summary says: each per-server subproblem is a modular plus a supermodular function, and the
accelerated method reaches (1 - kappa_g) / 2 of the optimum, kappa_g being the supermodular curvature;
it quotes 1/2 for a single edge server and 1/4 for several. We compute kappa_g so that the benchmark can
print these bounds beside what the planners achieve.

One node's subproblem, with the other caches fixed, is g_n(S) = latency saved by caching S on n. A Top-K
set's saving base - max(calls) is supermodular in which of its members are cached (the max of the calls
is submodular in the lattice of call times, and caching lowers them), so g_n is supermodular; for K = 1 it
is modular. Its curvature (Bai & Bilmes 2018) is

    kappa_n = 1 - min_{v : g(v | V - v) > 0} g({v}) / g(v | V - v)

over the node's useful items V. kappa = 0 means modular; kappa = 1 means some item is worth nothing alone
and something in company (the usual case with K >= 2, where a lone expert of a pair saves nothing): the
bound (1 - kappa) / 2 is then vacuous. We report kappa_g = max_n kappa_n with every other cache empty.
"""

from __future__ import annotations

import numpy as np

from ..base import PlanProblem, empty_hosts
from ..nodes import cache_nodes
from ..objective import expert_latency, slim_model
from .values import set_gains


def node_curvature(problem: PlanProblem, node: int, hosts: np.ndarray | None = None) -> float:
    """kappa of `node`'s subproblem with the other caches as in hosts [N, L, E] (default: all empty)."""
    model = slim_model(problem)
    hosts = empty_hosts(problem) if hosts is None else hosts.copy()
    hosts[node] = False
    users = model.node_users(node)
    if users.size == 0:
        return 0.0
    tau = expert_latency(model, hosts, users)
    call = model.node_call(node)[users]
    worst = 0.0
    for layer, ls in enumerate(model.layers):
        g = set_gains(tau[:, layer], call[:, layer], model.user_set_prob(layer)[users], model.weight[users], ls.sets)
        if g.gain.shape[0] == 0:
            continue
        K = g.cand_pos.shape[1]
        valid = g.cand_pos >= 0  # [M, K]
        full = (valid.astype(np.int64) << np.arange(K)).sum(axis=1)  # [M] every useful member cached
        rows, ks = np.nonzero(valid)
        bit = 1 << ks
        alone = np.bincount(g.cand_pos[rows, ks], weights=g.gain[rows, bit], minlength=g.candidates.size)
        last = np.bincount(g.cand_pos[rows, ks], weights=g.gain[rows, full[rows]] - g.gain[rows, full[rows] & ~bit],
                           minlength=g.candidates.size)
        tol = 1e-12 * max(float(last.max(initial=0.0)), 1e-300)
        pos = last > tol
        if pos.any():
            worst = max(worst, float(1.0 - np.min(np.clip(alone[pos], 0.0, None) / last[pos])))
    return min(max(worst, 0.0), 1.0)


def instance_bounds(problem: PlanProblem) -> dict:
    """kappa_g (max over cache nodes, others empty) and the stated bounds as fractions of the optimum's
    latency reduction: (1 - kappa_g) / 2, 1/2 (one edge server), 1/4 (several)."""
    kappa = max((node_curvature(problem, int(n)) for n in cache_nodes(problem)), default=0.0)
    return {"kappa_g": kappa, "bound_1_minus_kappa_over_2": (1.0 - kappa) / 2, "bound_single_server": 0.5,
            "bound_several_servers": 0.25}
