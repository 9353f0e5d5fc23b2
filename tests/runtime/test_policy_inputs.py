"""Bad inputs to `Policy.decide` and `simulate`: one EdgeMoEError that names the field, and nothing changed.

The compiled paths (OrderMoE's decode path, the simulator's wave loops) read their tables by expert id, user
and node without bounds checks, so an id out of range there read outside the tables (a segmentation fault
in the decode path, a silent wrong answer in the loops) before these checks; a negative id was taken from
the end of a table on every path.
"""

from __future__ import annotations

import numpy as np
import pytest

import edgemoe.runtime.policies.ordermoe as om
from edgemoe.cluster import load_cluster
from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy
from edgemoe.runtime.sim.simulate import simulate
from edgemoe.runtime.sim.workload import Trace, Workload

PROFILE = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=300, seed=0)


@pytest.fixture(scope="module")
def ctx():
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(PROFILE, cluster, domain_fallback=True), "ordermoe")
    return make_context(PROFILE, cluster, placement, mode="migrate", domain_fallback=True)


# (policy, its parameters, compiled decode path on)
POLICIES = [("exact", {}, False), ("ordermoe", {"horizon": 2}, True), ("ordermoe", {"horizon": 2}, False)]


def _bad_topk(value):
    return lambda topk, load, st: (np.where(np.arange(topk.size).reshape(topk.shape) == 1, value, topk), load)


def _bad_load(load_fn):
    return lambda topk, load, st: (topk, load_fn(load))


def _bad_state(name, fn):
    def edit(topk, load, st):
        setattr(st, name, fn(getattr(st, name)))
        return topk, load
    return edit


CASES = {  # case: (edit (topk, load, state) -> (topk, load), words the error must hold)
    "expert id past E": (_bad_topk(10**6), "topk must hold expert ids in [0, 8)"),
    "expert id E": (_bad_topk(8), "topk must hold expert ids in [0, 8)"),
    "negative expert id": (_bad_topk(-5), "topk must hold expert ids in [0, 8)"),
    "load too short": (_bad_load(lambda a: a[:2]), "load_s must be [N=8] seconds"),
    "NaN load": (_bad_load(lambda a: np.where(np.arange(a.size) == 3, np.nan, a)), "load_s must hold finite seconds >= 0"),
    "negative load": (_bad_load(lambda a: a - 1.0), "load_s must hold finite seconds >= 0"),
    "infinite load": (_bad_load(lambda a: a + np.inf), "load_s must hold finite seconds >= 0"),
    "load not numbers": (_bad_load(lambda a: ["x"] * a.size), "load_s must be [N=8] seconds"),
    "user past U": (_bad_state("user", lambda a: a + 10**6), "state.user must hold indices in [0, 16)"),
    "location past N": (_bad_state("location", lambda a: a + 8), "state.location must hold indices in [0, 8)"),
    "negative home": (_bad_state("home", lambda a: a - 100), "state.home must hold indices in [0, 8)"),
    "float users": (_bad_state("user", lambda a: a.astype(float)), "state.user must be a [T=3] integer array"),
    "budget too short": (_bad_state("budget_used", lambda a: a[:1]), "state.budget_used must be a [T=3] float array"),
    "layer a list": (_bad_state("layer", lambda a: a.tolist()), "state.layer must be a [T=3] integer array"),
    "users a list": (_bad_state("user", lambda a: a.tolist()), "state.user must be a [T] integer array"),
}


@pytest.mark.parametrize("policy, params, compiled", POLICIES, ids=["exact", "ordermoe-compiled", "ordermoe-numpy"])
@pytest.mark.parametrize("case", list(CASES))
def test_bad_decide_input_is_a_clear_error_and_changes_nothing(ctx, monkeypatch, policy, params, compiled, case):
    monkeypatch.setattr(om, "COMPILED_DECODE", compiled)
    pol = make_policy(policy, ctx, **params)
    st = pol.start(np.array([0, 5, 15]))
    topk, gates, load = PROFILE.topk[:3, 0].astype(np.int64), PROFILE.gates[:3, 0], np.full(ctx.num_nodes, 0.001)
    pol.decide(0, topk, gates, pol.start(np.array([0, 5, 15])), load)  # a good call first: the decode path built
    edit, words = CASES[case]
    topk, load = edit(topk, load, st)
    before = {k: np.array(v, copy=True) for k, v in vars(st).items()}
    with pytest.raises(EdgeMoEError) as err:
        pol.decide(0, topk, gates, st, load)
    assert words in str(err.value)
    for k, v in vars(st).items():
        assert np.array_equal(np.asarray(v), before[k]), k


@pytest.mark.parametrize("policy, params, compiled", POLICIES, ids=["exact", "ordermoe-compiled", "ordermoe-numpy"])
def test_inputs_at_the_edges_of_their_ranges_are_decided(ctx, monkeypatch, policy, params, compiled):
    """The last user, node and expert, and loads of 0, are in range: decided as on the numpy path."""
    monkeypatch.setattr(om, "COMPILED_DECODE", compiled)
    pol = make_policy(policy, ctx, **params)
    users = np.array([0, ctx.num_users - 1])
    st = pol.start(users)
    st.location[:] = ctx.num_nodes - 1
    topk = np.array([[0, 7], [7, 6]])
    dec = pol.decide(0, topk, np.full((2, 2), 0.5), st, np.zeros(ctx.num_nodes))
    assert dec.experts.shape == (2, 2) and np.isfinite(dec.latency_s).all()
    assert (st.layer == 1).all()


@pytest.mark.parametrize("policy, params", [("exact", {}), ("ordermoe", {"horizon": 2})])
@pytest.mark.parametrize("value, words", [(10**6, "trace.topk must hold expert ids in [0, 8)"),
                                          (-3, "trace.topk must hold expert ids in [0, 8)"),
                                          (np.nan, "trace.gates holds NaN or infinite values")])
def test_a_trace_out_of_range_is_refused_before_the_compiled_loop(ctx, policy, params, value, words):
    trace = Trace.from_profile(PROFILE)
    topk, gates = trace.topk.copy(), trace.gates.copy()
    if np.isnan(value):
        gates[7, 2, 1] = value
    else:
        topk[7, 2, 1] = value
    bad = Trace(topk=topk, gates=gates, domain=trace.domain)
    with pytest.raises(EdgeMoEError, match=words.replace("[", r"\[").replace(")", r"\)")):
        simulate(ctx, make_policy(policy, ctx, **params), bad, Workload(4, 4, 4, "closed"))


OBSERVE_CASES = {  # case: (observe's arguments, words the error must hold)
    "user past U": (dict(users=[10**6], latency_s=[0.1]), "users must be in [0, 16)"),
    "negative user": (dict(users=[-1], latency_s=[0.1]), "users must be in [0, 16)"),
    "float users": (dict(users=[0.5], latency_s=[0.1]), "users must be a [n] array of user indices"),
    "NaN latency": (dict(users=[0], latency_s=[np.nan], estimate_s=[0.1]), "latency_s must hold finite numbers >= 0"),
    "infinite latency": (dict(users=[0], latency_s=[np.inf], estimate_s=[0.1]), "latency_s must hold finite numbers"),
    "negative estimate": (dict(users=[0], latency_s=[0.1], estimate_s=[-1.0]), "estimate_s must hold numbers >= 0"),
    "one latency for two users": (dict(users=[0, 1], latency_s=[0.1]), "latency_s must be [n=2]"),
    "NaN spent": (dict(users=[0], latency_s=[0.1], estimate_s=[0.1], spent=[np.nan], granted=[1.0]),
                  "spent must hold finite numbers >= 0"),
    "granted not numbers": (dict(users=[0], latency_s=[0.1], estimate_s=[0.1], spent=[0.1], granted=["x"]),
                            "must be arrays of numbers"),
}


@pytest.mark.parametrize("case", list(OBSERVE_CASES))
def test_bad_feedback_is_a_clear_error_and_leaves_the_weights(ctx, case):
    """One NaN observed would stay in the user's adaptive weights for good (before the check it did)."""
    pol = make_policy("ordermoe", ctx, horizon=2)
    pol.observe(np.array([0, 3]), np.array([0.2, 0.1]), np.array([0.1, 0.1]), np.array([0.5, 0.0]), np.array([1.0, 1.0]))
    before = {k: getattr(pol, k).copy() for k in ("latency_excess", "quality_weight", "spend_rate")}
    kwargs, words = OBSERVE_CASES[case]
    with pytest.raises(EdgeMoEError) as err:
        pol.observe(**kwargs)
    assert words in str(err.value)
    for k, v in before.items():
        assert np.array_equal(getattr(pol, k), v), k


def test_an_infinite_estimate_is_feedback_that_adds_no_excess(ctx):
    pol = make_policy("ordermoe", ctx, horizon=2)
    pol.observe(np.array([2]), np.array([0.3]), np.array([np.inf]))
    assert pol.latency_excess[2] == 0.0


@pytest.mark.parametrize("params, words", [
    ({"ewma": 2.0}, "ewma must be a finite number in [0, 1]"),
    ({"ewma": np.nan}, "ewma must be a finite number in [0, 1]"),
    ({"pressure_gain": np.nan}, "pressure_gain must be a finite number >= 0"),
    ({"pressure_gain": -5.0}, "pressure_gain must be a finite number >= 0"),
    ({"adapt_gain": np.inf}, "adapt_gain must be a finite number >= 0"),
    ({"quality_price": -1.0}, "quality_price must be a finite number >= 0"),
    ({"quality_power": np.nan}, "quality_power must be a finite number >= 0"),
    ({"steer_replicas": -1}, "steer_replicas must be a whole number >= 0"),
    ({"max_enum_k": -1}, "max_enum_k must be a whole number >= 0"),
    ({"sets_per_prev": 0}, "sets_per_prev must be a whole number >= 1"),
    ({"horizon": 2.5}, "horizon must be a whole number >= 0"),
    ({"horizon": -1}, "horizon must be a whole number >= 0"),
])
def test_ordermoe_parameters_out_of_range_are_refused(ctx, params, words):
    with pytest.raises(EdgeMoEError) as err:
        make_policy("ordermoe", ctx, **params)
    assert words in str(err.value)


def test_a_horizon_past_the_last_layer_looks_no_further(ctx):
    """Depth L - 1 is the recursion's fixed point: a horizon of a million builds the tables of H = L bit for bit
    (it ran for hours before, a million recursions) and simulates the same run. (Not H = L - 1's: the queue
    term's exposure is taken at the budget level H layers of allowance reach, the grid's top from H = L on.)"""
    L = ctx.num_layers
    deep, full = (make_policy("ordermoe", ctx, horizon=h) for h in (10**6, L))
    assert np.array_equal(deep.lookahead.stacked, make_policy("ordermoe", ctx, horizon=L - 1).lookahead.stacked)
    assert np.array_equal(deep.lookahead.stacked, full.lookahead.stacked)
    assert np.array_equal(deep.lookahead.home, full.lookahead.home)
    assert np.array_equal(deep.lookahead.exposure, full.lookahead.exposure)
    trace, wl = Trace.from_profile(PROFILE), Workload(8, 4, 4, "closed")
    a, b = (simulate(ctx, p, trace, wl) for p in (deep, full))
    assert a.latency_ms == b.latency_ms and a.traffic_bytes_per_1k_tokens == b.traffic_bytes_per_1k_tokens


@pytest.mark.parametrize("make, words", [
    (lambda: Workload(64, 4, 4, "closed", think_s=np.nan), "workload.think_s must be finite and >= 0"),
    (lambda: Workload(64, 4, 4, "closed", think_s=np.inf), "workload.think_s must be finite and >= 0"),
    (lambda: Workload(64, 4, 4, "poisson", rate_per_s=np.inf), "workload.rate_per_s must be finite and > 0"),
])
def test_workload_times_must_be_finite(make, words):
    """A NaN think time ran the fast engine for ever (64 closed-loop requests on edge8: still running after 10 min)."""
    with pytest.raises(EdgeMoEError) as err:
        make()
    assert words in str(err.value)


@pytest.mark.parametrize("window", [np.nan, np.inf, -1.0])
def test_the_wave_window_must_be_finite(ctx, window):
    with pytest.raises(EdgeMoEError, match="window_s must be finite and >= 0"):
        simulate(ctx, make_policy("exact", ctx), Trace.from_profile(PROFILE), Workload(4, 4, 4, "closed"), window_s=window)


def test_a_placement_for_another_expert_count_names_its_own_shape():
    """hosts [N, L, E - 1] with expert_bytes [L, E]: the message gives the hosts' (L, E), not expert_bytes' (the
    profile's, which read as if they matched)."""
    import dataclasses

    cluster = load_cluster("edge8")
    placement = plan(plan_problem(PROFILE, cluster, domain_fallback=True), "uniform")
    bad = dataclasses.replace(placement, hosts=placement.hosts[:, :, :7])
    with pytest.raises(EdgeMoEError, match=r"planned for a model with \(L, E\) = \(4, 7\), but the profile"):
        make_context(PROFILE, cluster, bad, mode="migrate", domain_fallback=True)


def test_the_oracle_refuses_routing_and_rows_out_of_range(ctx):
    topk, gates = PROFILE.topk.astype(np.int64), PROFILE.gates
    bad = topk.copy()
    bad[3, 1, 0] = -2
    with pytest.raises(EdgeMoEError, match=r"routing's topk must hold expert ids in \[0, 8\)"):
        make_policy("oracle", ctx, routing=(bad, gates))
    with pytest.raises(EdgeMoEError, match="routing's gates hold NaN"):
        make_policy("oracle", ctx, routing=(topk, np.where(topk == 3, np.nan, gates)))
    pol = make_policy("oracle", ctx, routing=(topk, gates))
    st = pol.start(np.array([0, 1]), np.array([4, 9]))
    st.row[1] = 5  # the last `start` made 2 rows
    with pytest.raises(EdgeMoEError, match="state.row must index the 2 rows"):
        pol.decide(0, topk[[4, 9], 0], gates[[4, 9], 0], st)


def _scenario_with(ctx, **changes):
    import dataclasses

    from edgemoe.runtime.sim.workload import build_scenario

    sc = build_scenario(ctx.user_weight, ctx.user_domain, Trace.from_profile(PROFILE), Workload(6, 3, 3, "closed"))
    return dataclasses.replace(sc, **{k: fn(getattr(sc, k).copy()) for k, fn in changes.items()})


def _set(i, v):
    def edit(a):
        a[i] = v
        return a
    return edit


@pytest.mark.parametrize("changes, words", [
    ({"pass_next": _set(3, 0)}, "scenario.pass_next must name a later entry or -1"),  # a link back: a cycle
    ({"request_next": _set(0, 0)}, "scenario.request_next must name a later entry or -1"),
    ({"pass_request": _set(2, 99)}, "scenario.pass_request must hold values in [0, 6)"),
    ({"pass_row_count": _set(0, 10**6)}, "scenario.pass_row_count must hold values in [1, "),
    ({"row_pass": lambda a: a[:-1]}, "scenario.row_pass must be a ["),
    ({"request_arrival": _set(0, np.inf)}, "scenario: request_arrival must be seconds >= 0"),
])
def test_a_scenario_whose_indices_do_not_fit_is_refused(ctx, changes, words):
    """The compiled engine follows these links unchecked: a pass_next that pointed back ended the run with NaN
    latencies and no error."""
    with pytest.raises(EdgeMoEError) as err:
        _scenario_with(ctx, **changes)
    assert words in str(err.value)


@pytest.mark.parametrize("field, value, words", [("row_trace", 10**6, "scenario.row_trace must hold indices in [0, 300)"),
                                                 ("row_user", -1, "scenario.row_user must hold indices in [0, 16)"),
                                                 ("request_user", 16, "scenario.request_user must hold indices in [0, 16)")])
def test_a_scenario_for_other_users_or_another_trace_is_refused(ctx, field, value, words):
    from edgemoe.runtime.sim.simulate import simulate_scenario

    sc = _scenario_with(ctx, **{field: _set(0, value)})
    with pytest.raises(EdgeMoEError) as err:
        simulate_scenario(ctx, make_policy("exact", ctx), Trace.from_profile(PROFILE), sc)
    assert words in str(err.value)
