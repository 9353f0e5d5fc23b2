"""Speed paths of the simulator and the policies give the same answers as the plain definitions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgemoe.cluster import generate, load_cluster
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy
from edgemoe.runtime.policy import _choose_replicas_full, choose_replicas, replica_shortlist
from edgemoe.runtime.sim.des import run_reference
from edgemoe.runtime.sim.simulate import run_fast, simulate_scenario
from edgemoe.runtime.sim.workload import Trace, Workload, build_scenario

from ..conftest import CALL, XFER, tiny_cluster, tiny_context, tiny_profile


@pytest.fixture(scope="module")
def cloud_ctx():
    """24 servers + a cloud, experts replicated a few times: many replicas to choose from."""
    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=300, seed=1)
    cluster = generate(24, 40, seed=2, copies=4, with_cloud=True)
    placement = plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe")
    return make_context(profile, cluster, placement, mode="migrate", domain_fallback=True)


def brute_force(ctx, layer, location, experts, load, cloud):
    node = _choose_replicas_full(ctx, layer, location, ctx.usable[np.zeros(len(layer), np.int64)], experts, load, cloud)
    at_home = ctx.hosts[location[:, None], layer[:, None], experts]
    return np.where(at_home, location[:, None], node)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), load_scale=st.sampled_from([0.0, 1e-4, 3e-3, 0.05, 1.0]),
       busy_share=st.sampled_from([0.1, 0.5, 1.0]), cloud=st.sampled_from(["fallback", "candidate"]))
def test_replica_shortlist_picks_the_brute_force_node(cloud_ctx, seed, load_scale, busy_share, cloud):
    ctx = cloud_ctx
    rng = np.random.default_rng(seed)
    T = 400  # T * K * N above the shortlist threshold
    layer = rng.integers(0, ctx.num_layers, T)
    location = rng.integers(0, ctx.num_nodes, T)
    experts = rng.integers(0, ctx.num_experts, (T, ctx.top_k))
    load = rng.exponential(load_scale, ctx.num_nodes) * (rng.random(ctx.num_nodes) < busy_share)
    usable = np.ones((T, ctx.num_nodes), bool)
    fast = choose_replicas(ctx, layer, location, usable, experts, load, cloud)
    assert np.array_equal(fast, brute_force(ctx, layer, location, experts, load, cloud))


def test_replica_shortlist_ties_go_to_the_lowest_node_index():
    # Three identical nodes, expert 1 on b and c only: from a, b and c tie and b (index 1) must win; with load
    # on b, c wins; with equal load on both, b again. The shortlist of 2 holds b and c.
    profile = tiny_profile([[1]])
    ctx = tiny_context(profile, tiny_cluster(("a", "b", "c")), {"a": [(0, 0)], "b": [(0, 1)], "c": [(0, 1)]})
    T = 2000
    args = (np.zeros(T, np.int64), np.zeros(T, np.int64), np.ones((T, 3), bool), np.ones((T, 1), np.int64))
    for load, expected in (([0, 0, 0], 1), ([0, 1e-3, 0], 2), ([0, 1e-3, 1e-3], 1)):
        node = choose_replicas(ctx, *args, np.array(load, float))
        assert (node == expected).all()
    table = replica_shortlist(ctx, "fallback")
    assert table.node[0, 0, 1].tolist()[:2] == [1, 2]


def test_replica_shortlist_unproven_rows_fall_back():
    # More replicas than the shortlist keeps, and heavy load on some: the shortlist cannot prove every pick.
    profile = synthetic_profile(num_layers=2, num_experts=4, top_k=2, num_tokens=200, seed=0)
    cluster = generate(40, 60, seed=0, copies=30)
    ctx = make_context(profile, cluster, plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe"),
                       domain_fallback=True)
    rng = np.random.default_rng(0)
    T, N = 600, ctx.num_nodes
    layer, location = rng.integers(0, 2, T), rng.integers(0, N, T)
    experts = rng.integers(0, 4, (T, 2))
    load = rng.exponential(0.5, N)  # every node busy, by far more than the link differences
    table = replica_shortlist(ctx, "fallback")
    assert table.size < ctx.hosts.sum(axis=0).max()  # some (layer, expert) has replicas left out
    _, proven = table.pick(layer, location, experts, load)
    assert not proven.all()  # the fallback path is exercised
    fast = choose_replicas(ctx, layer, location, np.ones((T, N), bool), experts, load)
    assert np.array_equal(fast, brute_force(ctx, layer, location, experts, load, "fallback"))


# ------------------------------------------------------------------------------ compiled fast engine


@pytest.mark.parametrize("engine,window", [("reference", 0.0), ("fast", 0.0), ("fast", 1e-3)])
def test_long_prompt_rides_one_batched_call(engine, window):
    # 1500 prompt tokens all route to expert 1, held by b only: they travel together (11 ms), share one call
    # (2 ms: the overhead; compute and weight reads are negligible) and come back (11 ms): TTFT 24 ms.
    # (The fast engine prices a batch this size by sorting, and grows its job store past 1024 jobs.)
    profile = tiny_profile([[1]])
    ctx = tiny_context(profile, tiny_cluster(), {"a": [(0, 0)], "b": [(0, 1)]}, mode="home")
    trace = Trace.from_profile(profile)
    wl = Workload(num_requests=1, prompt_tokens=1500, gen_tokens=2, arrival="closed")
    m = simulate_scenario(ctx, make_policy("exact", ctx), trace,
                          build_scenario(ctx.user_weight, ctx.user_domain, trace, wl), engine, window)
    assert m.ttft_ms["mean"] == pytest.approx(2 * XFER * 1e3 + CALL * 1e3)
    assert m.latency_ms["mean"] == pytest.approx(24.0)
    assert m.utilisation["b"] == pytest.approx(2 * CALL / m.makespan_s)


@pytest.fixture(scope="module")
def small_deployments():
    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=400, seed=4)
    out = {}
    for name, cluster in (("edge8", load_cluster("edge8")), ("generated", generate(12, 30, seed=5, copies=3, with_cloud=True))):
        placement = plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe")
        for mode in ("migrate", "home"):
            out[name, mode] = make_context(profile, cluster, placement, mode=mode, domain_fallback=True)
    return profile, out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), deployment=st.sampled_from(["edge8", "generated"]),
       mode=st.sampled_from(["migrate", "home"]), policy=st.sampled_from(["exact", "ordermoe", "drop", "slimcaching"]),
       arrival=st.sampled_from(["poisson", "closed"]))
def test_fast_engine_with_window_0_is_the_reference(small_deployments, seed, deployment, mode, policy, arrival):
    # Same event order, same arithmetic: every pass ends at the same time, every count is the same.
    # OrderMoE runs with its adaptive weights frozen (ewma=0): its feedback is read every 8 policy calls, and a
    # call is one pass-layer in the reference but one wave (every pass at the same instant) in the fast engine,
    # so the weights move at different moments (test_adaptive_feedback_cadence_differs below).
    _assert_engines_agree(small_deployments, seed, deployment, mode, policy, arrival,
                          {"ewma": 0.0} if policy == "ordermoe" else {})


@pytest.mark.xfail(strict=True, reason="known: Feedback's cadence counts policy calls, which the two engines group "
                   "differently; fix = observe the passes finished by the decision's time (docs/runtime.md)")
def test_adaptive_feedback_cadence_differs(small_deployments):
    # The one case found (hypothesis, stop 25): with adaptation on, one decode decision drops where the
    # reference calls the remote expert.
    _assert_engines_agree(small_deployments, 3099, "generated", "migrate", "ordermoe", "closed", {})


def _assert_engines_agree(small_deployments, seed, deployment, mode, policy, arrival, params):
    profile, contexts = small_deployments
    ctx = contexts[deployment, mode]
    trace = Trace.from_profile(profile)
    wl = Workload(num_requests=12, prompt_tokens=3, gen_tokens=4, arrival=arrival, rate_per_s=50.0, seed=seed)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, wl)
    ref = run_reference(ctx, make_policy(policy, ctx, **params), trace, sc)
    fast = run_fast(ctx, make_policy(policy, ctx, **params), trace, sc, 0.0)
    np.testing.assert_allclose(fast.pass_end, ref.pass_end, rtol=1e-12, atol=0)
    np.testing.assert_allclose(fast.request_arrival, ref.request_arrival, rtol=1e-12, atol=0)
    np.testing.assert_allclose(fast.node_busy, ref.node_busy, rtol=1e-12, atol=1e-15)
    for field in ("slots", "remote", "substituted", "dropped", "token_layers", "prefill_bytes", "decode_bytes"):
        assert getattr(fast.tally, field) == getattr(ref.tally, field), field


@pytest.mark.parametrize("policy", ["exact", "slimcaching", "drop"])
@pytest.mark.parametrize("mode", ["migrate", "home"])
@pytest.mark.parametrize("window", [0.0, 1e-3])
@pytest.mark.parametrize("sorted_search", [True, False])
def test_compiled_rule_is_the_policy_call_bit_for_bit(small_deployments, policy, mode, window, sorted_search,
                                                      monkeypatch):
    # The compiled loop decides by the policy's rule; the per-wave policy call is the definition. Both
    # replica searches: sorted per location (every node usable) and the plain scan of the holders.
    from edgemoe.runtime.sim import rules

    if not sorted_search:
        monkeypatch.setattr(rules, "SORTED_MAX_CELLS", 0)
    profile, contexts = small_deployments
    ctx = contexts["generated", mode]
    trace = Trace.from_profile(profile)
    wl = Workload(num_requests=30, prompt_tokens=5, gen_tokens=4, arrival="closed", seed=11)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, wl)
    assert make_policy(policy, ctx).compiled_rule() == policy
    compiled = run_fast(ctx, make_policy(policy, ctx), trace, sc, window)
    plain = run_fast(ctx, make_policy(policy, ctx), trace, sc, window, compiled=False)
    for field in ("pass_begin", "pass_end", "request_arrival", "node_busy"):
        np.testing.assert_array_equal(getattr(compiled, field), getattr(plain, field), err_msg=field)
    assert compiled.tally == plain.tally


def test_a_policy_deciding_otherwise_does_not_inherit_the_compiled_rule(small_deployments):
    from edgemoe.runtime.policies.baselines import ExactPolicy

    class Tweaked(ExactPolicy):
        def choose(self, layer, topk, gates, state, load):
            return super().choose(layer, topk, gates, state, load * 2)

    _, contexts = small_deployments
    assert Tweaked(contexts["edge8", "migrate"]).compiled_rule() is None
    # ordermoe's own rule (its compiled loop, tests/runtime/sim/test_ordermoe_loop.py); its subclasses that
    # decide otherwise do not inherit it
    from edgemoe.runtime.policies.ordermoe import COMPILED_LOOP, OrderMoEPolicy

    assert make_policy("ordermoe", contexts["edge8", "migrate"]).compiled_rule() == ("ordermoe" if COMPILED_LOOP else None)

    class Steered(OrderMoEPolicy):
        def choose(self, layer, topk, gates, state, load):
            return super().choose(layer, topk, gates, state, load * 2)

    assert Steered(contexts["edge8", "migrate"]).compiled_rule() is None
