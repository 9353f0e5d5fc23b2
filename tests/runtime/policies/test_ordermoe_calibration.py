"""OrderMoE with stand-ins priced by measured nats per kind and layer (`calibration=`, issue 19 section 2):
known answers of `choose_stand_ins` with scales and an allowed empty layer, the default left bit for bit
as it was, a uniform calibration of 4 = the uncalibrated policy at 4x the budget (decision for decision),
bad calibrations refused, the file form read, and the compiled loop declined."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgemoe.errors import EdgeMoEError
from edgemoe.plan.ordermoe.standins import KINDS, KindCalibration, choose_stand_ins, subset_bits
from edgemoe.runtime import make_policy
from edgemoe.runtime.policies.ordermoe import compiled_loop_supported

from ..conftest import tiny_cluster, tiny_context, tiny_profile
from .test_field_baselines import deployment, run


def one_slot_pair(err_sub: float, err_drop: float):
    """One row at layer 0 routed to (0, 1), gates (0.6, 0.4); slot 0's substitute is 2 at err_sub, and running
    1 in 0's place (drop) has error err_drop."""
    err = np.ones((1, 4, 4))
    err[0, 0, 1] = err_drop
    err[0, 1, 0] = 0.5
    err[0, 0, 2] = err_sub
    return (np.array([0]), np.array([[0, 1]]), np.array([[0.6, 0.4]]), np.array([[2, -1]]),
            np.array([[err_sub, np.inf]]), err)


def test_no_scale_is_the_uncalibrated_answer_bit_for_bit():
    layer, topk, gates, sub, sub_err, err = one_slot_pair(0.8, 1.3)
    mask = subset_bits(2)[None]
    k0, c0 = choose_stand_ins(layer, topk, gates, sub, sub_err, err, mask, KINDS)
    k1, c1 = choose_stand_ins(layer, topk, gates, sub, sub_err, err, mask, KINDS, scale=np.ones((1, 3)))
    assert np.array_equal(k0, k1) and np.array_equal(c0, c1)
    assert KINDS[k0[0, 3, 0]] == "sub" and np.isfinite(c0[0, 3]).all()  # both replaced, slot 0 substituted
    sub = np.full((1, 2), -1)
    _, c0 = choose_stand_ins(layer, topk, gates, sub, np.full((1, 2), np.inf), err, mask, KINDS, scale=np.ones((1, 3)))
    assert np.isinf(c0[0, 3]).all()  # both replaced and none substituted: still forbidden without `empty`


def test_scales_pick_the_kind_measured_cheaper():
    layer, topk, gates, sub, sub_err, err = one_slot_pair(1.2, 1.3)
    mask = subset_bits(2)[None]
    kind, cost = choose_stand_ins(layer, topk, gates, sub, sub_err, err, mask, KINDS)
    assert KINDS[kind[0, 1, 0]] == "zero" and cost[0, 1, 0] == pytest.approx(0.6 ** 2)  # 1.2 > 1: zero wins
    # measured: a substitute's unit of P^2 costs a quarter of zeroing's (scale 0.5 vs 1): the substitute wins
    kind, cost = choose_stand_ins(layer, topk, gates, sub, sub_err, err, mask, KINDS,
                                  scale=np.array([[0.5, 1.0, 1.0]]))
    assert KINDS[kind[0, 1, 0]] == "sub" and cost[0, 1, 0] == pytest.approx((0.6 * 1.2 * 0.5) ** 2)
    # drop priced at 0.1 of its perturbation: drop wins over both
    kind, cost = choose_stand_ins(layer, topk, gates, sub, sub_err, err, mask, KINDS,
                                  scale=np.array([[0.5, 0.1, 1.0]]))
    assert KINDS[kind[0, 1, 0]] == "drop" and cost[0, 1, 0] == pytest.approx((0.6 * 1.3 * 0.1) ** 2)


def test_an_empty_layer_costs_its_measured_nats_shared_by_perturbation():
    layer, topk, gates, sub, sub_err, err = one_slot_pair(1.2, 1.3)
    sub, sub_err = np.full((1, 2), -1), np.full((1, 2), np.inf)  # no substitute: replacing both zeroes the layer
    mask = subset_bits(2)[None]
    kind, cost = choose_stand_ins(layer, topk, gates, sub, sub_err, err, mask, KINDS, scale=np.ones((1, 3)),
                                  empty=np.array([0.25]))
    assert [KINDS[k] for k in kind[0, 3]] == ["zero", "zero"]
    assert cost[0, 3].sum() == pytest.approx(0.25) and cost[0, 3, 0] / cost[0, 3, 1] == pytest.approx(0.6 / 0.4)
    assert np.isfinite(cost[0, 1, 0]) and cost[0, 1, 0] == pytest.approx(0.6 ** 2)  # one slot: as before


def calibration(nats, empty=None):
    return KindCalibration(np.asarray(nats, float), None if empty is None else np.asarray(empty, float))


def test_bad_calibrations_are_refused():
    with pytest.raises(EdgeMoEError, match="nats must be"):
        calibration(np.ones((2, 3)))
    with pytest.raises(EdgeMoEError, match="nats must be"):
        calibration([[1, 0], [1, 1], [1, 1]])
    with pytest.raises(EdgeMoEError, match="empty must be"):
        calibration(np.ones((3, 2)), [1.0, np.nan])
    with pytest.raises(EdgeMoEError, match="kinds must be"):
        KindCalibration.from_dict({"kinds": ["drop", "sub", "zero"], "nats": np.ones((3, 2)).tolist()})
    with pytest.raises(EdgeMoEError, match="expected an object"):
        KindCalibration.from_dict([1, 2])
    cal = calibration(np.full((3, 2), 2.0), [3.0, 4.0])
    assert KindCalibration.from_dict(json.loads(json.dumps(cal.to_dict()))).to_dict() == cal.to_dict()


def test_the_policy_reads_a_calibration_file_and_checks_its_layers(tmp_path):
    profile, ctx = deployment(1, "internet", "migrate")
    L = ctx.num_layers
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"calibration": calibration(np.ones((3, L))).to_dict()}))
    pol = make_policy("ordermoe", ctx, budget=0.1, calibration=str(path))
    assert pol.calib is not None and pol.params["calibration"]["nats"] == np.ones((3, L)).tolist()
    assert not compiled_loop_supported(pol) and pol.compiled_rule() is None
    with pytest.raises(EdgeMoEError, match="layers"):
        make_policy("ordermoe", ctx, budget=0.1, calibration=calibration(np.ones((3, L + 1))).to_dict())
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(EdgeMoEError, match="bad.json"):
        make_policy("ordermoe", ctx, budget=0.1, calibration=str(tmp_path / "bad.json"))
    assert "calibration" not in make_policy("ordermoe", ctx, budget=0.1).params  # the default records none


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 5), mode=st.sampled_from(["home", "migrate"]), budget=st.sampled_from([0.05, 0.3, 2.0]),
       horizon=st.sampled_from([0, 2]), choice=st.sampled_from(["group", "token"]))
def test_a_uniform_calibration_of_4_is_the_policy_at_4x_the_budget(seed, mode, budget, horizon, choice):
    """Every kind at 4 nats per unit of P^2 scales every perturbation by exactly 2 and every cost by exactly
    4 (powers of two: no rounding), so with 4x the budget every decision is the uncalibrated one's; with the
    stand-ins chosen per token too (the combination bench.studies.equal_quality calls ordermoe-full)."""
    profile, ctx = deployment(seed, "internet", mode)
    rng = np.random.default_rng(seed)
    rows, users = rng.integers(0, profile.num_tokens, 24), rng.integers(0, ctx.num_users, 24)
    load = rng.uniform(0, 0.01, ctx.num_nodes)
    plain = make_policy("ordermoe", ctx, budget=budget, horizon=horizon, stand_in_choice=choice)
    cal = make_policy("ordermoe", ctx, budget=4 * budget, horizon=horizon, stand_in_choice=choice,
                      calibration=calibration(np.full((3, ctx.num_layers), 4.0)))
    (s0, out0), (s1, out1) = run(plain, profile, ctx, rows, users, load), run(cal, profile, ctx, rows, users, load)
    for (_, d0, _), (_, d1, _) in zip(out0, out1, strict=True):
        assert np.array_equal(d0.experts, d1.experts) and np.array_equal(d0.node, d1.node)
        assert np.array_equal(d0.next_location, d1.next_location)
        assert np.array_equal(4 * d0.quality_cost, d1.quality_cost)
    assert np.array_equal(4 * s0.budget_used, s1.budget_used)


def test_an_allowed_empty_layer_is_bought_only_when_it_pays_and_is_affordable():
    """Two nodes; the token at a routes (1, 2), both held only by b: with no substitute, only an empty layer
    avoids b. Forbidden without `empty`; with it, taken when its measured cost fits the budget."""
    profile = tiny_profile([[1, 2]], num_experts=4)
    ctx = tiny_context(profile, tiny_cluster(("a", "b")), {"a": [(0, 0), (0, 3)], "b": [(0, 1), (0, 2)]})
    ctx = replace(ctx, best_sub=np.full_like(ctx.best_sub, -1), best_sub_err=np.full_like(ctx.best_sub_err, np.inf))
    topk, gates = np.array([[1, 2]]), np.array([[0.5, 0.5]])

    def decide(cal, budget):
        pol = make_policy("ordermoe", ctx, budget=budget, horizon=0, calibration=cal)
        state = pol.start(np.array([0]))
        return pol.decide(0, topk, gates, state)

    nats = np.full((3, 1), 1.0)
    dec = decide(calibration(nats), 10.0)
    assert (dec.experts >= 0).any()  # something runs: no empty layer without a measured cost
    dec = decide(calibration(nats, [0.2]), 10.0)
    assert (dec.experts == -1).all() and dec.zeroed.all() and dec.quality_cost[0] == pytest.approx(0.2)
    dec = decide(calibration(nats, [0.2]), 0.1)  # 0.1 per token-layer x 1 layer < 0.2: not affordable
    assert (dec.experts >= 0).any()
