"""The SlimCaching objective: a hand-checked golden example and invariants."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.plan.base import PlanProblem, empty_hosts
from edgemoe.plan.objective import expected_latency, expected_latency_per_user, latency_reduction
from edgemoe.plan.synthetic import synthetic_problem
from edgemoe.profile.store import synthetic_profile


def golden_problem() -> PlanProblem:
    """2 users (devices d0, d1), 1 edge server, a cloud; 1 layer, 3 experts, K = 2.

    User 0 (domain 0) picks {0, 1} half the time and {1, 2} half the time; user 1 (domain 1) always {0, 2}.
    Times (seconds): edge call 10 for both users (comm 9 + compute 1), cloud 100 (comm 99 + compute 1),
    own device 5 (comm 0 + compute 5). Weights 0.75 / 0.25.
    """
    base = synthetic_profile(num_layers=1, num_experts=3, top_k=2, num_tokens=4, num_domains=2, seed=0)
    topk = np.array([[[0, 1]], [[1, 2]], [[0, 2]], [[2, 0]]], dtype=np.int16)  # [T=4, L=1, K=2]
    domain = np.array([0, 0, 1, 1], dtype=np.int16)
    profile = base.__class__(**{**base.__dict__, "topk": topk, "domain": domain})
    names = ("edge0", "d0", "d1", "cloud")
    comm = np.array([[9.0, 0.0, np.inf, 99.0], [9.0, np.inf, 0.0, 99.0]])
    compute = np.array([1.0, 5.0, 5.0, 1.0])[:, None, None] * np.ones((4, 1, 3))
    return PlanProblem(
        profile=profile, node_names=names, node_kind=("edge", "device", "device", "cloud"),
        capacity_bytes=np.array([2, 1, 1, 3]) * 1_000_000, user_names=("u0", "u1"), user_home=np.array([1, 2]),
        user_weight=np.array([0.75, 0.25]), user_domain=np.array([0, 1]), comm_s=comm, compute_s=compute,
        expert_bytes=np.full((1, 3), 1_000_000, dtype=np.int64),
    )


def test_golden_example_by_hand():
    p = golden_problem()
    hosts = empty_hosts(p)
    # All cloud: every layer costs 100 for both users.
    assert expected_latency_per_user(p, hosts) == pytest.approx([100.0, 100.0])
    # Edge holds {0, 1}; d0 holds 2; d1 holds nothing.
    hosts[0, 0, [0, 1]] = True
    hosts[1, 0, 2] = True
    # u0: {0,1} -> max(10, 10) = 10; {1,2} -> max(10, 5) = 10; mean 10.
    # u1: {0,2} -> max(10, 100) = 100 (d0 serves only u0).
    per_user = expected_latency_per_user(p, hosts)
    assert per_user == pytest.approx([10.0, 100.0])
    assert expected_latency(p, hosts) == pytest.approx(0.75 * 10 + 0.25 * 100)
    # Add expert 0 on d1: u1's set {0, 2} still waits for 2 from the cloud (the max), nothing changes.
    hosts[2, 0, 0] = True
    assert expected_latency_per_user(p, hosts)[1] == pytest.approx(100.0)
    # Move 2 to d1 as well: u1 -> max(5, 5) = 5.
    hosts[2, 0, 2] = True
    assert expected_latency_per_user(p, hosts)[1] == pytest.approx(5.0)
    assert latency_reduction(p, hosts) == pytest.approx(100.0 - (0.75 * 10 + 0.25 * 5))


def test_cloud_flag_does_not_matter_and_more_caching_never_hurts():
    p = synthetic_problem(with_devices=True, seed=1)
    rng = np.random.default_rng(0)
    hosts = empty_hosts(p)
    hosts[:-1] = rng.random(hosts[:-1].shape) < 0.2
    value = expected_latency(p, hosts)
    no_cloud_flag = hosts.copy()
    no_cloud_flag[-1] = False  # the cloud holds everything whatever the mask says
    assert expected_latency(p, no_cloud_flag) == pytest.approx(value)
    more = hosts | (rng.random(hosts.shape) < 0.1)
    assert expected_latency(p, more) <= value + 1e-15
    assert expected_latency(p, empty_hosts(p)) >= value


def test_other_users_devices_serve_nobody():
    p = golden_problem()
    hosts = empty_hosts(p)
    hosts[1, 0, :] = True  # d0 holds everything: only u0 benefits
    assert expected_latency_per_user(p, hosts) == pytest.approx([5.0, 100.0])


def test_no_cloud_uses_a_finite_miss_penalty():
    """The golden example without its cloud, by hand: a missing expert costs MISS_PENALTY_FACTOR (10) x the
    slowest finite call (the edge call, 10 s) = 100 s, and a layer costs its slowest expert."""
    import dataclasses

    from edgemoe.plan.objective import MISS_PENALTY_FACTOR

    p = golden_problem()
    q = dataclasses.replace(p, node_names=p.node_names[:3], node_kind=p.node_kind[:3], capacity_bytes=p.capacity_bytes[:3],
                            comm_s=p.comm_s[:, :3], compute_s=p.compute_s[:3])
    assert MISS_PENALTY_FACTOR == 10.0
    hosts = empty_hosts(q)
    assert expected_latency_per_user(q, hosts) == pytest.approx([100.0, 100.0])  # everything misses
    hosts[0, 0, [0, 1]] = True  # the edge holds {0, 1}: u0's {0, 1} costs 10, its {1, 2} misses 2; u1's {0, 2} misses 2
    assert expected_latency_per_user(q, hosts) == pytest.approx([(10.0 + 100.0) / 2, 100.0])
    hosts[2, 0, 2] = True  # d1 holds 2 for u1 alone: {0, 2} = max(edge 10, own device 5)
    assert expected_latency_per_user(q, hosts) == pytest.approx([55.0, 10.0])
    assert expected_latency(q, hosts) == pytest.approx(0.75 * 55.0 + 0.25 * 10.0)
    # on a larger problem the penalty stays finite and above every finite call
    big = synthetic_problem(with_cloud=False, seed=2)
    value = expected_latency(big, empty_hosts(big))
    assert np.isfinite(value) and value >= MISS_PENALTY_FACTOR * big.call_s()[np.isfinite(big.call_s())].max() * 0.999
