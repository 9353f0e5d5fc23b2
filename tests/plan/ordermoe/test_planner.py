"""OrderMoE's latency search: the path replay is the runtime's own arithmetic, and the search reaches the
brute-force / ILP optimum on small instances (within 5%)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.plan import plan
from edgemoe.plan.base import empty_hosts
from edgemoe.plan.objective import expected_latency
from edgemoe.plan.ordermoe.planner import location_problem, plan_ordermoe
from edgemoe.plan.ordermoe.runtime_model import PathModel, one_way_s
from edgemoe.plan.synthetic import synthetic_problem
from edgemoe.profile.groups import groups_for


def _runtime_layer_latency(profile, cluster, placement, mode, users, topk, gates):
    from edgemoe.runtime import make_context, make_policy
    from edgemoe.runtime.local import replay_decisions

    ctx = make_context(profile, cluster, placement, mode=mode, domain_fallback=True)
    return replay_decisions(make_policy("exact", ctx), users, topk, gates)


@pytest.mark.parametrize("mode", ["migrate", "home"])
@pytest.mark.parametrize("cluster", ["edge8", "device-edge-cloud"])
def test_replay_equals_the_runtime_exact_policy(mode, cluster):
    """Budget 0: every layer's latency and next location are the `exact` policy's, to the last bit."""
    from edgemoe.plan import plan_problem
    from edgemoe.profile import synthetic_profile

    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=400, seed=4)
    problem = plan_problem(profile, cluster, domain_fallback=True)
    placement = plan(problem, "lfu")
    model = PathModel(problem, mode, paths_per_user=24, budget=0.0)
    rep = model.replay(placement.hosts)
    dec = _runtime_layer_latency(profile, cluster, placement, mode, model.user, model.topk, model.gates)
    np.testing.assert_array_equal(rep.latency_s, dec.latency_s)
    np.testing.assert_array_equal(rep.location[:, 1:], dec.next_location)


@pytest.mark.parametrize("mode", ["migrate", "home"])
@pytest.mark.parametrize("cluster", ["edge8", "device-edge-cloud"])
@pytest.mark.parametrize("kinds, top_k", [("sub,drop,zero", 2), ("sub", 2), ("drop,zero", 3), ("sub,drop,zero", 5)])
def test_replay_takes_the_ordermoe_policys_stand_ins(mode, cluster, kinds, top_k):
    """Budget > 0: each layer's stand-ins (kind per slot), quality spent, latency and next location are those of
    the ordermoe policy deciding myopically (horizon 0, no pacing price), for every stand-in kind set, with all
    subsets enumerated (K <= 4) and with the prefixes beyond (K = 5)."""
    from edgemoe.plan import plan_problem
    from edgemoe.plan.ordermoe.standins import KINDS
    from edgemoe.profile import synthetic_profile
    from edgemoe.runtime import make_context, make_policy
    from edgemoe.runtime.local import replay_decisions

    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=top_k, num_tokens=400, seed=4)
    problem = plan_problem(profile, cluster, domain_fallback=True)
    groups = groups_for(profile)
    placement = plan(problem, "lfu")
    budget = 0.05
    model = PathModel(problem, mode, 24, budget, groups.substitute_ids, kinds=kinds)
    got: dict = {}
    rep = model.replay(placement.hosts, record=got)
    ctx = make_context(profile, cluster, placement, mode=mode, groups=groups, domain_fallback=True)
    policy = make_policy("ordermoe", ctx, budget=budget, horizon=0, quality_price=0.0, substitutes=kinds)
    dec = replay_decisions(policy, model.user, model.topk, model.gates)
    # the runtime's stand-in per slot: substituted (another expert), zeroed, dropped, or -1 (run exactly)
    kind = np.full(dec.experts.shape, -1)
    kind[(dec.experts >= 0) & (dec.experts != dec.topk)] = KINDS.index("sub")
    kind[(dec.experts < 0) & ~dec.zeroed] = KINDS.index("drop")
    kind[(dec.experts < 0) & dec.zeroed] = KINDS.index("zero")
    np.testing.assert_array_equal(got["kind"], kind)
    assert (kind >= 0).any()  # the case exercises stand-ins at all
    np.testing.assert_allclose(got["quality"], dec.quality_cost, rtol=1e-12, atol=0)
    np.testing.assert_allclose(rep.latency_s, dec.latency_s, rtol=1e-12, atol=0)
    np.testing.assert_array_equal(rep.location[:, 1:], dec.next_location)


@pytest.mark.parametrize("mode", ["migrate", "home"])
def test_incremental_deltas_equal_full_replays(mode):
    problem = synthetic_problem(num_servers=3, num_users=5, num_layers=3, num_experts=6, slots_per_server=5, seed=2)
    groups = groups_for(problem.profile)
    for budget in (0.0, 0.2):
        model = PathModel(problem, mode, 40, budget, groups.substitute_ids)
        hosts = plan(problem, "random", seed=1).hosts.copy()
        state = model.replay(hosts)
        base = model.expected_latency(hosts)
        batch = model.delta_batch(state, hosts, 1, [2], np.array([0, 1, 2]), True)
        for n in range(3):
            old = hosts[n, 1, 2]
            hosts[n, 1, 2] = True
            single, patch = model.delta(state, hosts, 1, [2])
            assert single == pytest.approx(model.expected_latency(hosts) - base, abs=1e-12)
            assert batch[n] == pytest.approx(single, abs=1e-12)
            hosts[n, 1, 2] = old
        hosts[0, 1, 2] = not hosts[0, 1, 2]
        _, patch = model.delta(state, hosts, 1, [2])
        model.commit(state, patch)
        fresh = model.replay(hosts)
        np.testing.assert_array_equal(state.latency_s, fresh.latency_s)
        np.testing.assert_array_equal(state.location, fresh.location)


def test_home_mode_without_cloud_is_slimcachings_objective():
    """With every token path replayed, home mode and no cloud: the replay is SlimCaching's expected latency."""
    problem = synthetic_problem(num_servers=3, num_users=4, num_layers=2, num_experts=6, slots_per_server=6,
                                with_cloud=False, num_tokens=300, seed=5)
    model = PathModel(problem, "home", paths_per_user=10_000)
    for seed in range(3):
        hosts = plan(problem, "random", seed=seed).hosts
        assert model.expected_latency(hosts) == pytest.approx(expected_latency(problem, hosts), rel=1e-12)


def test_one_way_fallback_rebuilds_the_round_trips():
    problem = synthetic_problem(num_servers=3, num_users=6, with_cloud=True, seed=3)
    x = one_way_s(replace(problem, xfer_s=None))
    home = problem.user_home
    np.testing.assert_allclose((x + x.T)[home], problem.comm_s)
    assert np.isfinite(x).all() and (np.diag(x) == 0).all()


def _brute_force(problem, model, fill):
    """Best hosts over every way to fill the nodes (1 MB experts, so subsets of at most `slots` items)."""
    L, E = problem.expert_bytes.shape
    slots = [int(problem.capacity_bytes[n] // 1_000_000) for n in fill]
    items = list(range(L * E))
    choices = [[c for k in range(s + 1) for c in itertools.combinations(items, k)] for s in slots]
    best = (np.inf, None)
    no_cloud = not problem.is_cloud.any()
    for combo in itertools.product(*choices):
        hosts = empty_hosts(problem)
        for n, chosen in zip(fill, combo, strict=True):
            hosts[n].ravel()[list(chosen)] = True
        if no_cloud and not hosts[fill].any(axis=0).all():
            continue
        value = model.expected_latency(hosts)
        if value < best[0]:
            best = (value, hosts)
    return best


@pytest.mark.parametrize("mode", ["migrate", "home"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_reaches_the_brute_force_optimum(mode, seed):
    """2 servers x 2 slots, 2 layers x 3 experts (K=2), a cloud: within 5% of the best of all 484 placements."""
    problem = synthetic_problem(num_servers=2, num_users=3, num_layers=2, num_experts=3, slots_per_server=2,
                                num_tokens=200, seed=seed)
    placement = plan_ordermoe(problem, mode=mode, budget=0.0, paths_per_user=10_000)
    model = PathModel(problem, mode, paths_per_user=10_000)
    optimum, _ = _brute_force(problem, model, [0, 1])
    got = model.expected_latency(placement.hosts)
    assert got <= 1.05 * optimum
    assert placement.params["expected_latency_ms"] == pytest.approx(1e3 * got)


@pytest.mark.parametrize("seed", [0, 1])
def test_search_within_5_percent_of_the_ilp_in_home_mode(seed):
    """No cloud, home mode: the exact ILP's optimum of SlimCaching's objective is the runtime's optimum too."""
    problem = synthetic_problem(num_servers=3, num_users=4, num_layers=2, num_experts=4, slots_per_server=4,
                                with_cloud=False, num_tokens=300, seed=seed)
    ilp = plan(problem, "exact", time_limit=60.0)
    ours = plan_ordermoe(problem, mode="home", budget=0.0, paths_per_user=10_000)
    assert expected_latency(problem, ours.hosts) <= 1.05 * expected_latency(problem, ilp.hosts)
    assert ours.replicas().min() >= 1  # coverage without a cloud


def test_location_problem_weights_where_tokens_sit():
    problem = synthetic_problem(num_servers=3, num_users=4, num_layers=3, num_experts=6, slots_per_server=5, seed=1)
    model = PathModel(problem, "migrate", 50)
    hosts = plan(problem, "lfu").hosts
    pseudo = location_problem(problem, model, hosts)
    assert pseudo.user_weight.sum() == pytest.approx(1.0)
    rep = model.replay(hosts)
    at = {n: float(model.weight @ (rep.location[:, :-1] == n).mean(axis=1)) for n in range(problem.num_nodes)}
    for n, share in at.items():
        assert pseudo.user_weight[pseudo.user_home == n].sum() == pytest.approx(share)


def test_search_is_deterministic_fits_and_records_its_facts():
    problem = synthetic_problem(num_servers=4, num_users=6, num_layers=3, num_experts=8, slots_per_server=6, seed=7)
    a = plan_ordermoe(problem, mode="migrate")
    b = plan_ordermoe(problem, mode="migrate")
    np.testing.assert_array_equal(a.hosts, b.hosts)
    a.check_capacity()
    p = a.params
    assert p["mode"] == "migrate" and p["algorithm"] == "search" and p["budget"] == 0.05
    assert p["expected_latency_ms"] <= p["greedy_latency_ms"] + 1e-9 <= p["empty_latency_ms"]
    assert p["evaluations"] <= p["max_evals"] + 8
    # the objective weighs the policy's rows and the exact rows; the policy is never slower in the model
    assert p["substitutes"] == "sub,drop,zero" and p["quality_power"] == 2.0 and p["exact_share"] == 0.25
    assert p["expected_policy_ms"] <= p["expected_exact_ms"]
    assert p["expected_latency_ms"] == pytest.approx(0.75 * p["expected_policy_ms"] + 0.25 * p["expected_exact_ms"])


def test_bad_params_are_named():
    problem = synthetic_problem(num_servers=2, num_users=2, num_layers=2, num_experts=4, seed=0)
    with pytest.raises(EdgeMoEError, match="mode"):
        plan_ordermoe(problem, mode="teleport")
    with pytest.raises(EdgeMoEError, match="algorithm"):
        plan_ordermoe(problem, algorithm="magic")
    with pytest.raises(EdgeMoEError, match="init"):
        plan_ordermoe(problem, init="random")
    with pytest.raises(EdgeMoEError, match="budget"):
        plan_ordermoe(problem, budget=-1.0)
    with pytest.raises(EdgeMoEError, match="substitutes"):
        plan_ordermoe(problem, substitutes="sub,teleport")
    with pytest.raises(EdgeMoEError, match="exact_share"):
        plan_ordermoe(problem, exact_share=1.5)


@pytest.mark.parametrize("init", ["successive", "greedy"])
def test_both_starts_cover_every_expert_without_a_cloud(init):
    problem = synthetic_problem(num_servers=3, num_users=4, num_layers=3, num_experts=6, slots_per_server=8,
                                with_cloud=False, num_tokens=300, seed=3)
    placement = plan_ordermoe(problem, mode="migrate", init=init, max_evals=400)
    placement.check_capacity()
    assert placement.replicas().min() >= 1
    assert placement.params["expected_latency_ms"] <= placement.params["empty_latency_ms"]


@pytest.mark.parametrize("cluster", ["device-edge-cloud", "generated"])
@pytest.mark.parametrize("budget", [0.0, 0.2])
def test_deltas_over_the_rows_a_change_reaches_equal_full_replays(cluster, budget):
    """`delta(before=...)` and the batched deltas replay only the rows a change can reach (`affected`);
    they must still equal full replays, adds and removals, servers and devices alike."""
    from edgemoe.cluster.presets import generate
    from edgemoe.plan import plan_problem
    from edgemoe.profile import synthetic_profile

    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=400, seed=4)
    spec = generate(10, 20, seed=1) if cluster == "generated" else cluster
    problem = plan_problem(profile, spec, domain_fallback=True)
    groups = groups_for(profile)
    rng = np.random.default_rng(0)
    for mode in ("migrate", "home"):
        model = PathModel(problem, mode, 24, budget, groups.substitute_ids)
        hosts = plan(problem, "random", seed=2).hosts.copy()
        state = model.replay(hosts)
        base = model.expected_latency(hosts)
        fillable = np.flatnonzero(~problem.is_cloud)
        for _ in range(6):
            layer, e = int(rng.integers(3)), int(rng.integers(8))
            for value in (True, False):
                batch = model.delta_batch(state, hosts, layer, [e], fillable, value)
                for i, n in enumerate(fillable):
                    before = hosts[:, layer].copy()
                    hosts[n, layer, e] = value
                    single, _ = model.delta(state, hosts, layer, [e], before=before)
                    full = model.expected_latency(hosts) - base
                    hosts[:, layer] = before
                    assert single == pytest.approx(full, abs=1e-12)
                    assert batch[i] == pytest.approx(full, abs=1e-12)
        # an exchange of two nodes' layers (several experts at two nodes), committed
        a, b = fillable[:2]
        before = hosts[:, 1].copy()
        hosts[a, 1], hosts[b, 1] = before[b], before[a]
        d, patch = model.delta(state, hosts, 1, np.flatnonzero(before[a] != before[b]), before=before)
        assert d == pytest.approx(model.expected_latency(hosts) - base, abs=1e-12)
        model.commit(state, patch)
        fresh = model.replay(hosts)
        np.testing.assert_array_equal(state.location, fresh.location)
        np.testing.assert_allclose(state.latency_s, fresh.latency_s, rtol=0, atol=1e-15)


def test_users_with_one_home_and_domain_share_rows_and_max_rows_caps_them():
    from edgemoe.cluster.presets import generate
    from edgemoe.plan import plan_problem
    from edgemoe.plan.ordermoe.runtime_model import MIN_PATHS, sample_rows
    from edgemoe.profile import synthetic_profile

    profile = synthetic_profile(num_layers=2, num_experts=4, top_k=2, num_tokens=3000, num_domains=2, seed=0)
    problem = plan_problem(profile, generate(8, 32, seed=0), domain_fallback=True)
    users, tokens, weight = sample_rows(problem, 64)
    assert weight.sum() == pytest.approx(1.0)
    groups = {(int(problem.user_home[u]), int(problem.user_domain[u])) for u in range(len(problem.user_home))}
    assert len(np.unique(users)) == len(groups) < len(problem.user_home)
    capped = sample_rows(problem, 64, max_rows=len(groups) * 20)
    assert capped[0].size == len(groups) * 20 and capped[2].sum() == pytest.approx(1.0)
    assert sample_rows(problem, 64, max_rows=1)[0].size == len(groups) * MIN_PATHS


def test_planner_work_grows_at_most_linearly_with_servers():
    """Evaluations (the search's work counter, never seconds) per server do not grow with the cluster on small
    generated clusters, and the replayed rows stay within max_rows."""
    from edgemoe.cluster.presets import generate
    from edgemoe.plan import plan_problem
    from edgemoe.profile import synthetic_profile

    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=600, seed=0)
    per_server = {}
    for servers in (4, 8, 16):
        problem = plan_problem(profile, generate(servers, 2 * servers, seed=0), domain_fallback=True)
        p = plan_ordermoe(problem, mode="migrate", max_rows=512).params
        assert p["rows"] <= 512 and p["evaluations"] <= p["max_evals"] + 8
        per_server[servers] = p["evaluations"] / servers
    assert per_server[16] <= 2.0 * per_server[4]
    assert per_server[8] <= 2.0 * per_server[4]


def test_exact_share_replays_each_path_with_and_without_budget():
    """exact_share s: the rows with budget replay exactly what a model with no exact share replays, the rows
    without what a budget-0 model replays, and the objective weighs them 1 - s and s."""
    from edgemoe.plan import plan_problem
    from edgemoe.profile import synthetic_profile

    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=400, seed=4)
    problem = plan_problem(profile, "device-edge-cloud", domain_fallback=True)
    subs = groups_for(profile).substitute_ids
    hosts = plan(problem, "lfu").hosts
    both = PathModel(problem, "home", 24, 0.05, subs, exact_share=0.25)
    policy = PathModel(problem, "home", 24, 0.05, subs).expected_latency(hosts)
    exact = PathModel(problem, "home", 24, 0.0).expected_latency(hosts)
    assert policy < exact and both.dense_token_s > 0
    assert both.expected_parts(both.replay(hosts)) == pytest.approx((policy, exact), rel=1e-12)
    assert both.expected_latency(hosts) == pytest.approx(0.75 * policy + 0.25 * exact, rel=1e-12)
    capped = PathModel(problem, "home", 100, 0.05, subs, max_rows=1000, exact_share=0.25).num_rows
    assert capped <= 1000 and capped == 2 * PathModel(problem, "home", 100, 0.05, subs, max_rows=500).num_rows
    with pytest.raises(EdgeMoEError, match="exact_share"):
        PathModel(problem, "home", 24, 0.05, subs, exact_share=1.5)


def test_the_dense_part_is_the_runtimes():
    """plan_problem prices one layer's dense work per node as the runtime's default context charges it, and the
    model adds L of them on each row's home."""
    from edgemoe.plan import plan_problem
    from edgemoe.profile import synthetic_profile
    from edgemoe.runtime import make_context

    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=400, seed=4)
    problem = plan_problem(profile, "device-edge-cloud", domain_fallback=True)
    placement = plan(problem, "lfu")
    ctx = make_context(profile, "device-edge-cloud", placement, mode="home", domain_fallback=True)
    np.testing.assert_allclose(problem.dense_s, ctx.dense_s(np.arange(problem.num_nodes)), rtol=1e-12)
    model = PathModel(problem, "home", 24)
    assert model.dense_token_s == pytest.approx(float(model.weight @ (3 * problem.dense_s[model.home])))
    assert model.expected_latency(placement.hosts) == pytest.approx(
        float(model.weight @ model.replay(placement.hosts).latency_s.sum(axis=1)) + model.dense_token_s)
