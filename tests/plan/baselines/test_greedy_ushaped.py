"""SlimCaching's baselines: `greedy` (exact marginal gains on the K >= 1 objective) and `u-shaped`."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.plan import plan
from edgemoe.plan.base import empty_hosts
from edgemoe.plan.baselines.greedy import device_gains, edge_gains, set_contributions, true_objective_greedy
from edgemoe.plan.objective import expected_latency, expert_latency, slim_model
from edgemoe.plan.synthetic import synthetic_problem


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_greedy_gains_are_true_objective_differences(top_k):
    problem = synthetic_problem(seed=3, top_k=top_k, with_devices=True)
    model = slim_model(problem)
    hosts = empty_hosts(problem)
    hosts[:-1] = np.random.default_rng(0).random(hosts[:-1].shape) < 0.2
    tau = expert_latency(model, hosts)
    before = expected_latency(problem, hosts)
    owners = np.flatnonzero(model.device_node >= 0)
    layer = 1
    edge, _ = edge_gains(model, tau[:, layer], layer)
    dev, _ = device_gains(model, tau[:, layer], layer, owners)
    nodes = list(model.edge_nodes) + list(model.device_node[owners])
    for row, n in enumerate(nodes):
        for e in range(problem.profile.E):
            trial = hosts.copy()
            trial[n, layer, e] = True
            expected = edge[row, e] if row < len(model.edge_nodes) else dev[row - len(model.edge_nodes), e]
            assert before - expected_latency(problem, trial) == pytest.approx(expected, abs=1e-14)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_fills_memory_and_improves_on_all_cloud(seed):
    problem = synthetic_problem(seed=seed, with_devices=True)
    placement = plan(problem, "greedy")
    used, cap = placement.bytes_used()[:-1], problem.capacity_bytes[:-1]
    assert (used <= cap).all()
    assert (used == cap).all()  # ties broken by call savings: every slot finds a useful expert here
    assert placement.params["objective_s"] < expected_latency(problem, empty_hosts(problem))


def test_u_shaped_holds_whole_contiguous_layers():
    problem = synthetic_problem(seed=0, with_devices=True, num_layers=6, num_experts=4, slots_per_server=9,
                                device_slots=8)
    placement = plan(problem, "u-shaped")
    hosts = placement.hosts
    for n, kind in enumerate(problem.node_kind):
        whole = hosts[n].all(axis=1)
        assert (hosts[n].any(axis=1) == whole).all()  # whole layers only
        if kind == "device":
            assert np.flatnonzero(whole).tolist() == [0, 5]  # head and tail: 8 slots = two 4-expert layers
        elif kind == "edge":
            assert np.flatnonzero(whole).tolist() == [1, 2]  # the middle block after the head, 9 // 4 layers
    assert placement.params["head_layers"] == 1
    assert placement.params["objective_s"] <= expected_latency(problem, empty_hosts(problem))
    assert placement.params["native_latency_s"] > 0


def test_u_shaped_without_devices_starts_at_layer_zero():
    problem = synthetic_problem(seed=0, num_layers=4, num_experts=4, slots_per_server=8)
    hosts = plan(problem, "u-shaped").hosts
    assert hosts[0].all(axis=1).tolist() == [True, True, False, False]


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_set_contributions_of_some_rows_equal_the_full_table_bit_for_bit(top_k):
    """The incremental greedy recomputes only the sets holding the cached expert: a row computed alone must
    be the same floats as in a full call, or the incremental and the full greedy could part on a tie."""
    problem = synthetic_problem(seed=5, top_k=top_k, with_devices=True)
    model = slim_model(problem)
    hosts = empty_hosts(problem)
    hosts[:-1] = np.random.default_rng(1).random(hosts[:-1].shape) < 0.3
    tau = expert_latency(model, hosts)
    owners = np.flatnonzero(model.device_node >= 0)
    layer = 2
    full = set_contributions(model, tau[:, layer], layer, owners)
    M = model.layers[layer].sets.shape[0]
    for rows in (np.array([0]), np.arange(M)[::2], np.array([M - 1, 0])):
        part = set_contributions(model, tau[:, layer], layer, owners, rows)
        for whole, some in zip(full, part, strict=True):
            assert np.array_equal(whole[:, rows], some)


@pytest.mark.parametrize("seed,top_k", [(0, 1), (1, 2), (2, 3), (3, 2)])
def test_incremental_greedy_equals_recomputing_every_layer(seed, top_k):
    problem = synthetic_problem(seed=seed, top_k=top_k, with_devices=True)
    model = slim_model(problem)
    kept, steps = true_objective_greedy(problem, model)
    again, steps_again = true_objective_greedy(problem, model, cache_bytes=0)
    assert steps == steps_again > 0
    assert np.array_equal(kept, again)
