"""Without a cloud every expert must stay reachable: every registered planner, on edge8 and generated clusters."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.cluster.presets import generate
from edgemoe.plan import plan, plan_problem, planners
from edgemoe.plan.synthetic import synthetic_problem
from edgemoe.profile import synthetic_profile

# The example: 4 layers x 16 experts of 200 kB; edge8 holds about 1.8 copies and no cloud.
PROFILE = synthetic_profile(4, 16, 2, num_tokens=500, expert_bytes=200_000)
# The exact ILP gets a smaller model (edge8 with 16 users is slow to prove optimal; any feasible answer
# it returns within the time limit already satisfies the coverage rows).
SMALL_PROFILE = synthetic_profile(2, 4, 2, num_tokens=300, expert_bytes=200_000)
CLUSTERS = {
    "edge8": lambda: "edge8",
    "internet-5x10": lambda: generate(5, 10, seed=1),
    "device-edge-4x8-no-cloud": lambda: generate(4, 8, seed=2, topology="device-edge-cloud", with_cloud=False),
}
PARAMS = {"exact": {"time_limit": 3.0}, "slimcaching": {"kicks": 16}}


def problem_for(cluster_name: str, method: str):
    profile = SMALL_PROFILE if method == "exact" else PROFILE
    problem = plan_problem(profile, CLUSTERS[cluster_name](), domain_fallback=True)
    assert not problem.is_cloud.any()
    return problem


def assert_reachable_and_fits(problem, placement):
    hosts = placement.hosts
    edge = np.array([k == "edge" for k in problem.node_kind])
    assert (placement.bytes_used() <= problem.capacity_bytes).all()
    assert hosts.any(axis=0).all(), f"{placement.method}: {(~hosts.any(axis=0)).sum()} experts have no copy"
    assert hosts[edge].any(axis=0).all(), f"{placement.method}: some expert has no edge-server copy"
    # Every user reaches every expert: an edge copy it can reach (a device copy serves only its owner).
    reach = np.isfinite(problem.comm_s) & edge[None]  # [U, N]
    served = np.einsum("un,nle->ule", reach.astype(np.int64), hosts.astype(np.int64)) > 0
    assert served.all()


@pytest.mark.parametrize("cluster_name", sorted(CLUSTERS))
@pytest.mark.parametrize("method", sorted(planners()))
def test_every_planner_covers_every_expert_without_a_cloud(method, cluster_name):
    problem = problem_for(cluster_name, method)
    placement = plan(problem, method, **PARAMS.get(method, {}))
    assert_reachable_and_fits(problem, placement)


@pytest.mark.parametrize("method", ["greedy", "slimcaching", "u-shaped"])
def test_coverage_off_reproduces_the_gap_that_coverage_closes(method):
    """With coverage=False these planners leave experts without a copy on edge8 (the reported defect)."""
    problem = plan_problem(PROFILE, "edge8", domain_fallback=True)
    params = PARAMS.get(method, {})
    uncovered = ~plan(problem, method, coverage=False, **params).hosts.any(axis=0)
    assert uncovered.any()
    assert plan(problem, method, **params).hosts.any(axis=0).all()


def unused_expert_problem():
    """4 servers x 2 slots (8 slots for 8 experts, no cloud); expert 0 of layer 0 never routed to.

    Without coverage the optimum spends expert (0, 0)'s slot on a duplicate of a routed expert.
    """
    topk = np.array(SMALL_PROFILE.topk).copy()  # [T, L, K]
    for row in topk[:, 0]:
        if 0 in row:
            partner = row[row != 0][0]
            row[row == 0] = min(e for e in range(1, 4) if e != partner)
    profile = replace(SMALL_PROFILE, topk=topk)
    problem = plan_problem(profile, generate(4, 6, seed=0), domain_fallback=True)
    return replace(problem, capacity_bytes=np.full(4, 2 * 200_000, dtype=np.int64))


def test_exact_coverage_rows_bind():
    problem = unused_expert_problem()
    free = plan(problem, "exact", coverage=False, time_limit=10.0)
    covered = plan(problem, "exact", time_limit=10.0)
    assert free.params["optimal"] and covered.params["optimal"] and covered.params["coverage"]
    assert not free.hosts[:, 0, 0].any()
    assert covered.hosts.any(axis=0).all() and (covered.hosts.sum(axis=0) == 1).all()  # 8 slots, one copy each
    # The rows only restrict: the constrained optimum costs at least as much.
    assert covered.params["objective_s"] >= free.params["objective_s"] - 1e-12


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10_000), st.booleans(), st.integers(1, 3))
def test_slimcaching_refinement_keeps_coverage(seed, with_devices, passes):
    """Kicks and block re-solves never drop an expert's last edge copy."""
    problem = synthetic_problem(num_servers=3, num_users=4, num_layers=2, num_experts=6, slots_per_server=5,
                                with_cloud=False, with_devices=with_devices, device_slots=1, num_tokens=300,
                                seed=seed)
    placement = plan(problem, "slimcaching", passes=passes, kicks=8, seed=seed)
    assert placement.params["coverage"]
    assert_reachable_and_fits(problem, placement)
