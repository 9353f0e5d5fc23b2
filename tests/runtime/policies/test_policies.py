"""Policies: hand-checked decisions, invariants over random deployments, budget 0 == exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgemoe.cluster import generate
from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy, policy_names

from ..conftest import CALL, XFER, pair_groups, tiny_cluster, tiny_context, tiny_profile


def test_registry_names():
    assert {"exact", "ordermoe", "drop", "slimcaching", "oracle"} <= set(policy_names())
    with pytest.raises(EdgeMoEError, match="unknown policy"):
        make_policy("nosuch", None)


def test_hand_decisions_home_mode():
    # Layer 0 routes experts (1, 2) with gates (0.7, 0.3). a holds 0 and 2; b holds 1; c holds 3.
    profile = tiny_profile([[1, 2]], num_experts=4, subst_err=0.2)
    cluster = tiny_cluster(("a", "b", "c"), latency={("a", "c"): 0.050})
    ctx = tiny_context(profile, cluster, {"a": [(0, 0), (0, 2)], "b": [(0, 1)], "c": [(0, 3)]},
                       groups=pair_groups(profile))
    topk, gates = np.array([[1, 2]]), np.array([[0.7, 0.3]])

    def run(name, **kw):
        pol = make_policy(name, ctx, **kw)
        state = pol.start(np.array([0]))
        return pol.decide(0, topk, gates, state), state

    exact, _ = run("exact")
    assert exact.experts.tolist() == [[1, 2]] and exact.node.tolist() == [[1, 0]]
    assert exact.latency_s[0] == pytest.approx(2 * XFER + CALL)
    drop, _ = run("drop")
    assert drop.experts.tolist() == [[-1, 2]] and drop.node.tolist() == [[-1, 0]]
    assert drop.latency_s[0] == pytest.approx(CALL)
    sub, state = run("ordermoe", budget=1.0, horizon=0, quality_power=1.0)
    assert sub.experts.tolist() == [[0, 2]] and sub.node.tolist() == [[0, 0]]
    assert sub.quality_cost[0] == pytest.approx(0.7 * 0.2)
    assert state.budget_used[0] == pytest.approx(0.14) and state.layer[0] == 1
    # With load at b larger than the saving... exact still runs it on b (its only copy); the policy sees it.
    loaded = make_policy("exact", ctx).decide(0, topk, gates, make_policy("exact", ctx).start(np.array([0])),
                                              np.array([0.0, 0.5, 0.0]))
    assert loaded.latency_s[0] == pytest.approx(2 * XFER + CALL + 0.5)


def test_exact_prefers_the_cheaper_replica_under_load():
    profile = tiny_profile([[1]])
    ctx = tiny_context(profile, tiny_cluster(("a", "b", "c")), {"a": [(0, 0)], "b": [(0, 1)], "c": [(0, 1)]})
    pol = make_policy("exact", ctx)
    topk, gates = np.array([[1]]), np.array([[1.0]])
    assert pol.decide(0, topk, gates, pol.start(np.array([0])), np.zeros(3)).node[0, 0] == 1  # tie: first
    assert pol.decide(0, topk, gates, pol.start(np.array([0])), np.array([0, 0.01, 0])).node[0, 0] == 2


def test_decisions_must_come_in_layer_order():
    profile = tiny_profile([[1], [1]])
    ctx = tiny_context(profile, tiny_cluster(), {"a": [(0, 0), (1, 0)], "b": [(0, 1), (1, 1)]})
    pol = make_policy("exact", ctx)
    state = pol.start(np.array([0]))
    with pytest.raises(EdgeMoEError, match="in order"):
        pol.decide(1, np.array([[1]]), np.array([[1.0]]), state)


# ------------------------------------------------------------------------------ properties over deployments

DEPLOYMENTS: dict = {}


def deployment(seed: int, topology: str, planner: str, mode: str):
    """A cached random deployment: synthetic profile, generated cluster, a planner's placement, a context."""
    key = (seed, topology, planner, mode)
    if key not in DEPLOYMENTS:
        rng = np.random.default_rng(seed)
        profile = synthetic_profile(num_layers=int(rng.integers(2, 5)), num_experts=int(rng.choice([4, 8])),
                                    top_k=int(rng.integers(1, 4)), num_tokens=300, seed=seed)
        cluster = generate(int(rng.integers(2, 6)), int(rng.integers(2, 8)), seed=seed, topology=topology)
        placement = plan(plan_problem(profile, cluster, domain_fallback=True), planner)
        DEPLOYMENTS[key] = (profile, make_context(profile, cluster, placement, mode=mode, domain_fallback=True))
    return DEPLOYMENTS[key]


def run_layers(pol, profile, ctx, rows, users, load):
    state = pol.start(users)
    decisions = []
    for layer in range(ctx.num_layers):
        topk = profile.topk[rows, layer].astype(np.int64)
        dec = pol.decide(layer, topk, profile.gates[rows, layer], state, load)
        decisions.append((topk, dec))
    return state, decisions


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 6), topology=st.sampled_from(["internet", "device-edge-cloud"]),
       planner=st.sampled_from(["uniform", "ordermoe", "random"]), mode=st.sampled_from(["home", "migrate"]),
       name=st.sampled_from(["exact", "ordermoe", "drop", "slimcaching"]), budget=st.sampled_from([0.0, 0.02, 0.3, 5.0]),
       horizon=st.integers(0, 2), loaded=st.booleans())
def test_policies_respect_hosts_and_budgets(seed, topology, planner, mode, name, budget, horizon, loaded):
    profile, ctx = deployment(seed, topology, planner, mode)
    rng = np.random.default_rng(seed + 1)
    T = 40
    rows = rng.integers(0, profile.num_tokens, T)
    users = rng.integers(0, ctx.num_users, T)
    load = rng.exponential(0.01, ctx.num_nodes) if loaded else None
    params = {"budget": budget, "horizon": horizon} if name == "ordermoe" else {"budget": budget}
    pol = make_policy(name, ctx, **params)
    state, decisions = run_layers(pol, profile, ctx, rows, users, load)
    assert (state.budget_used <= state.budget_total + 1e-9).all()
    group_of = ctx.groups.group_of
    for layer, (topk, dec) in enumerate(decisions):
        ran = dec.experts >= 0
        assert ((dec.node >= 0) == ran).all()
        t, k = np.nonzero(ran)
        assert ctx.hosts[dec.node[t, k], layer, dec.experts[t, k]].all(), "runs an expert its node lacks"
        assert ctx.usable[users[t], dec.node[t, k]].all(), "uses another user's device"
        sub = dec.substituted(topk)
        ts, ks = np.nonzero(sub)
        assert (dec.node[ts, ks] == dec.location[ts]).all(), "substitutes run where the token is"
        assert (group_of[layer, dec.experts[ts, ks]] == group_of[layer, topk[ts, ks]]).all()
        assert (dec.quality_cost >= 0).all()
        if mode == "home":
            assert (dec.next_location == state.home).all()
        elif name == "ordermoe" and horizon >= 1:  # steered: the token may be positioned on any node it may use
            assert ctx.usable[users, dec.next_location].all()
        else:
            allowed = np.concatenate([dec.location[:, None], dec.node], axis=1)
            assert (allowed == dec.next_location[:, None]).any(axis=1).all()
        if name != "ordermoe" or budget == 0:
            assert not sub.any()
        if name not in ("drop", "ordermoe") or (name == "ordermoe" and budget == 0):
            assert ran.all()
        if dec.zeroed is not None:
            assert (dec.experts[dec.zeroed] < 0).all()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 6), topology=st.sampled_from(["internet", "device-edge-cloud"]),
       mode=st.sampled_from(["home", "migrate"]), horizon=st.integers(0, 2), loaded=st.booleans())
def test_unsteered_ordermoe_with_zero_budget_is_exact(seed, topology, mode, horizon, loaded):
    profile, ctx = deployment(seed, topology, "ordermoe", mode)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, profile.num_tokens, 30)
    users = rng.integers(0, ctx.num_users, 30)
    load = rng.exponential(0.01, ctx.num_nodes) if loaded else None
    _, a = run_layers(make_policy("ordermoe", ctx, budget=0.0, horizon=horizon, steer=False), profile, ctx, rows, users, load)
    _, b = run_layers(make_policy("exact", ctx), profile, ctx, rows, users, load)
    for (_, da), (_, db) in zip(a, b, strict=True):
        for field in ("experts", "node", "location", "next_location", "quality_cost", "latency_s"):
            np.testing.assert_array_equal(getattr(da, field), getattr(db, field))


def test_ordermoe_lowers_latency_on_edge8_at_a_cost_within_budget():
    profile = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=600)
    from edgemoe.cluster import load_cluster

    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe")
    ctx = make_context(profile, cluster, placement, mode="home", domain_fallback=True)
    rows, users = np.arange(400), np.arange(400) % ctx.num_users
    state_x, dx = run_layers(make_policy("exact", ctx), profile, ctx, rows, users, None)
    state_o, do = run_layers(make_policy("ordermoe", ctx, budget=0.1), profile, ctx, rows, users, None)
    lat_x = sum(d.latency_s for _, d in dx)
    lat_o = sum(d.latency_s for _, d in do)
    assert lat_o.mean() < lat_x.mean()
    assert (state_o.budget_used <= state_o.budget_total + 1e-12).all()
    assert state_o.budget_used.sum() > 0
