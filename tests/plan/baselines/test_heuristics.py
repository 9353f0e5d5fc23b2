"""Baselines: golden examples per planner, EPLB in the shape of vLLM's test, invariants for all planners."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.errors import EdgeMoEError
from edgemoe.plan.base import empty_hosts
from edgemoe.plan.baselines.heuristics import (
    entropy_layer_budget,
    pack_balanced,
    plan_activation_aware,
    plan_affinity,
    plan_eplb,
    plan_lfu,
    plan_random,
    plan_uniform,
    replicate_by_load,
)
from edgemoe.plan.nodes import access_nodes, ensure_coverage, fillable_nodes, proportional_slots
from edgemoe.plan.ordermoe.planner import plan_ordermoe
from edgemoe.plan.synthetic import synthetic_problem

from ..conftest import heterogeneous, make_problem

MINE = {
    "ordermoe": plan_ordermoe, "uniform": plan_uniform, "random": plan_random, "lfu": plan_lfu,
    "activation-aware": plan_activation_aware, "eplb": plan_eplb, "affinity": plan_affinity,
}
FLAT = np.eye(4)[None]  # no similarity structure


def held(placement, node, layer=0):
    return np.flatnonzero(placement.hosts[node, layer]).tolist()


# ------------------------------------------------------------------------------------------ golden cases


def test_uniform_is_capacity_weighted_round_robin():
    problem = make_problem(np.full((1, 6), 1 / 3), np.eye(6)[None], slots=[4, 2], user_home=[0], user_weight=[1])
    placement = plan_uniform(problem)
    # Largest free fraction first (ties: lower index): 0->edge0, 1->edge1, 2->edge0, 3->edge0 (0.5 tie),
    # 4->edge1, 5->edge0.
    assert held(placement, 0) == [0, 2, 3, 5] and held(placement, 1) == [1, 4]
    equal = plan_uniform(make_problem(np.full((1, 6), 1 / 3), np.eye(6)[None], [3, 3], [0], [1]))
    assert held(equal, 0) == [0, 2, 4] and held(equal, 1) == [1, 3, 5]


def test_lfu_follows_each_servers_users_then_repairs_coverage():
    freq = np.array([[0.9, 0.6, 0.4, 0.1]])
    mirrored = np.array([[[0.9, 0.6, 0.4, 0.1]], [[0.1, 0.4, 0.6, 0.9]]])
    problem = make_problem(freq, FLAT, [2, 2], [0, 1], [0.5, 0.5], user_freq=mirrored, with_cloud=True)
    placement = plan_lfu(problem)
    assert held(placement, 0) == [0, 1] and held(placement, 1) == [2, 3]
    # Both users like 0 and 1: both servers cache {0, 1}, leaving 2 and 3 on no edge server.
    alike = make_problem(freq, FLAT, [2, 2], [0, 1], [0.5, 0.5], with_cloud=True)
    assert held(plan_lfu(alike), 0) == [0, 1] == held(plan_lfu(alike), 1)
    # Without a cloud the repair covers 2 (evicting the cheapest duplicate, 1 on edge0), then 3 (evicting
    # the only remaining duplicate, 0 on edge0).
    no_cloud = make_problem(freq, FLAT, [2, 2], [0, 1], [0.5, 0.5])
    repaired = plan_lfu(no_cloud)
    assert held(repaired, 0) == [2, 3] and held(repaired, 1) == [0, 1]


def test_random_is_seeded_and_covers_without_cloud():
    problem = synthetic_problem(num_servers=3, num_layers=3, num_experts=8, slots_per_server=10, with_cloud=False)
    a, b, c = plan_random(problem, seed=1), plan_random(problem, seed=1), plan_random(problem, seed=2)
    assert np.array_equal(a.hosts, b.hosts) and not np.array_equal(a.hosts, c.hosts)
    assert (a.replicas() >= 1).all() and a.params["coverage"] is True


def test_entropy_budget_favours_spread_layers():
    freq = np.array([[0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01]])
    budget = entropy_layer_budget(freq, np.ones((2, 4)), total_bytes=12.0, floor_bytes=np.array([4.0, 4.0]))
    h0, h1 = np.log(4), -(0.97 * np.log(0.97) + 3 * 0.01 * np.log(0.01))
    assert budget == pytest.approx([4 + 4 * h0 / (h0 + h1), 4 + 4 * h1 / (h0 + h1)])


def test_activation_aware_gives_spread_layer_more_copies():
    freq = np.array([[0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01]])
    problem = make_problem(freq, np.stack([np.eye(4)] * 2), [6, 6], [0, 1], [0.5, 0.5])
    placement = plan_activation_aware(problem)
    copies = placement.replicas()
    assert (copies >= 1).all()
    assert copies[0].sum() > copies[1].sum()


def test_eplb_replication_and_packing_golden():
    # Replicate 4 experts with loads [60, 30, 20, 10] into 6 slots: 60 -> 30+30 -> ties with 30 go to the
    # lower id, so expert 0 gets 3 copies (20 each), the others 1.
    assert replicate_by_load(np.array([60.0, 30, 20, 10]), 6, 3).tolist() == [3, 1, 1, 1]
    # Pack copies [e1:30, e0:20, e0:20, e0:20, e2:20, e3:10] into 3 nodes x 2 slots, lightest first:
    # e1->n0, e0->n1, e0->n2, e0->n0 (the only node with room and no e0), e2->n1, e3->n2.
    experts = np.array([0, 0, 0, 1, 2, 3])
    weights = np.array([20.0, 20, 20, 30, 20, 10])
    nodes = pack_balanced(experts, weights, np.array([2, 2, 2]), np.ones(3))
    assert nodes.tolist() == [1, 2, 0, 0, 1, 2]
    # The planner reaches the same placement from a profile with those loads.
    problem = make_problem(np.array([[0.6, 0.3, 0.2, 0.1]]), FLAT, [2, 2, 2], [0], [1.0])
    placement = plan_eplb(problem)
    assert [held(placement, n) for n in range(3)] == [[0, 1], [0, 2], [0, 3]]


def test_eplb_edge_cases():
    # One node: at most one copy of each expert, heaviest first when slots are short.
    assert replicate_by_load(np.array([5.0, 9, 1]), 2, 1).tolist() == [1, 1, 0]
    assert replicate_by_load(np.array([5.0, 9, 1]), 6, 1).tolist() == [1, 1, 1]
    # Equal weights: extra copies go round-robin over ids.
    assert replicate_by_load(np.ones(4), 6, 4).tolist() == [2, 2, 1, 1]
    # Extreme imbalance: the hot expert takes extra slots up to one copy per node; the rest spill over.
    assert replicate_by_load(np.array([1000.0, 1, 1, 1]), 6, 3).tolist() == [3, 1, 1, 1]
    assert replicate_by_load(np.array([1000.0, 1, 1, 1]), 8, 3).tolist() == [3, 2, 2, 1]
    # A faster node (half the seconds per unit of load) takes the heavier share.
    nodes = pack_balanced(np.arange(4), np.array([4.0, 3, 2, 1]), np.array([2, 2]), np.array([1.0, 0.5]))
    assert nodes.tolist() == [0, 1, 1, 0]


def test_affinity_follows_transitions():
    freq = np.array([[0.8, 0.6, 0.4, 0.2], [0.5, 0.5, 0.5, 0.5]])
    perm = [1, 0, 3, 2]  # layer-0 expert e is always followed by layer-1 expert perm[e]
    trans = np.eye(4)[perm][None]
    problem = make_problem(freq, np.stack([np.eye(4)] * 2), [4, 4], [0, 1], [0.5, 0.5], trans=trans)
    placement = plan_affinity(problem, replicate=False)
    # Layer 0 like uniform (by frequency): edge0 {0, 2}, edge1 {1, 3}; layer 1 follows: edge0 {1, 3}.
    assert held(placement, 0, 0) == [0, 2] and held(placement, 0, 1) == [1, 3]
    assert held(placement, 1, 0) == [1, 3] and held(placement, 1, 1) == [0, 2]


def test_affinity_keeps_more_transitions_local_than_uniform():
    local = {"affinity": [], "uniform": []}
    for seed in range(4):
        problem = synthetic_problem(num_servers=4, num_layers=6, num_experts=8, slots_per_server=12,
                                    with_cloud=False, seed=seed)
        joint = problem.profile.freq[:-1, :, None] * problem.profile.trans
        for name, fn in (("affinity", plan_affinity), ("uniform", plan_uniform)):
            h = fn(problem, **({"replicate": False} if name == "affinity" else {})).hosts.astype(float)
            local[name].append(np.einsum("nle,lef,nlf->", h[:, :-1], joint, h[:, 1:]) / joint.sum())
    assert np.mean(local["affinity"]) > np.mean(local["uniform"])


# ------------------------------------------------------------------------------------------ helpers


def test_access_nodes_send_device_users_to_nearest_edge():
    problem = synthetic_problem(num_servers=3, num_users=4, with_devices=True, seed=0)
    fill = fillable_nodes(problem)
    access = access_nodes(problem, fill)
    edge = np.flatnonzero(fill)
    for u in range(4):
        assert access[u] == edge[np.argmin(problem.comm_s[u, edge])]
    with pytest.raises(EdgeMoEError, match="fill"):
        fillable_nodes(problem, "cloud")


def test_proportional_slots_rotate_remainders():
    problem = heterogeneous(synthetic_problem(num_servers=3, num_layers=4, num_experts=8), [6, 6, 3])
    slots = proportional_slots(problem, fillable_nodes(problem))
    assert slots[:3].sum(axis=1).tolist() == [6, 6, 3]
    assert slots[0].tolist() == [2, 2, 1, 1] and slots[1].tolist() == [1, 2, 2, 1]


def test_ensure_coverage_evicts_cheapest_duplicate():
    problem = make_problem(np.array([[0.9, 0.6, 0.4, 0.1]]), FLAT, [2, 2], [0, 1], [0.5, 0.5])
    fill = fillable_nodes(problem)
    hosts = empty_hosts(problem)
    hosts[:, 0, :2] = True
    ensure_coverage(problem, hosts, fill, problem.profile.freq)
    assert hosts.sum() == 4 and hosts[:, 0].any(axis=0).all()


# ---------------------------------------------------------------------------------------- invariants


@st.composite
def random_problem(draw):
    servers = draw(st.integers(1, 5))
    layers, experts = draw(st.integers(1, 4)), draw(st.integers(2, 8))
    cloud = draw(st.booleans())
    min_slots = 0 if cloud else -(-layers * experts // servers)  # no cloud: memory holds each expert once
    slots = draw(st.lists(st.integers(min_slots, min_slots + layers * experts), min_size=servers,
                          max_size=servers))
    problem = synthetic_problem(num_servers=servers, num_users=draw(st.integers(1, 6)), num_layers=layers,
                                num_experts=experts, top_k=min(2, experts), with_cloud=cloud,
                                with_devices=draw(st.booleans()), num_tokens=200,
                                seed=draw(st.integers(0, 1000)))
    return heterogeneous(problem, slots), cloud


@settings(max_examples=25, deadline=None)
@given(random_problem())
def test_every_planner_respects_capacity_and_covers_without_cloud(case):
    problem, cloud = case
    for name, planner in MINE.items():
        fill = fillable_nodes(problem, "edge,device" if name == "lfu" and "device" in problem.node_kind else "edge")
        placement = planner(problem)
        used = placement.bytes_used()
        assert (used[fill] <= problem.capacity_bytes[fill]).all(), name
        assert not placement.hosts[~fill & ~problem.is_cloud].any(), f"{name} filled a non-edge node"
        assert placement.hosts[problem.is_cloud].all(), name
        if not cloud:
            edge = np.array([k == "edge" for k in problem.node_kind])
            assert placement.hosts[edge].any(axis=0).all(), f"{name} left an expert unreachable"
        if name == "uniform":
            assert placement.replicas().max() <= 1


def test_devices_filled_only_when_asked():
    problem = synthetic_problem(num_servers=2, num_users=3, with_devices=True, device_slots=2, seed=4)
    devices = np.array([k == "device" for k in problem.node_kind])
    for name, planner in MINE.items():
        # lfu is device-aware by default (fill="auto"); the others fill edge servers unless asked.
        assert planner(problem).hosts[devices].any() == (name == "lfu"), name
        assert not planner(problem, fill="edge").hosts[devices].any(), name
        both = planner(problem, fill="edge,device")
        assert both.bytes_used()[devices].sum() > 0, name
        assert (both.bytes_used()[devices] <= problem.capacity_bytes[devices]).all(), name


def test_registry_names_my_planners():
    from edgemoe.plan.base import _REGISTRY

    for name, fn in MINE.items():
        assert _REGISTRY[name] is fn


def test_lfu_devices_take_their_owners_top_experts_and_edges_the_rest():
    problem = synthetic_problem(num_servers=2, num_users=3, with_devices=True, device_slots=2, seed=4)
    placement = plan_lfu(problem)
    weighted = problem.user_weight[:, None, None] * problem.user_freq()
    for u, home in enumerate(problem.user_home):
        top = np.argsort(-weighted[u].ravel(), kind="stable")[:2]
        assert sorted(np.flatnonzero(placement.hosts[home].ravel())) == sorted(top.tolist())
    # Edge servers count only what devices do not serve: device-aware beats edge-only LFU on latency.
    from edgemoe.plan.objective import expected_latency

    assert expected_latency(problem, placement.hosts) < expected_latency(problem, plan_lfu(problem, fill="edge").hosts)
