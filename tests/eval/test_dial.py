"""The quality dial: known answers, monotone in the asked increase, per-request grants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgemoe.errors import EdgeMoEError
from edgemoe.eval.dial import QualityDial, calibrate_dial


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


@given(rise=st.lists(st.floats(-0.01, 5.0), min_size=2, max_size=8),
       asked=st.lists(st.floats(0.0, 6.0), min_size=2, max_size=6))
def test_the_budget_is_monotone_in_the_asked_increase_and_fits(rise, asked):
    grid = np.arange(len(rise), dtype=float) / 10
    dial = QualityDial(grid, np.array(rise))
    asked = np.sort(np.array(asked))
    b = dial.budget(asked)
    assert (np.diff(b) >= -1e-12).all()
    assert ((b >= 0) & (b <= grid[-1] + 1e-12)).all()
    # the interpolated envelope at the granted budget never exceeds what was asked (when anything fits)
    env_at = np.interp(b, grid, dial.envelope)
    assert (env_at <= np.maximum(asked, dial.envelope[0]) + 1e-9).all()
