"""The policy's decision time, charged at the home from its model (`edgemoe.runtime.decision_cost`): known
answers on a hand-built deployment, both engines the same, the local backend's replay, and bad model files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.runtime import make_policy
from edgemoe.runtime.decision_cost import (
    DEFAULT_PATH,
    DecisionCost,
    charge_decisions,
    cost_for,
    measured_costs,
    policy_label,
)
from edgemoe.runtime.local import replay_decisions
from edgemoe.runtime.sim.simulate import simulate_scenario
from edgemoe.runtime.sim.workload import Trace, Workload, build_scenario

from ..conftest import CALL, XFER, tiny_cluster, tiny_context, tiny_profile

FIXED, PER_ROW = 3e-3, 1e-3  # round numbers, far above the engines' rounding


def _one_user(prompt=1, gen=3):
    profile = tiny_profile([[1], [1]])  # two layers, expert 1 held by b only: every slot is remote
    ctx = tiny_context(profile, tiny_cluster(), {"a": [(0, 0), (1, 0)], "b": [(0, 1), (1, 1)]}, mode="home")
    trace = Trace.from_profile(profile)
    wl = Workload(num_requests=1, prompt_tokens=prompt, gen_tokens=gen, arrival="closed")
    return ctx, trace, build_scenario(ctx.user_weight, ctx.user_domain, trace, wl)


@pytest.mark.parametrize("engine,window", [("reference", 0.0), ("fast", 0.0), ("fast", 1e-3)])
def test_decisions_charged_at_the_home_add_their_model_per_layer(engine, window):
    # One user alone: nothing queues, so each layer of each pass waits exactly its decision's seconds more.
    # A layer without the charge: out (11 ms) + call (2 ms) + back (11 ms); L = 2 layers per pass.
    ctx, trace, sc = _one_user(prompt=4, gen=3)
    plain = simulate_scenario(ctx, make_policy("exact", ctx), trace, sc, engine, window)
    charged = simulate_scenario(ctx, charge_decisions(make_policy("exact", ctx), DecisionCost(FIXED, PER_ROW)),
                                trace, sc, engine, window)
    layer_ms = (2 * XFER + CALL) * 1e3
    assert plain.latency_ms["mean"] == pytest.approx(2 * layer_ms)
    assert charged.latency_ms["mean"] == pytest.approx(2 * (layer_ms + (FIXED + PER_ROW) * 1e3))
    # the prompt pass decides its 4 rows in one call per layer
    assert charged.ttft_ms["mean"] - plain.ttft_ms["mean"] == pytest.approx(2 * (FIXED + 4 * PER_ROW) * 1e3)
    assert charged.token_layers == plain.token_layers  # the same decisions, only later


@pytest.mark.parametrize("policy", ["exact", "ordermoe"])
def test_both_engines_charge_the_same(policy):
    from edgemoe.cluster import load_cluster
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan
    from edgemoe.profile import synthetic_profile
    from edgemoe.runtime import make_context

    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=300, seed=2)
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster, domain_fallback=True), "slimcaching")
    ctx = make_context(profile, cluster, placement, mode="migrate", domain_fallback=True)
    trace = Trace.from_profile(profile)
    wl = Workload(num_requests=12, prompt_tokens=4, gen_tokens=3, arrival="poisson", rate_per_s=200.0, seed=3)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, wl)
    cost = DecisionCost(2e-4, 5e-5)
    ref = simulate_scenario(ctx, charge_decisions(make_policy(policy, ctx), cost), trace, sc, "reference")
    fast = simulate_scenario(ctx, charge_decisions(make_policy(policy, ctx), cost), trace, sc, "fast", 0.0)
    plain = simulate_scenario(ctx, make_policy(policy, ctx), trace, sc, "fast", 0.0)
    assert fast.latency_ms == pytest.approx(ref.latency_ms, rel=1e-9)
    assert fast.ttft_ms == pytest.approx(ref.ttft_ms, rel=1e-9)
    assert fast.latency_ms["mean"] > plain.latency_ms["mean"]  # a slower decision cannot look free


def test_local_replay_charges_each_call_to_its_rows():
    ctx, trace, _ = _one_user()
    T = 5
    users = np.zeros(T, np.int64)
    topk, gates = trace.topk[:T], trace.gates[:T]
    plain = replay_decisions(make_policy("exact", ctx), users, topk, gates)
    charged = replay_decisions(charge_decisions(make_policy("exact", ctx), DecisionCost(FIXED, PER_ROW)), users,
                               topk, gates)
    assert (plain.decision_s == 0).all()
    np.testing.assert_array_equal(charged.experts, plain.experts)
    np.testing.assert_allclose(charged.decision_s, FIXED + T * PER_ROW)  # every row waits for its call
    np.testing.assert_allclose(charged.token_latency_s - plain.token_latency_s, 2 * (FIXED + T * PER_ROW))


def test_decision_cost_model_and_its_file(tmp_path):
    fit = DecisionCost.fit(1, 30e-6, 64, 64 * 5e-6)
    assert fit.per_row_s == pytest.approx((320e-6 - 30e-6) / 63)
    assert fit.seconds(1) == pytest.approx(30e-6) and fit.seconds(0) == 0.0
    assert DecisionCost.fit(1, 10e-6, 64, 5e-6).per_row_s == 0.0  # never negative
    with pytest.raises(EdgeMoEError, match="per_row_s"):
        DecisionCost(0.0, -1.0)
    bad = tmp_path / "cost.json"
    bad.write_text(json.dumps({"costs": {"exact": {"fixed_s": 1e-6}}}))
    with pytest.raises(EdgeMoEError, match="cost.json.*exact"):
        measured_costs(bad)
    bad.write_text("[]")
    with pytest.raises(EdgeMoEError, match="costs"):
        measured_costs(bad)
    costs = measured_costs(DEFAULT_PATH)  # the shipped file
    ctx, _, _ = _one_user()
    for name, params in (("exact", {}), ("ordermoe", {"horizon": 2}), ("ordermoe", {"horizon": 1})):
        pol = make_policy(name, ctx, **params)
        got = cost_for(pol, costs)
        if policy_label(pol) not in costs:  # an unmeasured depth: the slowest measured one
            assert all(got.seconds(1) >= c.seconds(1) or got.seconds(64) >= c.seconds(64)
                       for k, c in costs.items() if k.startswith("ordermoe"))
    with pytest.raises(EdgeMoEError, match="no measured decision cost"):
        cost_for(make_policy("exact", ctx), {"drop": DecisionCost(0.0, 0.0)})
