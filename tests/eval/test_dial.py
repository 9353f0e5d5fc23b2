"""The quality dial: known answers, monotone in the asked increase, per-request grants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgemoe.distributed.batching import mix_rows, row_allowance
from edgemoe.errors import EdgeMoEError
from edgemoe.eval.dial import (
    CURVES,
    QualityDial,
    calibrate_dial,
    handoff,
    isotonic,
    rise_interval,
    steepest_step,
)


def test_known_answers():
    dial = QualityDial(np.array([0.0, 0.1, 0.2, 0.4]), np.array([0.0, 0.01, 0.05, 0.05]))
    assert dial.budget(0.0) == 0.0
    assert dial.budget(0.005) == pytest.approx(0.05)  # halfway up the first step
    assert dial.budget(0.01) == pytest.approx(0.1)
    assert dial.budget(0.03) == pytest.approx(0.15)
    assert dial.budget(0.05) == pytest.approx(0.4)  # the plateau: the largest budget that fits
    assert dial.budget(1.0) == pytest.approx(0.4)
    np.testing.assert_allclose(dial.budget([0.01, 0.03]), [0.1, 0.15])
    assert dial.raw_monotone


def test_a_falling_curve_is_flagged_and_never_credited():
    dial = QualityDial(np.array([0.0, 0.1, 0.2, 0.3]), np.array([0.0, 0.04, 0.02, 0.08]))
    assert not dial.raw_monotone
    np.testing.assert_allclose(dial.envelope, [0.0, 0.04, 0.04, 0.08])
    assert dial.budget(0.03) == pytest.approx(0.075)
    assert dial.budget(0.06) == pytest.approx(0.25)


def test_bad_input():
    with pytest.raises(EdgeMoEError, match="ascending from 0"):
        QualityDial(np.array([0.1, 0.2]), np.array([0.0, 0.1]))
    with pytest.raises(EdgeMoEError, match="max_ppl_increase"):
        QualityDial(np.array([0.0, 0.2]), np.array([0.0, 0.1])).budget(-0.1)


def test_calibrate_and_grant():
    dial = calibrate_dial(lambda b: b * b, [0.5, 1.0], policy="p", calib_tokens=10)
    np.testing.assert_allclose(dial.budgets, [0.0, 0.5, 1.0])
    assert dial.to_dict()["calib_ppl_rel_increase"] == [0.0, 0.25, 1.0]

    class State:  # the two fields a grant touches
        layer = np.zeros(4, np.int64)
        budget_total = np.zeros(4)

    s = State()
    dial.grant(s, np.array([1, 2]), 0.25, num_layers=4)
    np.testing.assert_allclose(s.budget_total, [0.0, 2.0, 2.0, 0.0])
    s.layer[1] = 1
    with pytest.raises(EdgeMoEError, match="before its first layer"):
        dial.grant(s, np.array([1]), 0.1, 4)


@pytest.mark.parametrize("curve", CURVES)
@given(rise=st.lists(st.floats(-0.01, 5.0), min_size=2, max_size=8),
       asked=st.lists(st.floats(0.0, 6.0), min_size=2, max_size=6))
def test_the_budget_is_monotone_in_the_asked_increase_and_fits(curve, rise, asked):
    grid = np.arange(len(rise), dtype=float) / 10
    dial = QualityDial(grid, np.array(rise), curve=curve)
    asked = np.sort(np.array(asked))
    b = dial.budget(asked)
    assert (np.diff(b) >= -1e-12).all()
    assert ((b >= 0) & (b <= grid[-1] + 1e-12)).all()
    # the interpolated envelope at the granted budget never exceeds what was asked (when anything fits)
    env_at = np.interp(b, grid, dial.envelope)
    assert (env_at <= np.maximum(asked, dial.envelope[0]) + 1e-9).all()
    # never credited with more harm than the running maximum credits
    assert (dial.envelope <= QualityDial(grid, np.array(rise)).envelope + 1e-12).all()

def test_the_mixture_lands_inside_a_cliff_known_answers():
    # a plateau, then a cliff: no budget between 0.2 and 0.4 is measured, and a rise of 0.15 needs a mixture
    dial = QualityDial(np.array([0.0, 0.1, 0.2, 0.4]), np.array([0.0, 0.05, 0.05, 1.0]))
    assert dial.mix(0.0) == (0.0, 0.1, 0.0)
    assert dial.mix(0.05) == (0.2, 0.4, 0.0)  # the plateau's largest budget, nothing dealt above it
    low, high, share = dial.mix(0.15)
    assert (low, high) == (0.2, 0.4)
    assert share == pytest.approx((np.log1p(0.15) - np.log1p(0.05)) / (np.log1p(1.0) - np.log1p(0.05)))
    assert dial.mix(2.0) == (0.4, 0.4, 0.0)  # beyond the curve: its top budget
    with pytest.raises(EdgeMoEError, match="max_ppl_increase"):
        dial.mix(-0.01)


@pytest.mark.parametrize("curve", CURVES)
@given(rise=st.lists(st.floats(-0.01, 5.0), min_size=2, max_size=8), asked=st.floats(0.0, 6.0))
def test_the_mixture_meets_the_asked_rise_on_the_calibration_curve(curve, rise, asked):
    """Its mean extra nats are the asked ones whenever the curve reaches them, and its budgets bracket them."""
    grid = np.arange(len(rise), dtype=float) / 10
    dial = QualityDial(grid, np.array(rise), curve=curve)
    env = dial.envelope
    low, high, share = dial.mix(asked)
    nats = (1 - share) * np.log1p(np.interp(low, grid, env)) + share * np.log1p(np.interp(high, grid, env))
    assert 0 <= share <= 1 and low <= high and low in grid and high in grid
    if env[0] <= asked <= env[-1]:
        assert nats == pytest.approx(np.log1p(asked), abs=1e-9)
    else:  # below the curve's start (it credits exact execution with a rise): exact; beyond its end: its top
        assert low == high == (grid[0] if asked < env[0] else grid[-1]) and share == 0


@given(share=st.floats(0.0, 1.0), start=st.integers(0, 10_000), n=st.integers(1, 2000))
def test_mixed_rows_hold_their_share_in_every_window(share, start, n):
    """Of any n consecutive positions, share x n run at the high budget, give or take a few (a Weyl sequence)."""
    rows = mix_rows(1.0, 2.0, share, np.arange(start, start + n))
    assert set(np.unique(rows)) <= {1.0, 2.0}
    assert abs((rows == 2.0).sum() - share * n) <= 3 + np.log2(n)


def test_row_allowances_deal_each_requests_mixture_under_the_ceiling():
    from edgemoe.distributed.batching import StreamRequest

    def req(user, **kw):
        return StreamRequest("r", user, np.array([1]), 1, **kw)

    owner, positions = np.array([0, 0, 0, 1, 1, 2]), np.array([0, 1, 2, 0, 1, 7])
    reqs = [req(0, budget=0.1, budget_mix=(0.9, 1.0)), req(1), req(0, exact=True, budget=0.1, budget_mix=(0.2, 1.0))]
    got = row_allowance([0.5, 0.5], reqs, owner, positions)
    # request 0: every row at its high budget, capped at the ceiling; 1: its own ceiling; 2: exact, nothing
    np.testing.assert_allclose(got, [0.5, 0.5, 0.5, 0.5, 0.5, 0.0])
    half = row_allowance([1.0], [req(0, budget=0.1, budget_mix=(0.3, 0.5))], np.zeros(4, np.int64), np.arange(4))
    np.testing.assert_allclose(half, mix_rows(0.1, 0.3, 0.5, np.arange(4)))


def test_isotonic_known_answers():
    np.testing.assert_allclose(isotonic(np.array([0.0, 0.0037, 0.0045, 0.002, 0.0037, 0.0056])),
                               [0.0, 0.0034, 0.0034, 0.0034, 0.0037, 0.0056])
    np.testing.assert_allclose(isotonic(np.array([1.0, 2.0, 3.0])), [1.0, 2.0, 3.0])  # monotone: unchanged
    np.testing.assert_allclose(isotonic(np.array([3.0, 1.0, 2.0])), [2.0, 2.0, 2.0])


@given(st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=9))
def test_isotonic_is_the_minimax_of_block_means(y):
    """Isotonic regression's closed form: x_k = max over i <= k of min over j >= k of mean(y[i..j])."""
    y = np.array(y)
    n = len(y)
    brute = [max(min(y[i:j + 1].mean() for j in range(k, n)) for i in range(k + 1)) for k in range(n)]
    x = isotonic(y)
    np.testing.assert_allclose(x, brute, atol=1e-12)
    assert (np.diff(x) >= -1e-12).all()
    assert x.sum() == pytest.approx(y.sum(), abs=1e-9)


def test_an_isotonic_curve_averages_a_noisy_point_instead_of_lifting_everything_after_it():
    rise = np.array([0.0, 0.0037, 0.0045, 0.002, 0.0056, 0.0078])  # budget 0.005 measured high by noise
    grid = np.array([0.0, 0.002, 0.005, 0.01, 0.02, 0.05])
    run, iso = QualityDial(grid, rise), QualityDial(grid, rise, curve="isotonic")
    np.testing.assert_allclose(run.envelope, [0.0, 0.0037, 0.0045, 0.0045, 0.0056, 0.0078])
    np.testing.assert_allclose(iso.envelope, [0.0, 0.0034, 0.0034, 0.0034, 0.0056, 0.0078])
    # asked 0.4%: the running maximum stops inside the first step, the isotonic fit reaches into the fourth
    assert run.budget(0.004) == pytest.approx(0.002 + 0.003 * (0.004 - 0.0037) / (0.0045 - 0.0037))
    assert iso.budget(0.004) == pytest.approx(0.01 + 0.01 * (0.004 - 0.0034) / (0.0056 - 0.0034))
    assert iso.to_dict()["curve"] == "isotonic"
    with pytest.raises(EdgeMoEError, match="curve must be one of"):
        QualityDial(grid, rise, curve="max")


def test_rise_interval():
    lo, hi = rise_interval(np.full(5, 0.01))  # every block the same: no spread
    assert lo == pytest.approx(np.expm1(0.01)) and hi == pytest.approx(np.expm1(0.01))
    d = np.array([0.0, 0.0, 0.0, 0.04])
    lo, hi = rise_interval(d, level=0.9)
    assert 0.0 <= lo <= np.expm1(d.mean()) <= hi <= np.expm1(0.04)
    assert rise_interval(d, seed=3) == rise_interval(d, seed=3)
    with pytest.raises(EdgeMoEError, match="rise_interval"):
        rise_interval(np.zeros((2, 2)))


def test_a_saturated_asked_value_is_handed_to_the_wider_dial():
    narrow = QualityDial(np.array([0.0, 1.0, 2.0]), np.array([0.0, 0.02, 0.03]))  # saturates at +3%
    wide = QualityDial(np.array([0.0, 1.0, 2.0]), np.array([0.0, 0.01, 0.2]))
    # within reach: the narrow dial, whatever the wide one would say
    assert handoff(0.01, narrow, wide) == (False, 0.5)
    assert handoff(0.03, narrow, wide) == (False, 2.0)
    # beyond +3%: the wide dial's interpolated budget, 1 + (0.078 - 0.01) / 0.19
    used, b = handoff(0.078, narrow, wide)
    assert used and b == pytest.approx(1.0 + 0.068 / 0.19)
    # beyond the wide dial too: its top budget; without a wide dial: the narrow one's fastest point
    assert handoff(0.5, narrow, wide) == (True, 2.0)
    assert handoff(0.078, narrow, None) == (False, 2.0)


@given(st.lists(st.floats(0.0, 0.5), min_size=2, max_size=6), st.lists(st.floats(0.0, 0.5), min_size=2, max_size=6),
       st.floats(0.0, 1.0))
def test_the_handoff_serves_the_narrow_dial_exactly_within_its_reach(narrow_rise, wide_rise, asked):
    narrow = QualityDial(np.arange(len(narrow_rise), dtype=float), np.array([0.0, *narrow_rise[1:]]), curve="isotonic")
    wide = QualityDial(np.arange(len(wide_rise), dtype=float), np.array([0.0, *wide_rise[1:]]), curve="isotonic")
    used, b = handoff(asked, narrow, wide)
    assert used == (asked > narrow.envelope[-1])
    assert b == pytest.approx(float((wide if used else narrow).budget(asked)))


def knee(b: float) -> float:
    """A plateau at +5% up to budget 0.85, then a cliff to +120% (a layer every token loses at once)."""
    return 0.05 * min(b / 0.1, 1.0) if b < 0.85 else 1.2


def test_refinement_bisects_the_knee_and_nothing_else():
    calls: list[float] = []

    def rise(b):
        calls.append(b)
        return knee(b)

    coarse = calibrate_dial(knee, [0.1, 0.5, 0.8, 1.0])
    fine = calibrate_dial(rise, [0.1, 0.5, 0.8, 1.0], refine=3)
    # the only turn is 0.8 -> 1.0 (after a plateau): bisected at 0.9, then 0.85 (the cliff is at 0.85: 0.8 -> 0.9
    # still jumps), then 0.825 (0.8 -> 0.85 jumps)
    assert calls[5:] == pytest.approx([0.9, 0.85, 0.825])
    assert np.all(np.isin(coarse.budgets, fine.budgets))
    # +15% asked: linear across the coarse step lands at 0.817; refined, just below the cliff
    assert float(coarse.budget(0.15)) == pytest.approx(0.8 + 0.2 * 0.10 / 1.15)
    assert 0.825 <= float(fine.budget(0.15)) < 0.85


def test_no_refinement_on_a_smooth_curve_and_bad_settings_are_refused():
    calls: list[float] = []

    def rise(b):
        calls.append(b)
        return 0.1 * b

    dial = calibrate_dial(rise, [0.25, 0.5, 0.75, 1.0], refine=5)
    assert len(calls) == 5 and len(dial.budgets) == 5  # 0 and the four: a straight line has no turn
    assert steepest_step(dial, up_to=0.3, jump=2.0) is None
    for kw in ({"refine": -1}, {"jump": 1.0}, {"up_to": 0.0}):
        with pytest.raises(EdgeMoEError, match="calibrate_dial"):
            calibrate_dial(rise, [1.0], **kw)


@given(st.lists(st.floats(0.0, 2.0), min_size=3, max_size=6), st.integers(0, 4))
def test_refinement_keeps_the_grid_and_adds_at_most_refine_points(rise_values, refine):
    grid = np.arange(1, len(rise_values) + 1, dtype=float)
    table = dict(zip(grid.tolist(), rise_values, strict=True))
    dial = calibrate_dial(lambda b: table.get(b, 0.5 * max(rise_values)), grid, curve="isotonic", refine=refine)
    assert np.all(np.isin(np.concatenate([[0.0], grid]), dial.budgets))
    assert len(dial.budgets) <= len(grid) + 1 + refine and np.all(np.diff(dial.budgets) > 0)
