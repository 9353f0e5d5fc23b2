"""OrderMoE's runtime: stand-in kinds, steering with the look-ahead, the hindsight oracle, adaptive weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgemoe.cluster import load_cluster
from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy
from edgemoe.runtime.local import replay_decisions
from edgemoe.runtime.policies.ordermoe import layer_options
from edgemoe.runtime.policies.ordermoe_kernel import weight_steps
from edgemoe.runtime.sim.simulate import simulate
from edgemoe.runtime.sim.workload import Trace, Workload

from ..conftest import CALL, XFER, pair_groups, tiny_cluster, tiny_context, tiny_profile


def test_stand_in_costs_known_answers():
    # a holds 0 and 2; expert 1 (gate 0.6) only on b. err(1 -> 0) = 0.2 (pair group), err(1 -> 2) = 1.0.
    profile = tiny_profile([[1, 2]], num_experts=4, subst_err=0.2)
    ctx = tiny_context(profile, tiny_cluster(("a", "b")), {"a": [(0, 0), (0, 2), (0, 3)], "b": [(0, 1)]},
                       groups=pair_groups(profile))
    topk, gates = np.array([[1, 2]]), np.array([[0.6, 0.4]])
    args = (ctx, np.array([0]), np.array([0]), np.array([0]), np.ones((1, 2), bool), topk, gates, np.zeros(2))
    for kinds, expect_q, expect_e, zero in [(("sub",), 0.6 * 0.2, 0, False), (("drop",), 0.6 * 1.0, -1, False),
                                           (("zero",), 0.6, -1, True)]:
        opt = layer_options(*args, kinds=kinds, power=1.0)
        act = 1  # action bits: action 1 replaces slot 0 only
        assert opt.mask[0, act].tolist() == [True, False] and opt.valid[0, act]
        assert opt.quality[0, act] == pytest.approx(expect_q)
        assert opt.experts[0, act, 0] == expect_e and bool(opt.zeroed[0, act, 0]) == zero
        assert opt.latency_s[0, act] == pytest.approx(CALL)  # everything at a now
        assert not opt.valid[0, 2]  # slot 1 is local: it is never replaced
    # all kinds: the least quality cost wins (the substitute); the default charges its square
    opt = layer_options(*args)
    assert opt.experts[0, 1].tolist() == [0, 2] and opt.quality[0, 1] == pytest.approx(0.12 ** 2)


def test_unknown_stand_in_kind_is_an_error():
    profile = tiny_profile([[1]])
    ctx = tiny_context(profile, tiny_cluster(), {"a": [(0, 0)], "b": [(0, 1)]})
    with pytest.raises(EdgeMoEError, match="substitutes"):
        make_policy("ordermoe", ctx, substitutes="sub,teleport")


def steering_setup():
    """Token at a. Layer 0 routes expert 0, held by b and c (a tie: exact takes b); layer 1 routes expert 1,
    held only by c. Every link is XFER one way."""
    profile = tiny_profile([[0], [1]], num_experts=2)
    ctx = tiny_context(profile, tiny_cluster(("a", "b", "c")),
                       {"a": [(0, 1), (1, 0)], "b": [(0, 0)], "c": [(0, 0), (1, 1)]}, mode="migrate")
    return profile, ctx


def test_lookahead_steers_the_token_towards_its_next_expert():
    profile, ctx = steering_setup()
    users, topk, gates = np.array([0]), profile.topk[:1].astype(np.int64), profile.gates[:1]
    myopic = replay_decisions(make_policy("ordermoe", ctx, budget=0.0, horizon=0), users, topk, gates)
    ahead = replay_decisions(make_policy("ordermoe", ctx, budget=0.0, horizon=1), users, topk, gates)
    # myopic: b at layer 0, then b -> c for layer 1, then home: 3 transfers
    assert myopic.node[0, :, 0].tolist() == [1, 2]
    assert myopic.token_latency_s[0] == pytest.approx(3 * XFER + 2 * CALL)
    # steered: layer 0 already at c (same cost now), layer 1 local there: one transfer saved
    assert ahead.node[0, :, 0].tolist() == [2, 2] and ahead.next_location[0, 0] == 2
    assert ahead.token_latency_s[0] == pytest.approx(2 * XFER + 2 * CALL)
    oracle = replay_decisions(make_policy("oracle", ctx, budget=0.0, routing=(topk, gates)), users, topk, gates)
    assert oracle.token_latency_s[0] == pytest.approx(2 * XFER + 2 * CALL)


@pytest.fixture(scope="module")
def edge8():
    profile = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=400, seed=3)
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe", algorithm="two-stage")  # the runtime under test, on a fixed placement
    return profile, make_context(profile, cluster, placement, mode="migrate", domain_fallback=True)


def test_oracle_is_the_limit_per_token(edge8):
    """With budget 0 the oracle's dynamic program is exact: no policy's static path is shorter, token by token."""
    profile, ctx = edge8
    rows = np.arange(120)
    users = rows % ctx.num_users
    topk, gates = profile.topk[rows].astype(np.int64), profile.gates[rows]
    oracle = replay_decisions(make_policy("oracle", ctx, budget=0.0, routing=(topk, gates)), users, topk, gates)
    assert not (oracle.experts != topk).any()
    for name, kw in [("exact", {}), ("ordermoe", {"budget": 0.0, "horizon": 0}),
                     ("ordermoe", {"budget": 0.0, "horizon": 2})]:
        other = replay_decisions(make_policy(name, ctx, **kw), users, topk, gates)
        assert (oracle.token_latency_s <= other.token_latency_s + 1e-12).all(), (name, kw)


def test_oracle_needs_routing_and_tokens(edge8):
    profile, ctx = edge8
    with pytest.raises(EdgeMoEError, match="routing"):
        make_policy("oracle", ctx)
    pol = make_policy("oracle", ctx, routing=(profile.topk, profile.gates))
    with pytest.raises(EdgeMoEError, match="tokens"):
        pol.start(np.array([0, 1]))


@given(weight=st.floats(1e-3, 1e3), step=st.floats(-1e4, 1e4))
def test_quality_weight_step_is_libms_exp_clipped(weight, step):
    """The step `observe` and the simulator's compiled loop both take: the C library's exp (the same bits on
    every CPU), clipped to [1e-3, 1e3]; past exp's overflow the clip's bound."""
    expected = min(max(weight * math.exp(step), 1e-3), 1e3) if step < 709.0 else 1e3
    assert weight_steps(np.array([weight]), np.array([step]))[0] == expected


def test_quality_weight_step_keeps_nan_and_bounds():
    got = weight_steps(np.array([np.nan, 1.0, 1.0, 2.0]), np.array([0.1, np.inf, -np.inf, np.nan]))
    assert np.isnan(got[0]) and got[1] == 1e3 and got[2] == 1e-3 and np.isnan(got[3])


def test_observe_moves_each_users_quality_weight_its_own_way(edge8):
    _, ctx = edge8
    pol = make_policy("ordermoe", ctx, budget=0.05, horizon=0)
    for _ in range(20):
        pol.observe(np.array([0, 1]), np.array([0.01, 0.02]), estimate_s=np.array([0.01, 0.01]),
                    spent=np.array([0.99, 0.05]), granted=np.array([1.0, 1.0]))
    assert pol.quality_weight[0] > 1.0 > pol.quality_weight[1]
    assert pol.latency_excess[1] > pol.latency_excess[0] == 0.0
    assert pol.alpha[1] > pol.alpha[0]


def test_tight_and_loose_users_diverge_in_the_simulator_and_stay_within_budget(edge8):
    profile, ctx = edge8
    U = ctx.num_users
    budget = np.where(np.arange(U) % 2 == 0, 0.1, 5.0)  # even users tight, odd users loose
    pol = make_policy("ordermoe", ctx, budget=budget, horizon=1)
    m = simulate(ctx, pol, Trace.from_profile(profile), Workload(num_requests=48, prompt_tokens=8, gen_tokens=8, seed=1))
    spent, granted = np.array(m.extra["budget_spent_by_user"]), np.array(m.extra["budget_granted_by_user"])
    assert (spent <= 1.02 * granted + 1e-12).all()
    active = granted > 0
    tight, loose = active & (budget < 1.0), active & (budget > 1.0)
    assert tight.any() and loose.any()
    # the tight users spend near the target share and keep their quality weight; the loose ones cannot and
    # theirs falls (quality gets cheaper for them)
    assert pol.quality_weight[tight].mean() > pol.quality_weight[loose].mean() + 0.2
    assert (spent[loose] / granted[loose]).max() < (spent[tight] / granted[tight]).mean()


def test_routing_keys_name_frequent_sets_and_fall_back_to_top1():
    from edgemoe.runtime.policies.ordermoe import RoutingKeys

    # layer 0: set {1, 3} nine times (gates favour 3), set {0, 2} once
    topk = np.array([[[3, 1]]] * 9 + [[[0, 2]]])
    gates = np.array([[[0.7, 0.3]]] * 9 + [[[0.6, 0.4]]])
    keys = RoutingKeys(topk, gates, num_experts=4, min_count=8)
    assert keys.size == 5
    got = keys.keys(0, np.array([[1, 3], [3, 1], [0, 2]]), np.array([[0.2, 0.8], [0.9, 0.1], [0.6, 0.4]]))
    assert got.tolist() == [4, 4, 0]  # the frequent set in either order; the rare one by its top-1
    assert RoutingKeys(topk, gates, num_experts=4, min_count=0).size == 4


def test_set_conditioned_lookahead_runs_and_respects_budgets(edge8):
    profile, ctx = edge8
    rows = np.arange(60)
    users = rows % ctx.num_users
    pol = make_policy("ordermoe", ctx, budget=0.05, horizon=2, min_set_count=5)
    assert pol.lookahead.keys.size > ctx.num_experts
    dec = replay_decisions(pol, users, profile.topk[rows].astype(np.int64), profile.gates[rows])
    assert (dec.quality_cost.sum(1) <= 0.05 * ctx.num_layers + 1e-9).all()


def test_simulator_counts_zeroed_slots(edge8):
    profile, ctx = edge8
    trace, wl = Trace.from_profile(profile), Workload(num_requests=8, prompt_tokens=4, gen_tokens=4, seed=2)
    zero = simulate(ctx, make_policy("ordermoe", ctx, budget=1.0, horizon=0, substitutes="zero"), trace, wl)
    assert zero.zero_ratio > 0 and zero.zero_ratio == pytest.approx(zero.drop_ratio)
    drop = simulate(ctx, make_policy("ordermoe", ctx, budget=1.0, horizon=0, substitutes="drop"), trace, wl)
    assert drop.drop_ratio > 0 and drop.zero_ratio == 0


def test_pacing_hands_the_lookahead_its_share_of_the_remaining_budget(edge8):
    """pace_share = min(1, H / layers still to come): known answers on L = 4; with H >= L - 1 every share is 1, so
    pacing changes no decision of a whole pass; with H = 1 the early layers look the tables up at a third or a
    half of what is left, which changes some choices, and both stay within the budget."""
    profile, ctx = edge8
    assert ctx.num_layers == 4
    layers = np.arange(4)
    share = {h: make_policy("ordermoe", ctx, budget=0.2, horizon=h).pace_share(layers) for h in (1, 2, 3)}
    np.testing.assert_allclose(share[1], [1 / 3, 1 / 2, 1, 1])
    np.testing.assert_allclose(share[2], [2 / 3, 1, 1, 1])
    np.testing.assert_allclose(share[3], [1, 1, 1, 1])
    rows = np.arange(200)
    users = rows % ctx.num_users
    topk, gates = profile.topk[rows].astype(np.int64), profile.gates[rows]
    for horizon, differ in ((3, False), (1, True)):
        paced, unpaced = (replay_decisions(make_policy("ordermoe", ctx, budget=0.2, horizon=horizon, pace=p),
                                           users, topk, gates) for p in (True, False))
        same = all(np.array_equal(getattr(paced, f), getattr(unpaced, f))
                   for f in ("experts", "node", "next_location", "quality_cost"))
        assert same != differ
        for dec in (paced, unpaced):
            assert (dec.quality_cost.sum(1) <= 0.2 * ctx.num_layers + 1e-9).all()
