"""OrderMoE with its spending paced layer by layer (`accrue=True`, issue 19): a row never spends more by layer
l than its allowance x (l + 1), whatever the stand-in choice or calibration; the default is untouched; the
compiled simulator loop declines the option (its decisions are the Python policy's)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgemoe.plan.ordermoe.standins import KindCalibration
from edgemoe.runtime import make_policy
from edgemoe.runtime.policies.ordermoe import compiled_loop_supported

from .test_field_baselines import deployment, run


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 5), mode=st.sampled_from(["home", "migrate"]), budget=st.sampled_from([0.02, 0.3, 2.0]),
       horizon=st.sampled_from([0, 2]), choice=st.sampled_from(["group", "token"]), calibrated=st.booleans())
def test_an_accruing_row_spends_at_most_its_allowance_so_far(seed, mode, budget, horizon, choice, calibrated):
    profile, ctx = deployment(seed, "internet", mode)
    rng = np.random.default_rng(seed + 3)
    rows, users = rng.integers(0, profile.num_tokens, 24), rng.integers(0, ctx.num_users, 24)
    load = rng.uniform(0, 0.01, ctx.num_nodes)
    extra = {"calibration": KindCalibration(np.full((3, ctx.num_layers), 2.0))} if calibrated else {}
    pol = make_policy("ordermoe", ctx, budget=budget, horizon=horizon, stand_in_choice=choice, accrue=True, **extra)
    state = pol.start(users)
    for layer in range(ctx.num_layers):
        dec = pol.decide(layer, profile.topk[rows, layer].astype(np.int64), profile.gates[rows, layer], state, load)
        assert (dec.quality_cost >= 0).all()
        assert (state.budget_used <= pol.allowance[users] * (layer + 1) + 1e-9).all()
    assert pol.params["accrue"] is True and not compiled_loop_supported(pol)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 5), mode=st.sampled_from(["home", "migrate"]), budget=st.sampled_from([0.05, 2.0]))
def test_accrue_off_is_the_default_and_records_nothing(seed, mode, budget):
    profile, ctx = deployment(seed, "internet", mode)
    rng = np.random.default_rng(seed)
    rows, users = rng.integers(0, profile.num_tokens, 16), rng.integers(0, ctx.num_users, 16)
    load = rng.uniform(0, 0.01, ctx.num_nodes)
    plain, off = make_policy("ordermoe", ctx, budget=budget), make_policy("ordermoe", ctx, budget=budget, accrue=False)
    assert "accrue" not in plain.params and "accrue" not in off.params
    (s0, out0), (s1, out1) = run(plain, profile, ctx, rows, users, load), run(off, profile, ctx, rows, users, load)
    for (_, d0, _), (_, d1, _) in zip(out0, out1, strict=True):
        assert np.array_equal(d0.experts, d1.experts) and np.array_equal(d0.node, d1.node)
    assert np.array_equal(s0.budget_used, s1.budget_used)
