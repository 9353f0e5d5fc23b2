"""The stated bounds' curvature kappa_g against its definition, by brute force on tiny instances."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.plan.base import empty_hosts
from edgemoe.plan.nodes import cache_nodes
from edgemoe.plan.objective import expected_latency
from edgemoe.plan.slimcaching.bounds import instance_bounds, node_curvature
from edgemoe.plan.synthetic import synthetic_problem


def brute_curvature(problem, node, others):
    """1 - min g(v) / g(v | V - v) over all cells v of `node`, from the objective itself."""
    L, E = problem.expert_bytes.shape
    base = others.copy()
    base[node] = False

    def g(mask):
        trial = base.copy()
        trial[node] = mask
        return expected_latency(problem, base) - expected_latency(problem, trial)

    full = np.ones((L, E), bool)
    ratios = []
    for layer in range(L):
        for e in range(E):
            alone = np.zeros((L, E), bool)
            alone[layer, e] = True
            last = g(full) - g(full & ~alone)
            if last > 1e-12 * max(g(full), 1e-300):
                ratios.append(max(g(alone), 0.0) / last)
    return 1.0 - min(ratios) if ratios else 0.0


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_curvature_matches_its_definition(seed, top_k):
    problem = synthetic_problem(seed=seed, top_k=top_k, with_devices=True, num_servers=2, num_users=3,
                                num_layers=2, num_experts=4, num_tokens=300)
    others = empty_hosts(problem)
    others[:-1] = np.random.default_rng(seed).random(others[:-1].shape) < 0.3
    for node in cache_nodes(problem):
        assert node_curvature(problem, int(node), others) == pytest.approx(brute_curvature(problem, int(node), others),
                                                                           abs=1e-9)


def test_k1_is_modular_and_pairs_are_fully_curved():
    k1 = synthetic_problem(seed=0, top_k=1, with_devices=True, num_servers=2, num_users=3, num_layers=2,
                           num_experts=4)
    assert instance_bounds(k1)["kappa_g"] == pytest.approx(0.0, abs=1e-12)
    assert instance_bounds(k1)["bound_1_minus_kappa_over_2"] == pytest.approx(0.5)
    k2 = synthetic_problem(seed=0, top_k=2, num_servers=2, num_users=3, num_layers=2, num_experts=4)
    # With every expert in the cloud, a lone member of a pair saves nothing: kappa = 1, the bound is vacuous.
    assert instance_bounds(k2)["kappa_g"] == pytest.approx(1.0)
