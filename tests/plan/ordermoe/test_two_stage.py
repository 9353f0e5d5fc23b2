"""OrderMoE's two-stage ablation (algorithm="two-stage"): the worked example, spreading of groups,
lazy greedy = plain greedy, ablations."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.errors import EdgeMoEError
from edgemoe.plan.baselines.heuristics import plan_uniform
from edgemoe.plan.nodes import fillable_nodes, node_load
from edgemoe.plan.ordermoe.planner import (
    _GainModel,
    coverage_order,
    plan_ordermoe,
    redundant_deployment,
    representative_coverage,
    representativeness,
)
from edgemoe.plan.synthetic import synthetic_problem
from edgemoe.profile.groups import layer_aware_groups

from ..conftest import make_problem, symmetric_sim


def two_stage(problem, **kwargs):
    return plan_ordermoe(problem, algorithm="two-stage", **kwargs)

# The worked example of docs/planners-ordermoe.md: one layer, experts 0~1 and 2~3 similar,
# two servers of 3 slots, user0 (70 % of tokens) homed on edge0, user1 (30 %) on edge1, 20 ms apart.
FREQ = np.array([[0.8, 0.6, 0.4, 0.2]])
SIM = symmetric_sim(4, {(0, 1): 0.9, (2, 3): 0.8})[None]


def example_problem(**kwargs):
    return make_problem(FREQ, SIM, slots=[3, 3], user_home=[0, 1], user_weight=[0.7, 0.3], **kwargs)


def test_worked_example_groups_and_representativeness():
    problem = example_problem()
    groups = layer_aware_groups(problem.profile)
    assert groups.group_of.tolist() == [[0, 0, 1, 1]]
    rep = representativeness(groups, FREQ, SIM)
    # rep(0) = 0.6 * 0.9 / 1.4; rep(1) = 0.8 * 0.9 / 1.4; rep(2) = 0.2 * 0.8 / 0.6; rep(3) = 0.4 * 0.8 / 0.6
    assert rep[0] == pytest.approx([0.54 / 1.4, 0.72 / 1.4, 0.16 / 0.6, 0.32 / 0.6])
    # Rank-major order: dominants 0, 2 (by importance), then the second members 1, 3.
    assert coverage_order(groups, FREQ * (1 + rep)).tolist() == [[0, 0], [0, 2], [0, 1], [0, 3]]


def test_worked_example_stage1_spreads_groups():
    placement = two_stage(example_problem(), redundancy=False)
    # 0 -> edge0 (load 0.7 beats 0.3); 2 -> edge0 (neither holds group 1; 0.7 + 0.1*2/3 > 0.3 + 0.1);
    # 1 -> edge1 (edge0 already holds group 0's 0); 3 -> edge1 likewise. Each server covers both groups.
    assert placement.hosts[:, 0].astype(int).tolist() == [[1, 0, 1, 0], [0, 1, 0, 1]]


def test_worked_example_stage2_busiest_first():
    placement = two_stage(example_problem())
    # edge0 (busiest) first. Its candidates 1 and 3 both have a local substitute there (gamma = 0.5):
    #   gain(1) = (1 + 0.514) * 0.7 * 0.6 * 0.020 s * 0.5 = 6.4e-3 > gain(3) = (1 + 0.533) * 0.7 * 0.2 * 0.020 * 0.5
    # then edge1: gain(0) = (1 + 0.386) * 0.3 * 0.8 * 0.020 * 0.5 > gain(2) = (1 + 0.267) * 0.3 * 0.4 * 0.020 * 0.5
    assert placement.hosts[:, 0].astype(int).tolist() == [[1, 1, 1, 0], [1, 1, 0, 1]]
    assert placement.bytes_used().tolist() == [3_000_000, 3_000_000]
    assert placement.params["num_groups"] == [2]


def test_ablations_record_params_and_differ():
    problem = synthetic_problem(num_servers=4, num_layers=4, num_experts=8, slots_per_server=12, seed=3)
    full = two_stage(problem)
    no_red = two_stage(problem, redundancy=False)
    uniform = two_stage(problem, grouping="uniform")
    fixed = two_stage(problem, grouping="fixed", groups_per_layer=2)
    fill = fillable_nodes(problem)
    # With a cloud, stage 1 places one representative (the dominant) per group by default ...
    dominants = layer_aware_groups(problem.profile).is_dominant()
    assert no_red.params["cover"] == "dominants" and np.array_equal(no_red.replicas(), dominants.astype(int))
    # ... and every expert once when asked (the no-cloud default).
    assert (two_stage(problem, redundancy=False, cover="all").replicas() == 1).all()
    assert two_stage(problem, redundancy=False, cover="none").replicas().sum() == 0
    assert full.bytes_used()[fill].sum() == problem.capacity_bytes[fill].sum()  # stage 2 spends all memory
    assert uniform.params["grouping"] == "uniform" and fixed.params["num_groups"] == [2, 2, 2, 2]
    assert not np.array_equal(full.hosts, no_red.hosts)
    with pytest.raises(EdgeMoEError, match="grouping"):
        two_stage(problem, grouping="spectral")
    with pytest.raises(EdgeMoEError, match="cover"):
        two_stage(problem, cover="some")
    with pytest.raises(EdgeMoEError, match="gamma"):
        two_stage(problem, gamma=1.5)


def _colocated_pairs(hosts, groups, fill):
    """Fraction of same-group member pairs that share a server."""
    held = hosts[fill]
    same = total = 0
    for layer in range(groups.num_layers):
        for grp in range(groups.num_groups[layer]):
            members = groups.members(layer, grp)
            for i, a in enumerate(members):
                for b in members[i + 1:]:
                    total += 1
                    same += bool((held[:, layer, a] & held[:, layer, b]).any())
    return same / max(total, 1)


@pytest.mark.parametrize("slots", [24, 40])
def test_ordermoe_spreads_group_members_more_than_uniform(slots):
    ours, theirs = [], []
    for seed in range(4):
        problem = synthetic_problem(num_servers=4, num_layers=6, num_experts=16, slots_per_server=slots,
                                    with_cloud=False, seed=seed)
        groups = layer_aware_groups(problem.profile)
        fill = fillable_nodes(problem)
        ours.append(_colocated_pairs(two_stage(problem, redundancy=False).hosts, groups, fill))
        theirs.append(_colocated_pairs(plan_uniform(problem).hosts, groups, fill))
    assert all(o <= t for o, t in zip(ours, theirs, strict=True))
    assert np.mean(ours) < np.mean(theirs)


def test_busiest_server_gets_representatives_of_most_groups():
    problem = synthetic_problem(num_servers=4, num_users=8, num_layers=4, num_experts=8, slots_per_server=10,
                                with_cloud=True, seed=2)
    weight = np.array([5.0, 1, 1, 1, 5.0, 1, 1, 1])  # users 0 and 4 are homed on edge0
    problem = replace(problem, user_weight=weight / weight.sum())
    fill = fillable_nodes(problem)
    load = node_load(problem, fill)
    groups = layer_aware_groups(problem.profile)
    hosts = representative_coverage(problem, groups, problem.profile.freq, fill, load)
    covered = [
        sum(hosts[n, layer, groups.members(layer, g)].any() for layer in range(4) for g in range(groups.num_groups[layer]))
        for n in range(4)
    ]
    assert int(np.argmax(load)) == 0
    assert covered[0] == max(covered)


def _plain_greedy(problem, groups, hosts, fill, load, weight, rep_factor, gamma):
    """Reference for stage 2: recompute every gain after every pick (no lazy evaluation)."""
    model = _GainModel(problem, groups, hosts, fill, rep_factor, gamma)
    sizes = problem.expert_bytes
    for node in sorted(np.flatnonzero(fill), key=lambda n: (-load[n], n)):
        while True:
            free = problem.capacity_bytes[node] - (hosts[node] * sizes).sum()
            per_byte = np.where(sizes <= free, model.gains(int(node)) / sizes, 0.0)
            if per_byte.max() <= 0:
                break
            layer, expert = np.unravel_index(int(np.argmax(per_byte)), per_byte.shape)
            model.add(int(node), int(layer), int(expert))
    return hosts


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 4), st.integers(6, 14), st.booleans())
def test_lazy_stage2_matches_plain_greedy(seed, servers, slots, cloud):
    problem = synthetic_problem(num_servers=servers, num_users=5, num_layers=3, num_experts=6,
                                slots_per_server=slots, with_cloud=cloud, num_tokens=300, seed=seed)
    groups = layer_aware_groups(problem.profile)
    fill = fillable_nodes(problem)
    load = node_load(problem, fill)
    freq = problem.profile.freq
    rep = representativeness(groups, freq, problem.profile.sim)
    stage1 = representative_coverage(problem, groups, freq * (1 + rep), fill, load)
    expected = _plain_greedy(problem, groups, stage1.copy(), fill, load, freq, 1 + rep, 0.9)
    got = redundant_deployment(problem, groups, stage1.copy(), fill, load, freq, 1 + rep, 0.9, fill_rest=False)
    np.testing.assert_array_equal(got, expected)
