"""The compiled replay (`plan.ordermoe.replay_kernel`) gives the numpy reference's bits: whole replays, single
deltas with their patches, batched adds and removals, for every mode, stand-in kind set and K up to 4, on
clusters with devices and a cloud; and the settings dataclass stands for plan_ordermoe's keywords."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.jit import HAVE_NUMBA
from edgemoe.plan import plan, plan_problem
from edgemoe.plan.ordermoe.planner import OrderMoESettings, ordermoe_settings, plan_ordermoe
from edgemoe.plan.ordermoe.runtime_model import PathModel
from edgemoe.plan.synthetic import synthetic_problem
from edgemoe.profile import synthetic_profile
from edgemoe.profile.groups import groups_for

CASES = [  # (cluster, K, mode, budget, stand-in kinds)
    ("edge8", 2, "migrate", 0.05, "sub,drop,zero"),
    ("device-edge-cloud", 2, "home", 0.05, "sub,drop,zero"),
    ("device-edge-cloud", 4, "migrate", 0.2, "sub,drop,zero"),
    ("testbed8", 3, "migrate", 0.0, "sub,drop,zero"),
    ("edge8", 4, "home", 0.1, "drop,zero"),
    ("edge8", 3, "migrate", 0.1, "sub"),
]


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.skipif(not HAVE_NUMBA, reason="the compiled replay needs numba")
@pytest.mark.parametrize("cluster, top_k, mode, budget, kinds", CASES)
def test_compiled_replay_equals_numpy_bit_for_bit(cluster, top_k, mode, budget, kinds):
    profile = synthetic_profile(3, 8, top_k, 400, seed=4)
    problem = plan_problem(profile, cluster, domain_fallback=True)
    model = PathModel(problem, mode, 24, budget, groups_for(profile).substitute_ids, kinds=kinds)
    assert model.compiled
    hosts = plan(problem, "lfu").hosts.copy()
    state = model.replay(hosts)
    model.compiled = False
    reference = model.replay(hosts)
    for got, want in zip((state.latency_s, state.location, state.budget_left),
                         (reference.latency_s, reference.location, reference.budget_left), strict=True):
        np.testing.assert_array_equal(got, want)
    rng = np.random.default_rng(0)
    for _ in range(25):
        layer, e, n = int(rng.integers(3)), int(rng.integers(8)), int(rng.integers(problem.num_nodes))
        value = not hosts[n, layer, e]
        out = []
        for compiled in (True, False):
            model.compiled = compiled
            adds = model.delta_batch(state, hosts, layer, [e], np.arange(problem.num_nodes), True)
            held = np.flatnonzero(hosts[n, layer])
            drops = model.delta_singles(state, hosts, layer, n, held, False) if held.size else None
            before = hosts[:, layer].copy()
            hosts[n, layer, e] = value
            delta, patch = model.delta(state, hosts, layer, [e], before=before)
            hosts[n, layer, e] = not value
            out.append((adds, drops, delta, patch))
        (a1, d1, x1, p1), (a2, d2, x2, p2) = out
        np.testing.assert_array_equal(a1, a2)
        assert _equal(None if d1 is None else (d1,), None if d2 is None else (d2,))
        # the patches' first four arrays are the replay's; the compiled path adds its budget bounds
        assert x1 == x2 and _equal(None if p1 is None else p1[:4], None if p2 is None else p2[:4])
        hosts[n, layer, e] = value  # move on from the changed state, as the search does
        model.compiled = True
        model.commit(state, p1)
    model.compiled = False
    fresh = model.replay(hosts)
    np.testing.assert_array_equal(state.latency_s, fresh.latency_s)
    np.testing.assert_array_equal(state.location, fresh.location)
    # the budget bounds the deltas carried along (reused where a decision held) are a fresh replay's
    model.compiled = True
    fresh = model.replay(hosts)
    np.testing.assert_array_equal(state.q_need, fresh.q_need)
    np.testing.assert_array_equal(state.q_block, fresh.q_block)


def test_settings_stand_for_the_keywords():
    problem = synthetic_problem(num_servers=3, num_users=4, num_layers=2, num_experts=6, slots_per_server=4, seed=1)
    by_keywords = plan_ordermoe(problem, mode="home", max_evals=50, budget=0.1)
    by_settings = plan_ordermoe(problem, OrderMoESettings(mode="home", max_evals=50, budget=0.1))
    mixed = plan_ordermoe(problem, OrderMoESettings(mode="home", max_evals=50), budget=0.1)
    for other in (by_settings, mixed):
        np.testing.assert_array_equal(by_keywords.hosts, other.hosts)
        assert by_keywords.params == other.params
    assert ordermoe_settings(budget=0.2) == OrderMoESettings(budget=0.2)
    with pytest.raises(EdgeMoEError, match="colour"):
        plan_ordermoe(problem, colour="red")
    with pytest.raises(EdgeMoEError, match="gamma"):
        ordermoe_settings(gamma=1.5)
    with pytest.raises(Exception, match="frozen|cannot assign"):
        OrderMoESettings().budget = 1.0  # type: ignore[misc]


def test_cli_params_are_the_settings_fields():
    """`--param` is checked against the dataclass: every field is accepted with its type, nothing else."""
    from dataclasses import fields

    from edgemoe.plan.cli import check_params

    assert check_params("ordermoe", {"budget": 0.1, "theta": None, "algorithm": "two-stage"}) == {
        "budget": 0.1, "theta": None, "algorithm": "two-stage"}
    with pytest.raises(EdgeMoEError, match="does not take --param colour.*valid: mode, algorithm"):
        check_params("ordermoe", {"colour": 1})
    with pytest.raises(EdgeMoEError, match="max_evals"):
        check_params("ordermoe", {"max_evals": "many"})
    import inspect

    assert list(inspect.signature(plan_ordermoe).parameters)[1:] == [f.name for f in fields(OrderMoESettings)]
