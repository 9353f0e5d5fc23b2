"""A placement records the grouping and budget its planner decided with (`plan` reads them from the planner's
arguments), its file keeps them (old files without them still load), and the runtime serves it with them: the
context's groups are the planner's groups and a budget-spending policy given no budget takes the placement's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgemoe.cluster import load_cluster
from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan_problem
from edgemoe.plan.base import load_placement, plan
from edgemoe.profile import synthetic_profile
from edgemoe.profile.groups import groups_for
from edgemoe.runtime import make_context, make_policy


@pytest.fixture(scope="module")
def setup():
    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=300, seed=3)
    cluster = load_cluster("edge8")
    return profile, cluster, plan_problem(profile, cluster, domain_fallback=True)


@pytest.mark.parametrize("grouping, extra, want", [
    ("layer-aware", {}, {"theta_hi": 0.6, "theta_lo": 0.3}),
    ("uniform", {"theta_hi": 0.7, "theta_lo": 0.3}, {"theta": 0.5}),
    ("fixed", {"groups_per_layer": 3}, {"groups_per_layer": 3}),
    ("error", {"max_err": 0.8, "max_group_size": 3}, {"max_err": 0.8, "max_group_size": 3}),
])
def test_the_context_serves_the_planners_groups(setup, grouping, extra, want):
    profile, cluster, problem = setup
    pl = plan(problem, "ordermoe", algorithm="two-stage", grouping=grouping, **extra)
    assert pl.grouping == {"kind": grouping, "params": want}
    ctx = make_context(profile, cluster, pl, domain_fallback=True)
    # the planner's own groups (their count per layer is in its params) are the ones the runtime serves with
    assert ctx.groups.num_groups.tolist() == pl.params["num_groups"]
    expect = groups_for(profile, grouping, **want)
    assert np.array_equal(ctx.groups.substitute_ids, expect.substitute_ids)


def test_error_groups_are_not_served_as_router_cosine_groups(setup):
    profile, cluster, problem = setup
    pl = plan(problem, "ordermoe", algorithm="two-stage", grouping="error", max_err=0.5)
    served = make_context(profile, cluster, pl, domain_fallback=True).groups
    cosine = groups_for(profile)
    assert served.num_groups.tolist() == groups_for(profile, "error", max_err=0.5).num_groups.tolist()
    assert not np.array_equal(served.substitute_ids, cosine.substitute_ids)


def test_policies_default_to_the_planned_budget(setup):
    profile, cluster, problem = setup
    pl = plan(problem, "ordermoe", algorithm="two-stage", budget=0.02)
    assert pl.budget == 0.02
    ctx = make_context(profile, cluster, pl, domain_fallback=True)
    assert ctx.placement_budget == 0.02
    assert make_policy("ordermoe", ctx).params["budget"] == 0.02
    assert make_policy("skip", ctx).params["budget"] == 0.02
    assert make_policy("ordermoe", ctx, budget=0.1).params["budget"] == 0.1  # a given budget wins
    assert make_policy("drop", ctx).params["budget"] == 0.0  # it never spends one
    lfu = plan(problem, "lfu")  # no budget: the policy's own default
    assert lfu.budget is None and lfu.grouping is None
    assert make_policy("ordermoe", make_context(profile, cluster, lfu, domain_fallback=True)).params["budget"] == 0.05


def test_the_file_keeps_them_and_old_files_load(setup, tmp_path):
    profile, cluster, problem = setup
    pl = plan(problem, "ordermoe", algorithm="two-stage", grouping="error", budget=0.03)
    back = load_placement(pl.save(tmp_path / "p.json"))
    assert (back.grouping, back.budget) == (pl.grouping, pl.budget)
    doc = json.loads((tmp_path / "p.json").read_text())
    for key in ("grouping", "budget"):  # a file written before placements recorded them
        doc.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(doc))
    old = load_placement(tmp_path / "old.json")
    assert old.grouping is None and old.budget is None and np.array_equal(old.hosts, pl.hosts)
    ctx = make_context(profile, cluster, old, domain_fallback=True)
    assert np.array_equal(ctx.groups.substitute_ids, groups_for(profile).substitute_ids)


@pytest.mark.parametrize("field, value, says", [
    ("grouping", {"kind": "cosine", "params": {}}, "grouping must be"),
    ("grouping", {"kind": "error", "params": {"theta": 0.5}}, "grouping must be"),
    ("grouping", {"kind": "error", "params": {"max_err": float("nan")}}, "grouping must be"),
    ("grouping", "error", "grouping must be"),
    ("budget", -0.1, "budget is"),
    ("budget", "0.1", "budget is"),
    ("budget", True, "budget is"),
])
def test_bad_recorded_choices_name_the_file(setup, tmp_path, field, value, says):
    _, _, problem = setup
    doc = plan(problem, "lfu").to_json()
    doc[field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(EdgeMoEError, match=says) as exc:
        load_placement(path)
    assert str(path) in str(exc.value)
