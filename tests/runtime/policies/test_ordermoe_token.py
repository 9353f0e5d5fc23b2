"""OrderMoE with stand-ins chosen per token (`stand_in_choice="token"`, issue 19 section 2): the picked
substitute is the best-scored local expert on hand-made contexts, brute force over random deployments,
invariants (budget, locality, zero budget = exact), the default left as it was, and the real router logits
in the local backend."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgemoe.errors import EdgeMoEError
from edgemoe.runtime import make_policy
from edgemoe.runtime.policies.ordermoe import (
    ROUTER_WEIGHT,
    coselect_affinity,
    coselection_counts,
    logit_affinity,
    token_substitutes,
)

from ..conftest import CALL, tiny_cluster, tiny_context, tiny_profile
from .test_field_baselines import deployment, run


def one_layer(err_10: float, err_13: float):
    """One layer routing (1, 2) with gates (0.7, 0.3); node a holds 0, 2, 3 and b holds 1, so slot 0 is remote
    and its local candidates are 0 and 3 (2 is routed), at measured errors err_10 and err_13."""
    profile = tiny_profile([[1, 2]], num_experts=4)
    ctx = tiny_context(profile, tiny_cluster(("a", "b")), {"a": [(0, 0), (0, 2), (0, 3)], "b": [(0, 1)]})
    err = np.array(ctx.subst_err)
    err[0, 1, 0], err[0, 1, 3] = err_10, err_13
    return replace(ctx, subst_err=err), np.array([[1, 2]]), np.array([[0.7, 0.3]])


def decide(ctx, topk, gates, logits=None, **kw):
    pol = make_policy("ordermoe", ctx, stand_in_choice="token", horizon=0, **kw)
    state = pol.start(np.array([0]))
    extra = {} if logits is None else {"router_logits": np.array([logits], float)}
    return pol.decide(0, topk, gates, state, **extra), state, pol


def test_the_router_logits_pick_among_close_measured_errors():
    ctx, topk, gates = one_layer(0.3, 0.4)
    # logits (0, 2, 1, 2): expert 3 ties the routed expert 1 (affinity 1), expert 0 is 2 nats below (e^-2):
    # predicted 0.3 (1 - 0.5 e^-2) = 0.280 for 0 and 0.4 (1 - 0.5) = 0.2 for 3 -> 3
    dec, state, pol = decide(ctx, topk, gates, [0.0, 2.0, 1.0, 2.0], budget=0.05)
    assert dec.experts.tolist() == [[3, 2]] and dec.node.tolist() == [[0, 0]]
    assert dec.latency_s[0] == pytest.approx(CALL)
    assert dec.quality_cost[0] == pytest.approx((0.7 * 0.2) ** 2)  # the chosen substitute's predicted cost
    assert pol.logit_layers == 1
    # no logits (simulator): the calibration tokens all routed (1, 2), so no co-selection: measured error alone
    dec, _, pol = decide(ctx, topk, gates, budget=0.05)
    assert dec.experts.tolist() == [[0, 2]] and dec.quality_cost[0] == pytest.approx((0.7 * 0.3) ** 2)
    assert pol.logit_layers == 0
    # router weight 0: the measured error alone, whatever the logits
    dec, _, _ = decide(ctx, topk, gates, [0.0, 2.0, 1.0, 2.0], budget=0.05, router_weight=0.0)
    assert dec.experts.tolist() == [[0, 2]]


def test_a_far_better_measured_error_beats_the_router():
    ctx, topk, gates = one_layer(0.1, 1.0)
    dec, _, _ = decide(ctx, topk, gates, [-5.0, 1.0, 0.0, 1.0], budget=0.05)  # 0.1 (1 - ~0) < 1.0 x 0.5
    assert dec.experts.tolist() == [[0, 2]]


def test_the_budget_charges_the_substitute_or_leaves_the_branch_exact():
    ctx, topk, gates = one_layer(0.3, 0.4)
    cost = (0.7 * 0.2) ** 2
    dec, state, _ = decide(ctx, topk, gates, [0.0, 2.0, 1.0, 2.0], budget=cost * 0.99)
    assert dec.experts.tolist() == [[1, 2]] and state.budget_used[0] == 0.0  # too dear: exact
    dec, state, _ = decide(ctx, topk, gates, [0.0, 2.0, 1.0, 2.0], budget=cost * 1.01)
    assert dec.experts.tolist() == [[3, 2]] and state.budget_used[0] == pytest.approx(cost)


def test_affinities_known_answers():
    topk = np.array([[1, 2]])
    aff = logit_affinity(topk, np.array([[0.0, 2.0, 1.0, 3.0]]))
    np.testing.assert_allclose(aff[0, 0], [np.exp(-2), 1, np.exp(-1), 1])
    np.testing.assert_allclose(aff[0, 1], [np.exp(-1), 1, 1, 1])
    # calibration: tokens route (0, 1), (0, 1), (0, 2): of the 3 routing 0, 2 also routed 1 and 1 routed 2
    co = coselection_counts(np.array([[[0, 1]], [[0, 1]], [[0, 2]]]), 3)
    aff = coselect_affinity(co, np.array([0]), np.array([[0, 2]]))
    np.testing.assert_allclose(aff[0, 0], [1, 2 / 3, 1 / 3])
    np.testing.assert_allclose(aff[0, 1], [1, 0, 1])


def test_options_are_checked_and_the_default_is_untouched():
    ctx, _, _ = one_layer(0.3, 0.4)
    with pytest.raises(EdgeMoEError, match="stand_in_choice"):
        make_policy("ordermoe", ctx, stand_in_choice="any")
    with pytest.raises(EdgeMoEError, match="router_weight"):
        make_policy("ordermoe", ctx, stand_in_choice="token", router_weight=1.5)
    default = make_policy("ordermoe", ctx)
    assert "stand_in_choice" not in default.params and not getattr(default, "wants_router_logits", False)
    token = make_policy("ordermoe", ctx, stand_in_choice="token")
    assert token.compiled_rule() is None and token.params["stand_in_choice"] == "token"
    assert token.params["router_weight"] == ROUTER_WEIGHT


def best_local(ctx, layer, loc, topk_row, slot, score_row):
    """Brute force: the local, unrouted expert with the least measured error x (1 - w x affinity), lower id first."""
    best, arg = np.inf, -1
    for e in range(ctx.num_experts):
        if ctx.hosts[loc, layer, e] and e not in topk_row:
            v = ctx.subst_err[layer, topk_row[slot], e] * (1.0 - ROUTER_WEIGHT * score_row[slot, e])
            if v < best:
                best, arg = v, e
    return arg, best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 5), topology=st.sampled_from(["internet", "device-edge-cloud"]),
       mode=st.sampled_from(["home", "migrate"]), budget=st.sampled_from([0.0, 0.02, 0.2, 2.0]),
       horizon=st.sampled_from([0, 2]), with_logits=st.booleans(), loaded=st.booleans())
def test_token_stand_ins_invariants(seed, topology, mode, budget, horizon, with_logits, loaded):
    profile, ctx = deployment(seed, topology, mode)
    rng = np.random.default_rng(seed + 11)
    T = 30
    rows = rng.integers(0, profile.num_tokens, T)
    users = rng.integers(0, ctx.num_users, T)
    load = rng.exponential(0.01, ctx.num_nodes) if loaded else None
    logits = rng.normal(size=(T, ctx.num_layers, ctx.num_experts)) if with_logits else None
    pol = make_policy("ordermoe", ctx, budget=budget, horizon=horizon, stand_in_choice="token")
    state, out = run(pol, profile, ctx, rows, users, load, logits)
    _, exact = run(make_policy("exact", ctx), profile, ctx, rows, users, load)
    # the group policy with the token policy's look-ahead (home_trip, on by default for per-token stand-ins), so
    # that at budget 0 the two make the same decision
    _, group = run(make_policy("ordermoe", ctx, budget=budget, horizon=horizon, home_trip=True), profile, ctx, rows,
                   users, load)
    assert (state.budget_used <= state.budget_total + 1e-9).all(), "budget exceeded"
    co = coselection_counts(ctx.profile_topk, ctx.num_experts)
    for layer, ((topk, dec, _), (_, ex, _), (_, gr, _)) in enumerate(zip(out, exact, group, strict=True)):
        assert (dec.quality_cost >= 0).all()
        sub = dec.substituted(topk)
        ts, ks = np.nonzero(sub)
        assert (dec.node[ts, ks] == dec.location[ts]).all(), "a substitute runs away from the token"
        assert ctx.hosts[dec.location[ts], layer, dec.experts[ts, ks]].all(), "a substitute its node lacks"
        assert not (dec.experts[ts, ks][:, None] == topk[ts]).any(axis=1).any(), "a routed expert as substitute"
        assert not ctx.hosts[dec.location[ts], layer, topk[ts, ks]].any(), "replaced a local branch"
        lr = np.full(T, layer)
        aff = logit_affinity(topk, logits[:, layer]) if logits is not None else coselect_affinity(co, lr, topk)
        for t, k in zip(ts, ks, strict=True):  # the picked stand-in is the best-scored local expert
            assert dec.experts[t, k] == best_local(ctx, layer, dec.location[t], topk[t], k, aff[t])[0]
        if budget == 0:  # nothing replaced: the default's decision; exact's too where not steered (H = 0 or home)
            assert (dec.experts == topk).all() and (dec.quality_cost == 0).all()
            for field in ("experts", "node", "location", "next_location", "latency_s"):
                np.testing.assert_array_equal(getattr(dec, field), getattr(gr, field))
                if horizon == 0 or mode == "home":
                    np.testing.assert_array_equal(getattr(dec, field), getattr(ex, field))
    if logits is not None:
        assert pol.logit_layers == ctx.num_layers


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 5), weight=st.floats(0.0, 1.0), data=st.data())
def test_token_substitutes_is_the_brute_force_argmin(seed, weight, data):
    profile, ctx = deployment(seed, "internet", "home")
    rng = np.random.default_rng(data.draw(st.integers(0, 100)))
    R = 12
    layer = rng.integers(0, ctx.num_layers, R)
    loc = rng.integers(0, ctx.num_nodes, R)
    topk = profile.topk[rng.integers(0, profile.num_tokens, R), layer].astype(np.int64)
    aff = rng.random((R, topk.shape[1], ctx.num_experts))
    sub, err = token_substitutes(ctx, layer, loc, topk, aff, weight)
    for r in range(R):
        for k in range(topk.shape[1]):
            cand = [e for e in range(ctx.num_experts) if ctx.hosts[loc[r], layer[r], e] and e not in topk[r]]
            if not cand:
                assert sub[r, k] == -1 and err[r, k] == np.inf
                continue
            v = [ctx.subst_err[layer[r], topk[r, k], e] * (1 - weight * aff[r, k, e]) for e in cand]
            assert sub[r, k] == cand[int(np.argmin(v))] and err[r, k] == pytest.approx(min(v))


def test_ordermoe_token_gets_the_real_router_logits_in_the_local_backend():
    from edgemoe.cluster import generate
    from edgemoe.data import TokenBlocks
    from edgemoe.models import adapter_for
    from edgemoe.models.tiny import TINY_VOCAB, tiny_model
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan
    from edgemoe.profile.collect import collect_profile
    from edgemoe.runtime import make_context
    from edgemoe.runtime.local import run_local

    adapter = adapter_for(tiny_model("mixtral", seed=5), "mixtral")
    rng = np.random.default_rng(0)
    calib = TokenBlocks(rng.integers(1, TINY_VOCAB, (4, 16)), np.arange(4) % 2, ("a", "b"))
    profile = collect_profile(adapter, calib, "tiny-mixtral", "random", batch_size=4, subst_tokens=32, progress=False)
    ctx = make_context(profile, generate(3, 4, seed=1), plan(plan_problem(profile, generate(3, 4, seed=1),
                                                                          domain_fallback=True), "random"),
                       mode="migrate", domain_fallback=True)
    ids = rng.integers(1, TINY_VOCAB, (3, 12))
    users = np.arange(3) % ctx.num_users
    pol = make_policy("ordermoe", ctx, budget=0.5, stand_in_choice="token")
    nll, dec = run_local(adapter, pol, ids, users, batch_size=3)
    assert pol.logit_layers == adapter.num_layers and np.isfinite(nll).all()
    assert (dec.quality_cost.sum(axis=1) <= 0.5 * adapter.num_layers + 1e-9).all()
    nll0, _ = run_local(adapter, make_policy("ordermoe", ctx, budget=0.0, stand_in_choice="token"), ids, users, batch_size=3)
    nll_x, _ = run_local(adapter, make_policy("exact", ctx), ids, users, batch_size=3)
    np.testing.assert_array_equal(nll0, nll_x)


def test_replayed_logits_pick_as_the_passed_ones_and_passed_ones_win():
    ctx, topk, gates = one_layer(0.3, 0.4)
    pol = make_policy("ordermoe", ctx, stand_in_choice="token", horizon=0, budget=0.05)
    # token 1 of the replayed routing has the logits of the known answer above (-> substitute 3); token 0 ranks
    # expert 0 level with the routed 1 (-> substitute 0: 0.3 x 0.5 < 0.4 x (1 - 0.5 e^-2))
    pol.replay_logits(np.array([[[2.0, 2.0, 1.0, 0.0]], [[0.0, 2.0, 1.0, 2.0]]]))
    for token, want in ((1, 3), (0, 0)):
        state = pol.start(np.array([0]), tokens=np.array([token]))
        assert pol.decide(0, topk, gates, state).experts.tolist() == [[want, 2]]
    state = pol.start(np.array([0]), tokens=np.array([0]))  # logits the backend passes win over the replayed
    dec = pol.decide(0, topk, gates, state, router_logits=np.array([[0.0, 2.0, 1.0, 2.0]]))
    assert dec.experts.tolist() == [[3, 2]] and pol.logit_layers == 3


def test_replayed_logits_are_checked():
    ctx, topk, gates = one_layer(0.3, 0.4)
    with pytest.raises(EdgeMoEError, match="stand_in_choice='token'"):
        make_policy("ordermoe", ctx, budget=0.05).replay_logits(np.zeros((2, 1, 4)))
    pol = make_policy("ordermoe", ctx, stand_in_choice="token", budget=0.05)
    with pytest.raises(EdgeMoEError, match="replay_logits must be"):
        pol.replay_logits(np.zeros((2, 1, 3)))
    pol.replay_logits(np.zeros((2, 1, 4)))
    with pytest.raises(EdgeMoEError, match="must name each row's token"):
        pol.start(np.array([0]))
    with pytest.raises(EdgeMoEError, match="indices into the replayed"):
        pol.start(np.array([0]), tokens=np.array([2]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 5), mode=st.sampled_from(["home", "migrate"]), horizon=st.sampled_from([0, 2]),
       budget=st.sampled_from([0.05, 0.5]))
def test_replayed_logits_decide_bit_for_bit_as_passed_logits(seed, mode, horizon, budget):
    """Rows started with their tokens and the routing's logits replayed decide exactly as the same rows handed
    those logits by the backend, layer after layer (what makes a simulated run's decisions the local backend's)."""
    profile, ctx = deployment(seed, "internet", mode)
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (profile.num_tokens, ctx.num_layers, ctx.num_experts))
    rows, users = rng.integers(0, profile.num_tokens, 20), rng.integers(0, ctx.num_users, 20)
    load = rng.uniform(0, 0.01, ctx.num_nodes)
    passed = make_policy("ordermoe", ctx, budget=budget, horizon=horizon, stand_in_choice="token")
    _, want = run(passed, profile, ctx, rows, users, load, logits=logits[rows])
    replayed = make_policy("ordermoe", ctx, budget=budget, horizon=horizon, stand_in_choice="token")
    replayed.replay_logits(logits)
    state = replayed.start(users, tokens=rows)
    for layer, (topk, dec, _) in enumerate(want):
        got = replayed.decide(layer, topk, profile.gates[rows, layer], state, load)
        for name in ("experts", "node", "next_location", "quality_cost", "latency_s"):
            assert np.array_equal(getattr(got, name), getattr(dec, name)), name
    assert replayed.logit_layers == passed.logit_layers == ctx.num_layers


def test_the_simulator_prices_with_the_replayed_logits():
    """simulate() starts the rows with their trace tokens, so every decide call of a per-token policy given the
    trace's logits scores its substitutes with them (none falls back to the co-selection)."""
    from edgemoe.runtime.sim.simulate import simulate
    from edgemoe.runtime.sim.workload import Trace, Workload

    profile, ctx = deployment(1, "internet", "migrate")
    trace = Trace.from_profile(profile)
    logits = np.random.default_rng(0).normal(size=(len(trace.topk), ctx.num_layers, ctx.num_experts))
    pol = make_policy("ordermoe", ctx, budget=0.3, stand_in_choice="token")
    pol.replay_logits(logits)
    calls = []
    choose = pol.choose
    pol.choose = lambda *a, **k: (calls.append(1), choose(*a, **k))[1]
    simulate(ctx, pol, trace, Workload(num_requests=6, prompt_tokens=3, gen_tokens=3, seed=2))
    assert len(calls) > 0 and pol.logit_layers == len(calls)
