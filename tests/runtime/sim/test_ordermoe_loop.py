"""OrderMoE decided inside the fast engine's compiled loop (`edgemoe.runtime.sim.ordermoe_loop`) makes the same
decisions as the per-wave policy call, bit for bit: every decision array the tally receives (experts, nodes,
locations, meeting nodes, quality costs, latencies, zeroed slots), every pass time, the node busy times, and
the adapted weights, on many small random deployments, budgets, horizons, stand-in kinds and windows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgemoe.cluster import generate, load_cluster
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy
from edgemoe.runtime.metrics import DecisionTally
from edgemoe.runtime.policies import ordermoe as om
from edgemoe.runtime.sim.simulate import run_fast
from edgemoe.runtime.sim.workload import Trace, Workload, build_scenario

pytestmark = pytest.mark.skipif(not om.COMPILED_LOOP, reason="without numba the per-wave call is the only path")

FIELDS = ("experts", "node", "location", "next_location", "quality_cost", "latency_s", "zero_mask")


def recorded_run(monkeypatch, ctx, policy, trace, sc, window, compiled):
    """(run, {field: every decision array, concatenated in tally order}) of one fast-engine run."""
    seen = []
    real = DecisionTally.add

    def add(self, dec, topk, layer, home, prefill):
        seen.append([getattr(dec, f) for f in FIELDS] + [topk, np.broadcast_to(layer, home.shape), home, prefill])
        return real(self, dec, topk, layer, home, prefill)

    monkeypatch.setattr(DecisionTally, "add", add)
    # the per-wave call is the numpy path (not the policy's compiled decode path, which shares the loop's kernel)
    monkeypatch.setattr(om, "COMPILED_DECODE", compiled)
    run = run_fast(ctx, policy, trace, sc, window, compiled=compiled)
    names = (*FIELDS, "topk", "layer", "home", "prefill")
    return run, {n: np.concatenate(c) for n, c in zip(names, zip(*seen, strict=True), strict=True)}, len(seen)


CLUSTERS = {
    "edge8": lambda: load_cluster("edge8"),  # 8 nodes: steered decisions may meet at any node
    "cloud12": lambda: generate(12, 20, seed=5, copies=2, with_cloud=True),
    "gen20": lambda: generate(20, 30, seed=1, copies=2),  # > 16 nodes: meeting nodes among the candidates
}


def build_deployments(top_ks, num_experts, clusters, seed_offset):
    """{(top_k, cluster name, mode): (profile, context)}: a 3-layer synthetic profile per K on each of the
    named clusters, an lfu placement, both modes."""
    out = {}
    for top_k in top_ks:
        profile = synthetic_profile(num_layers=3, num_experts=num_experts, top_k=top_k, num_tokens=200,
                                    seed=seed_offset + top_k)
        for name in clusters:
            cluster = CLUSTERS[name]()
            placement = plan(plan_problem(profile, cluster, domain_fallback=True), "lfu")
            for mode in ("migrate", "home"):
                out[top_k, name, mode] = profile, make_context(profile, cluster, placement, mode=mode,
                                                               domain_fallback=True)
    return out


def assert_loop_matches_policy_call(monkeypatch, ctx, params, trace, sc, window):
    """The compiled loop and the per-call policy path, each with its own fresh policy made from params, give
    the same decisions, pass times, tallies, budgets and adaptive state."""
    policies = [make_policy("ordermoe", ctx, **params) for _ in range(2)]
    assert policies[0].compiled_rule() == "ordermoe"
    fast, fast_dec, fast_chunks = recorded_run(monkeypatch, ctx, policies[0], trace, sc, window, True)
    plain, plain_dec, plain_chunks = recorded_run(monkeypatch, ctx, policies[1], trace, sc, window, False)
    assert fast_chunks == plain_chunks
    for name in plain_dec:
        np.testing.assert_array_equal(fast_dec[name], plain_dec[name], err_msg=name)
    for field in ("pass_begin", "pass_end", "request_arrival", "node_busy"):
        np.testing.assert_array_equal(getattr(fast, field), getattr(plain, field), err_msg=field)
    assert fast.tally == plain.tally
    assert fast.user_budget == plain.user_budget
    assert policies[0].queue_pressure == policies[1].queue_pressure
    for name in ("latency_excess", "spend_rate", "quality_weight"):
        np.testing.assert_array_equal(getattr(policies[0], name), getattr(policies[1], name), err_msg=name)


@pytest.fixture(scope="module")
def deployments():
    return build_deployments((1, 2, 3, 4), 8, CLUSTERS, 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(top_k=st.sampled_from([1, 2, 3, 4]), cluster=st.sampled_from(sorted(CLUSTERS)),
       mode=st.sampled_from(["migrate", "home"]), budget=st.sampled_from([0.0, 0.01, 0.05, 0.3, 2.0]),
       horizon=st.sampled_from([0, 1, 2]), steer=st.sampled_from([None, True, False]),
       substitutes=st.sampled_from(["sub,drop,zero", "sub", "drop,zero", "zero"]), power=st.sampled_from([1.0, 2.0]),
       pace=st.booleans(), window=st.sampled_from([0.0, 1e-3]), arrival=st.sampled_from(["poisson", "closed"]),
       backlog=st.sampled_from(["off", "now", "mean"]), seed=st.integers(0, 10**6))
def test_compiled_loop_decides_as_the_policy_call(monkeypatch, deployments, top_k, cluster, mode, budget, horizon, steer,
                                                 substitutes, power, pace, window, arrival, backlog, seed):
    profile, ctx = deployments[top_k, cluster, mode]
    trace = Trace.from_profile(profile)
    wl = Workload(num_requests=12, prompt_tokens=3, gen_tokens=4, arrival=arrival, rate_per_s=80.0, seed=seed)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, wl)
    # a per-user budget: some users with none (their rows may only run exactly)
    users = np.random.default_rng(seed).random(ctx.num_users)
    params = dict(budget=np.where(users < 0.3, 0.0, budget), horizon=horizon, steer=steer, substitutes=substitutes,
                  quality_power=power, pace=pace, levels=6, backlog=backlog)
    assert_loop_matches_policy_call(monkeypatch, ctx, params, trace, sc, window)


@pytest.fixture(scope="module")
def wide_deployments():
    """K = 5..8 routed experts of 16: prefix actions at the default max_enum_k, all 2^K subsets above it."""
    return build_deployments((5, 6, 8), 16, ("edge8", "gen20"), 10)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(top_k=st.sampled_from([5, 6, 8]), cluster=st.sampled_from(["edge8", "gen20"]),
       mode=st.sampled_from(["migrate", "home"]), budget=st.sampled_from([0.0, 0.05, 0.3, 2.0]),
       horizon=st.sampled_from([0, 1, 2]), steer=st.sampled_from([None, True, False]),
       substitutes=st.sampled_from(["sub,drop,zero", "drop,zero", "zero"]), power=st.sampled_from([1.0, 2.0]),
       max_enum_k=st.sampled_from([1, 4, 8]), backlog=st.sampled_from(["off", "now"]), seed=st.integers(0, 10**6))
def test_compiled_loop_decides_as_the_policy_call_past_four_slots(monkeypatch, wide_deployments, top_k, cluster, mode,
                                                                  budget, horizon, steer, substitutes, power,
                                                                  max_enum_k, backlog, seed):
    """K > 4: the K + 1 prefix actions (K > max_enum_k) and all 2^K subsets (max_enum_k = 8), with the drop
    stand-in's einsum order and numpy's pairwise sums from 8 slots on."""
    profile, ctx = wide_deployments[top_k, cluster, mode]
    trace = Trace.from_profile(profile)
    wl = Workload(num_requests=8, prompt_tokens=3, gen_tokens=3, arrival="closed", seed=seed)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, wl)
    users = np.random.default_rng(seed).random(ctx.num_users)
    params = dict(budget=np.where(users < 0.3, 0.0, budget), horizon=horizon, steer=steer, substitutes=substitutes,
                  quality_power=power, levels=6, backlog=backlog, max_enum_k=max_enum_k)
    assert_loop_matches_policy_call(monkeypatch, ctx, params, trace, sc, 1e-3)


def test_the_wide_runs_replace_slots(monkeypatch, wide_deployments):
    """Guards the test above: at K = 8 with prefixes, some slots are replaced (the prefix masks and the
    8-slot sums are read)."""
    profile, ctx = wide_deployments[8, "gen20", "migrate"]
    trace = Trace.from_profile(profile)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, Workload(num_requests=8, prompt_tokens=3, gen_tokens=3,
                                                                          arrival="closed", seed=3))
    policy = make_policy("ordermoe", ctx, budget=2.0, horizon=2, levels=6, substitutes="drop,zero")
    _, dec, _ = recorded_run(monkeypatch, ctx, policy, trace, sc, 1e-3, True)
    assert (dec["experts"] != dec["topk"]).any() and dec["quality_cost"].sum() > 0


def test_the_adaptive_weights_move_in_these_runs(monkeypatch, deployments):
    """Guards the test above: its runs observe finished passes mid-run (the weights the compiled loop reads
    change), and substitute, drop or zero some slots."""
    profile, ctx = deployments[2, "edge8", "migrate"]
    trace = Trace.from_profile(profile)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, Workload(num_requests=12, prompt_tokens=3, gen_tokens=4,
                                                                          arrival="closed", seed=3))
    policy = make_policy("ordermoe", ctx, budget=0.3, horizon=2, levels=6)
    run, dec, _ = recorded_run(monkeypatch, ctx, policy, trace, sc, 1e-3, True)
    assert (policy.quality_weight != 1.0).any() and policy.queue_pressure > 0
    assert (dec["experts"] != dec["topk"]).any() and dec["quality_cost"].sum() > 0


def test_unsupported_configurations_keep_the_policy_call(deployments):
    _, ctx = deployments[4, "edge8", "migrate"]
    assert make_policy("ordermoe", ctx, max_enum_k=2).compiled_rule() == "ordermoe"  # prefix actions (K > max_enum_k)
    assert make_policy("ordermoe", ctx, quality_power=1.5).compiled_rule() is None
    assert make_policy("ordermoe", ctx).compiled_rule() == "ordermoe"


def test_compiled_mean_is_numpys():
    """`_mean` (the queue pressure's mean load) adds in numpy's pairwise order, past its 128-value blocks too."""
    from edgemoe.runtime.policies.ordermoe_kernel import _mean

    rng = np.random.default_rng(0)
    for n in [0, 1, 7, 8, 9, 127, 128, 129, 300, 1031, 5000]:
        a = rng.random(n) * 10.0 ** rng.uniform(-6, 3, n)
        assert _mean(a) == (float(a.mean()) if n else 0.0), n


def test_lookahead_tables_are_built_once_per_context(deployments):
    """A policy made anew on the same context reuses its look-ahead tables (`lookahead_tables`), other numbers
    get their own, and a run with reused tables is the run with fresh ones (the same tally and weights)."""
    profile, ctx = deployments[2, "edge8", "migrate"]
    first, again = make_policy("ordermoe", ctx, horizon=2, levels=6), make_policy("ordermoe", ctx, horizon=2, levels=6)
    assert again.lookahead is first.lookahead
    assert make_policy("ordermoe", ctx, horizon=1, levels=6).lookahead is not first.lookahead
    assert make_policy("ordermoe", ctx, horizon=2, levels=7).lookahead is not first.lookahead
    fresh = om.LookAhead(ctx, first.grid, 2, 16, first.max_enum_k, first.kinds, first.steer, first.steer_replicas,
                         first.power, home_trip=first.lookahead.home_trip)
    np.testing.assert_array_equal(fresh.stacked, first.lookahead.stacked)
    np.testing.assert_array_equal(fresh.home, first.lookahead.home)
    trace = Trace.from_profile(profile)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, trace, Workload(num_requests=8, prompt_tokens=3, gen_tokens=4,
                                                                          arrival="closed", seed=1))
    runs = [run_fast(ctx, p, trace, sc, 1e-3) for p in (first, again)]
    assert runs[0].tally == runs[1].tally
    np.testing.assert_array_equal(first.quality_weight, again.quality_weight)


def test_the_ewma_weights_table_is_numpys_power():
    """`observe_arrays`' (1 - ewma) ** n table gives each n the bits numpy's power gives it inside any array
    (the compiled observation reads the table where `observe` raises to n[seen])."""
    keep = 1.0 - 0.1
    table = keep ** np.arange(200, dtype=float)
    rng = np.random.default_rng(0)
    for size in (1, 3, 7, 8, 9, 17, 64, 100):
        n = rng.integers(0, 200, size).astype(float)
        np.testing.assert_array_equal(keep ** n, table[n.astype(np.int64)])
