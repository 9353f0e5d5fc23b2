"""The exact ILP against brute-force enumeration on tiny instances."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan
from edgemoe.plan.objective import expected_latency, marginal_prob, slim_model
from edgemoe.plan.synthetic import synthetic_problem

from .slimcaching.test_planner import TINY, brute_force_best, node_subsets  # noqa: F401


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_devices", [False, True])
def test_ilp_equals_enumeration(seed, with_devices):
    problem = synthetic_problem(seed=seed, with_devices=with_devices, device_slots=1,
                                **{**TINY, "num_layers": 1, "num_experts": 4})
    best, _ = brute_force_best(problem)
    placement = plan(problem, "exact", time_limit=30)
    assert placement.params["optimal"]
    assert placement.params["mip_gap"] == pytest.approx(0.0, abs=1e-6)
    assert placement.params["objective_s"] == pytest.approx(best, rel=1e-9)
    assert placement.params["ilp_objective"] == pytest.approx(best, rel=1e-6)


def sum_objective(problem, hosts):
    """Expected total call latency (no max over the K branches), computed directly."""
    from edgemoe.plan.objective import expert_latency

    model = slim_model(problem)
    tau = expert_latency(model, hosts)
    return float(np.einsum("u,ule,ule->", model.weight, marginal_prob(model, tau.shape[2]), tau))


@pytest.mark.parametrize("seed", range(2))
def test_sum_objective_ilp_equals_enumeration(seed):
    problem = synthetic_problem(seed=seed, **{**TINY, "num_layers": 1, "num_experts": 4})
    import itertools

    from edgemoe.plan.base import empty_hosts
    from edgemoe.plan.nodes import cache_nodes

    nodes = cache_nodes(problem)
    best = np.inf
    for combo in itertools.product(*[list(node_subsets(problem, n)) for n in nodes]):
        hosts = empty_hosts(problem)
        for n, mask in zip(nodes, combo, strict=True):
            hosts[n] = mask
        best = min(best, sum_objective(problem, hosts))
    placement = plan(problem, "exact", objective="sum")
    assert placement.params["ilp_objective"] == pytest.approx(best, rel=1e-6)
    assert sum_objective(problem, placement.hosts) == pytest.approx(best, rel=1e-9)


def test_slimcaching_never_beats_the_optimum():
    problem = synthetic_problem(seed=4, with_devices=True, device_slots=1, **{**TINY, "num_experts": 4})
    optimum = plan(problem, "exact", time_limit=30).params["objective_s"]
    for params in ({}, {"passes": 3}):
        assert plan(problem, "slimcaching", **params).params["objective_s"] >= optimum - 1e-12
    assert expected_latency(problem, plan(problem, "greedy").hosts) >= optimum - 1e-12


def test_unknown_objective_is_refused():
    with pytest.raises(EdgeMoEError, match="objective"):
        plan(synthetic_problem(), "exact", objective="nope")


def test_node_limit_is_a_deterministic_stopping_rule():
    """Stopped by the node budget (not the clock): same placement, bound and gap twice, and recorded as such;
    with the default budget the same instance is proven optimal."""
    problem = synthetic_problem(with_devices=True, num_tokens=500, seed=0, num_servers=3, num_users=5, num_layers=2,
                                num_experts=6, slots_per_server=4, device_slots=2)
    runs = [plan(problem, "exact", node_limit=1) for _ in range(2)]
    for pl in runs:
        assert pl.params["stopped_by"] == "node_limit" and pl.params["deterministic"]
        assert not pl.params["proven_optimal"] and pl.params["mip_gap"] > 0
    assert np.array_equal(runs[0].hosts, runs[1].hosts)
    assert runs[0].params["mip_dual_bound"] == runs[1].params["mip_dual_bound"]
    full = plan(problem, "exact")
    assert full.params["stopped_by"] == "optimal" and full.params["proven_optimal"] and full.params["deterministic"]
    assert full.params["mip_dual_bound"] <= full.params["ilp_objective"] * (1 + 1e-9)
    assert runs[0].params["mip_dual_bound"] <= full.params["ilp_objective"] * (1 + 1e-9)


def test_stop_reason_reads_scipy_status_and_highs_message():
    from types import SimpleNamespace

    from edgemoe.plan.exact import stop_reason

    assert stop_reason(SimpleNamespace(status=0, message="Optimal")) == "optimal"
    assert stop_reason(SimpleNamespace(status=1, message="Time limit reached. (HiGHS Status 13: ...)")) == "time_limit"
    assert stop_reason(SimpleNamespace(
        status=4, message="The HiGHS status code was not recognized. (HiGHS Status 16: Solution limit reached)")) \
        == "node_limit"
    assert stop_reason(SimpleNamespace(status=4, message="something else")) == "other"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_devices", [False, True])
def test_lp_relaxation_bounds_the_optimum_from_below(seed, with_devices):
    from edgemoe.plan.exact import lp_relaxation

    problem = synthetic_problem(seed=seed, with_devices=with_devices, device_slots=1,
                                **{**TINY, "num_layers": 1, "num_experts": 4})
    best, _ = brute_force_best(problem)
    frac, bound = lp_relaxation(problem)
    assert bound <= best * (1 + 1e-7)
    assert ((frac >= 0) & (frac <= 1)).all()
    cache = np.array(problem.node_kind) != "cloud"
    assert not frac[~cache].any()  # the cloud holds everything: not a variable
    used = (frac * problem.expert_bytes[None]).sum(axis=(1, 2))  # fractional storage within capacity
    assert (used[cache] <= problem.capacity_bytes[cache] * (1 + 1e-7)).all()


@pytest.mark.parametrize("seed,objective,coverage", [(0, "slimcaching", None), (1, "sum", None),
                                                      (2, "slimcaching", True), (3, "sum", True)])
def test_program_size_counts_what_build_program_builds(seed, objective, coverage):
    from edgemoe.plan.exact import build_program, program_size
    from edgemoe.plan.nodes import resolve_coverage

    problem = synthetic_problem(seed=seed, with_devices=True, num_layers=2, top_k=1 + seed % 3)
    cover = resolve_coverage(problem, coverage)
    b, _ = build_program(problem, objective, cover)
    assert program_size(problem, objective, cover) == (len(b.cost), len(b.vals))


def test_a_program_over_max_nonzeros_is_refused_before_it_is_built():
    from edgemoe.plan.exact import lp_relaxation

    problem = synthetic_problem(seed=0, with_devices=True, num_layers=2)
    with pytest.raises(EdgeMoEError, match="max_nonzeros=100"):
        plan(problem, "exact", max_nonzeros=100)
    with pytest.raises(EdgeMoEError, match="warm_start=.lp.*lp_max_nonzeros"):
        lp_relaxation(problem, max_nonzeros=100)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_devices", [False, True])
def test_lp_round_brackets_the_optimum(seed, with_devices):
    """The LP-rounding solver: its bound is below the brute-force optimum, its placement feasible and no better
    than the optimum, and its gap is the distance between the two it reports."""
    from edgemoe.plan.exact import lp_relaxation

    problem = synthetic_problem(seed=seed, with_devices=with_devices, device_slots=1,
                                **{**TINY, "num_layers": 1, "num_experts": 4})
    best, _ = brute_force_best(problem)
    pl = plan(problem, "exact", solver="lp-round")
    pl.check_capacity()
    p = pl.params
    assert p["solver"] == "lp-round" and p["stopped_by"] == "lp_rounding" and p["deterministic"]
    assert p["mip_dual_bound"] == p["lp_bound"] == pytest.approx(lp_relaxation(problem)[1], rel=1e-9)
    assert p["lp_bound"] <= best * (1 + 1e-7)
    assert p["objective_s"] >= best * (1 - 1e-12)
    assert p["ilp_objective"] == p["objective_s"] == expected_latency(problem, pl.hosts)
    assert p["mip_gap"] == pytest.approx((p["ilp_objective"] - p["lp_bound"]) / p["ilp_objective"], abs=1e-12)
    assert p["proven_optimal"] == (p["mip_gap"] <= 1e-6)


def test_lp_round_sum_objective_and_coverage():
    """objective="sum": the reported value is the expected total call latency of the placement; without a cloud
    the rounding is repaired so every expert has an edge-server copy."""
    problem = synthetic_problem(seed=1, with_cloud=False, **{**TINY, "num_layers": 1, "num_experts": 4})
    pl = plan(problem, "exact", solver="lp-round", objective="sum")
    assert pl.params["coverage"]
    edge = np.array(problem.node_kind) == "edge"
    assert pl.hosts[edge].any(axis=0).all()
    assert pl.params["ilp_objective"] == pytest.approx(sum_objective(problem, pl.hosts), rel=1e-12)
    assert pl.params["lp_bound"] <= pl.params["ilp_objective"] * (1 + 1e-9)


def test_auto_solver_is_chosen_by_size_and_never_by_the_clock():
    problem = synthetic_problem(seed=0, with_devices=True, num_layers=1)  # milp 0.5 CPU s (2 layers: 3 s)
    small = plan(problem, "exact")
    assert small.params["solver"] == "milp"
    assert np.array_equal(small.hosts, plan(problem, "exact", solver="milp").hosts)
    runs = [plan(problem, "exact", milp_max_nonzeros=0) for _ in range(2)]  # every program counts as large
    assert all(r.params["solver"] == "lp-round" for r in runs)
    assert np.array_equal(runs[0].hosts, runs[1].hosts)
    same = {k: v for k, v in runs[0].params.items() if k != "plan_seconds"}
    assert same == {k: v for k, v in runs[1].params.items() if k != "plan_seconds"}
    assert np.array_equal(runs[0].hosts, plan(problem, "exact", solver="lp-round").hosts)
    assert small.params["ilp_objective"] <= runs[0].params["ilp_objective"] * (1 + 1e-9)
    assert runs[0].params["lp_bound"] <= small.params["ilp_objective"] * (1 + 1e-9)


def test_lp_round_time_limit_is_a_guard_that_errors():
    problem = synthetic_problem(seed=0, with_devices=True, num_layers=2)
    with pytest.raises(EdgeMoEError, match="safety cap"):
        plan(problem, "exact", solver="lp-round", time_limit=1e-9)
    with pytest.raises(EdgeMoEError, match="lp_max_nonzeros=100"):
        plan(problem, "exact", solver="lp-round", lp_max_nonzeros=100)
    with pytest.raises(EdgeMoEError, match="solver"):
        plan(problem, "exact", solver="branch")
