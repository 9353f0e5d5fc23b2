"""SlimCaching's knobs are one frozen settings object: given as an object or by name (what `plan` and
`--param` pass), the planner decides the same; a name it does not take is a clear error."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.plan.base import plan
from edgemoe.plan.cli import check_params
from edgemoe.plan.slimcaching.planner import SlimCachingSettings, slimcaching
from edgemoe.plan.synthetic import synthetic_problem


@pytest.fixture(scope="module")
def problem():
    return synthetic_problem(num_servers=3, num_users=4, num_layers=3, num_experts=6, top_k=2, slots_per_server=4, seed=2)


def test_an_object_and_names_plan_the_same(problem):
    by_name = plan(problem, "slimcaching", passes=2, kicks=8)
    by_object = slimcaching(problem, SlimCachingSettings(passes=2, kicks=8))
    overridden = slimcaching(problem, SlimCachingSettings(passes=5), passes=2, kicks=8)
    assert np.array_equal(by_name.hosts, by_object.hosts) and np.array_equal(by_name.hosts, overridden.hosts)


def test_settings_are_frozen_and_documented():
    s = SlimCachingSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.passes = 3
    doc = SlimCachingSettings.__doc__
    assert "Parameters:" in doc and all(f"{f.name}:" in doc for f in dataclasses.fields(SlimCachingSettings))
    assert "Returns:" in slimcaching.__doc__


def test_unknown_names_are_refused(problem):
    with pytest.raises(EdgeMoEError, match="unknown parameters \\['passs'\\]"):
        plan(problem, "slimcaching", passs=2)
    with pytest.raises(EdgeMoEError, match="does not take --param passs"):
        check_params("slimcaching", {"passs": "2"})
    assert check_params("slimcaching", {"passes": "3", "refine": "false"}) == {"passes": 3, "refine": False}
