"""plan_problem: a profile on a cluster -> the PlanProblem (hand-checked on the triangle cluster)."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.cluster import cost
from edgemoe.cluster.schema import build_cluster
from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan_problem
from edgemoe.profile import synthetic_profile


@pytest.fixture
def profile():
    # 2 layers x 4 experts of 1 MB, FLOPs = bytes (2 x params at 2 bytes), hidden 128 -> 256 bytes on the wire
    return synthetic_profile(num_layers=2, num_experts=4, top_k=2, num_tokens=400, num_domains=2,
                             expert_bytes=1_000_000, hidden_size=128, seed=3)


def test_plan_problem_shapes_and_hand_checked_entries(triangle, profile):
    c = build_cluster(triangle)
    p = plan_problem(profile, c, domain_fallback=True)
    N, U, L, E = 3, 2, 2, 4
    assert p.capacity_bytes.shape == (N,) and p.comm_s.shape == (U, N) and p.compute_s.shape == (N, L, E)
    assert p.node_names == ("a", "b", "cloud") and p.node_kind == ("edge", "edge", "cloud")
    # a: 3 MB; b: half of 8 MB; cloud: all 8 MB
    np.testing.assert_array_equal(p.capacity_bytes, [3_000_000, 4_000_000, 8_000_000])
    # alice (home a) -> b and back: 2 x (10 ms + 256 B / 1 MB/s)
    assert p.comm_s[0, 1] == pytest.approx(2 * (0.010 + 256 / 1e6))
    assert p.comm_s[0, 0] == 0.0 and p.comm_s[1, 1] == 0.0
    # bob (home b) -> cloud: 50 ms + 256 B / 10 MB/s each way
    assert p.comm_s[1, 2] == pytest.approx(2 * (0.050 + 256 / 1e7))
    # node a: 100 us + max(1 MFLOP / 1 TFLOP/s, 1 MB / 1 GB/s) = 1.1 ms; node b: 0.1 + 0.5 ms
    np.testing.assert_allclose(p.compute_s[0], 1.1e-3)
    np.testing.assert_allclose(p.compute_s[1], 0.6e-3)
    np.testing.assert_allclose(p.user_weight, [0.75, 0.25])
    np.testing.assert_array_equal(p.user_home, [0, 1])
    # call_s = comm + compute is the remote-call formula
    assert p.call_s()[0, 1, 0, 0] == pytest.approx(
        float(cost.remote_call_s(256, 0.010, 1e6, 0.010, 1e6, 0.6e-3)))
    assert p.params["cluster"] == "triangle" and p.params["hidden_bytes"] == 256


def test_plan_problem_domains(triangle, profile):
    c = build_cluster(triangle)
    with pytest.raises(EdgeMoEError, match=r"users\[0\].domain is 'wiki'.*--domain-fallback"):
        plan_problem(profile, c)
    # unknown domains in order of first appearance go round-robin over the profile's
    p = plan_problem(profile, c, domain_fallback=True)
    np.testing.assert_array_equal(p.user_domain, [0, 1])
    assert p.params["domain_map"] == {"wiki": "domain0", "code": "domain1"}
    triangle["users"][0]["domain"] = "domain1"
    np.testing.assert_array_equal(plan_problem(profile, build_cluster(triangle), domain_fallback=True).user_domain, [1, 0])


def test_plan_problem_queueing_only_on_remote_calls(triangle, profile):
    triangle["nodes"][1]["utilisation"] = 0.5
    c = build_cluster(triangle)
    base = plan_problem(profile, c, queueing=False, domain_fallback=True)
    queued = plan_problem(profile, c, domain_fallback=True)
    # b's mean call takes 0.6 ms; at rho = 0.5 the wait is 0.6 ms, paid by alice (remote), not bob (local)
    assert queued.comm_s[0, 1] - base.comm_s[0, 1] == pytest.approx(0.6e-3)
    assert queued.comm_s[1, 1] == 0.0
    np.testing.assert_allclose(queued.compute_s, base.compute_s)
    triangle["nodes"][1]["service_rate"] = 500.0  # mu = 500 calls/s -> W = 0.5 / (500 * 0.5) = 2 ms
    assert plan_problem(profile, build_cluster(triangle), domain_fallback=True).params["queue_s"]["b"] == pytest.approx(2e-3)


def test_plan_problem_batched_calls(triangle, profile):
    c = build_cluster(triangle)
    p = plan_problem(profile, c, tokens_per_call=2000, domain_fallback=True)
    # node a, 2000 tokens x 1 MFLOP = 2 GFLOP at 1 TFLOP/s = 2 ms (compute-bound now) + 0.1 ms
    np.testing.assert_allclose(p.compute_s[0], 2.1e-3)
    assert p.comm_s[0, 1] == pytest.approx(2 * (0.010 + 2000 * 256 / 1e6))
    with pytest.raises(EdgeMoEError, match="tokens_per_call"):
        plan_problem(profile, c, tokens_per_call=0)


def test_plan_problem_rejects_too_small_cluster_without_cloud(triangle, profile):
    triangle["nodes"] = triangle["nodes"][:2]
    triangle["links"] = triangle["links"][:1]
    triangle["nodes"][0]["memory"] = 1_000_000
    with pytest.raises(EdgeMoEError, match="no cloud"):
        plan_problem(profile, build_cluster(triangle), domain_fallback=True)


def test_plan_problem_is_the_clusters_cost_tables(triangle, profile):
    c = build_cluster(triangle)
    p = plan_problem(profile, c, tokens_per_call=3, domain_fallback=True)
    t = cost.cost_tables(c, profile.expert_bytes, profile.expert_flops, profile.meta.hidden_bytes,
                         freq=profile.freq, tokens_per_call=3)
    for name in ("capacity_bytes", "compute_s", "comm_s", "xfer_s"):
        np.testing.assert_array_equal(getattr(p, name), getattr(t, name))
    assert p.params["queue_s"] == dict(zip(c.node_names, t.queue_s.tolist(), strict=True))


def test_plan_problem_loads_presets_by_name(profile):
    p = plan_problem(profile, "edge8", domain_fallback=True)
    assert p.params["cluster"] == "edge8" and p.params["cluster_source"] == "edge8"
