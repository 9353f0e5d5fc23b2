"""The exact ILP against brute-force enumeration on tiny instances."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan
from edgemoe.plan.objective import expected_latency, marginal_prob, slim_model
from edgemoe.plan.synthetic import synthetic_problem

from .test_slimcaching import TINY, brute_force_best, node_subsets  # noqa: F401


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_devices", [False, True])
def test_ilp_equals_enumeration(seed, with_devices):
    problem = synthetic_problem(seed=seed, with_devices=with_devices, device_slots=1,
                                **{**TINY, "num_layers": 1, "num_experts": 4})
    best, _ = brute_force_best(problem)
    placement = plan(problem, "exact", time_limit=30)
    assert placement.params["optimal"]
    assert placement.params["mip_gap"] == pytest.approx(0.0, abs=1e-6)
    assert placement.params["objective_s"] == pytest.approx(best, rel=1e-9)
    assert placement.params["ilp_objective"] == pytest.approx(best, rel=1e-6)


def sum_objective(problem, hosts):
    """Expected total call latency (no max over the K branches), computed directly."""
    from edgemoe.plan.objective import expert_latency

    model = slim_model(problem)
    tau = expert_latency(model, hosts)
    return float(np.einsum("u,ule,ule->", model.weight, marginal_prob(model, tau.shape[2]), tau))


@pytest.mark.parametrize("seed", range(2))
def test_sum_objective_ilp_equals_enumeration(seed):
    problem = synthetic_problem(seed=seed, **{**TINY, "num_layers": 1, "num_experts": 4})
    import itertools

    from edgemoe.plan.base import empty_hosts
    from edgemoe.plan.slim_k1 import cache_nodes

    nodes = cache_nodes(problem)
    best = np.inf
    for combo in itertools.product(*[list(node_subsets(problem, n)) for n in nodes]):
        hosts = empty_hosts(problem)
        for n, mask in zip(nodes, combo, strict=True):
            hosts[n] = mask
        best = min(best, sum_objective(problem, hosts))
    placement = plan(problem, "exact", objective="sum")
    assert placement.params["ilp_objective"] == pytest.approx(best, rel=1e-6)
    assert sum_objective(problem, placement.hosts) == pytest.approx(best, rel=1e-9)


def test_slimcaching_never_beats_the_optimum():
    problem = synthetic_problem(seed=4, with_devices=True, device_slots=1, **{**TINY, "num_experts": 4})
    optimum = plan(problem, "exact", time_limit=30).params["objective_s"]
    for params in ({}, {"passes": 3}):
        assert plan(problem, "slimcaching", **params).params["objective_s"] >= optimum - 1e-12
    assert expected_latency(problem, plan(problem, "greedy").hosts) >= optimum - 1e-12


def test_unknown_objective_is_refused():
    with pytest.raises(EdgeMoEError, match="objective"):
        plan(synthetic_problem(), "exact", objective="nope")
