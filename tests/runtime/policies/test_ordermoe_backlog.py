"""The queue-aware look-ahead (`backlog`): the exposure tables' invariants, a known answer (a busy node that the
static tables herd tokens to is avoided), no change at all without queues, the "mean" waits' EWMA, and a
clear error for an unknown kind."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.runtime import make_policy

from ..conftest import tiny_cluster, tiny_context, tiny_profile
from .test_ordermoe_equivalence import FIELDS, assert_same, context, decisions


def herding_setup():
    """Token at a. Layer 0 routes expert 0, held by b and c; layer 1 routes expert 1, held by c and d. The
    static tables prefer meeting at c (layer 1 is local there)."""
    profile = tiny_profile([[0], [1]], num_experts=2)
    ctx = tiny_context(profile, tiny_cluster(("a", "b", "c", "d")),
                       {"a": [(0, 1), (1, 0)], "b": [(0, 0)], "c": [(0, 0), (1, 1)], "d": [(1, 1)]}, mode="migrate")
    return profile, ctx


def test_a_busy_node_is_no_longer_a_meeting_point():
    profile, ctx = herding_setup()
    users, topk, gates = np.array([0]), profile.topk[:1, 0].astype(np.int64), profile.gates[:1, 0]
    busy = np.array([0.0, 0.0, 0.5, 0.0])  # c's queue: half a second, far above a link (11 ms) or a call
    picks = {}
    for backlog in (False, True):
        pol = make_policy("ordermoe", ctx, budget=0.0, horizon=1, backlog="now" if backlog else "off",
                          home_trip=False)  # the static tables the exposure goes with
        for load in (None, busy):
            state = pol.start(users)
            picks[backlog, load is None] = int(pol.decide(0, topk, gates, state, load).next_location[0])
    c, d = 2, 3
    assert picks[False, True] == c and picks[True, True] == c  # no queue: both tables meet where layer 1 is local
    assert picks[False, False] == c  # the static tables herd the token to the busy node
    assert picks[True, False] == d  # with the backlog the other holder of layer 1's expert wins


@pytest.mark.parametrize("horizon", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_exposure_counts_the_layers_ahead(horizon, seed):
    """Without drops or zeros every layer runs some output: each exposure row sums to the number of layers
    the table looks ahead over, min(H, L - l), and is >= 0; with H = 0 or without backlog there is none."""
    _, ctx = context(seed, "migrate")
    pol = make_policy("ordermoe", ctx, budget=0.05, horizon=horizon, backlog="now", substitutes="sub")
    la = pol.lookahead
    L = ctx.num_layers
    assert la.home_trip  # (migrate mode: one exposure per home, as the tables)
    assert la.exposure.shape == (L + 1, len(la.homes), ctx.num_nodes, la.keys.size, ctx.num_nodes)
    assert (la.exposure >= 0).all()
    for layer in range(1, L):
        np.testing.assert_allclose(la.exposure[layer].sum(axis=3), min(horizon, L - layer), rtol=1e-12)
        if layer + horizon < L:  # a window that ends before the last layer: every home's exposure is the same
            assert (la.exposure[layer] == la.exposure[layer, :1]).all()
    off = make_policy("ordermoe", ctx, budget=0.05, horizon=horizon, backlog="now", substitutes="sub", home_trip=False)
    assert off.lookahead.exposure.shape == (L + 1, 1, ctx.num_nodes, la.keys.size, ctx.num_nodes)
    assert not la.exposure[0].any() and not la.exposure[L].any()
    assert make_policy("ordermoe", ctx, horizon=0, backlog="mean").backlog == "off"
    assert make_policy("ordermoe", ctx, horizon=horizon).backlog == "mean"  # the default
    assert make_policy("ordermoe", ctx, horizon=horizon, backlog="off").backlog == "off"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["migrate", "home"])
def test_without_queues_the_backlog_changes_nothing(seed, mode):
    """Zero waits: the term adds exactly 0.0, so every decision equals the static tables' bit for bit."""
    profile, ctx = context(seed, mode)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, profile.num_tokens, 20)
    users = rng.integers(0, ctx.num_users, 20)
    for steer in (None, False):
        for home_trip in (False, None):  # (None: the default, the trip home charged in migrate mode)
            runs = [decisions(make_policy("ordermoe", ctx, budget=0.1, horizon=2, steer=steer, backlog=b,
                                          home_trip=home_trip), profile, ctx,
                              rows, users, None) for b in ("now", "mean", "off")]
            assert_same(runs[0], runs[2])
            assert_same(runs[1], runs[2])
    assert FIELDS  # (the compared fields)


def test_the_backlog_moves_decisions_under_load():
    """Guards the equivalence tests (they compare paths with the term on): under load both kinds change picks."""
    changed = [0, 0]
    for seed in range(6):
        profile, ctx = context(seed, "migrate")
        rng = np.random.default_rng(seed)
        rows = rng.integers(0, profile.num_tokens, 30)
        users = rng.integers(0, ctx.num_users, 30)
        load = rng.exponential(0.05, ctx.num_nodes)
        a, b, c = (decisions(make_policy("ordermoe", ctx, budget=0.1, horizon=2, backlog=x, home_trip=False), profile,
                             ctx, rows, users,
                             load) for x in ("now", "mean", "off"))
        for x in (a, b):
            changed[x is b] += sum(int((dx["next_location"] != dc["next_location"]).sum()) for dx, dc in zip(x, c, strict=True))
    assert min(changed) > 0


def test_mean_waits_are_the_ewma_of_the_loads_seen_and_unknown_kinds_are_errors():
    from edgemoe.errors import EdgeMoEError

    profile, ctx = herding_setup()
    pol = make_policy("ordermoe", ctx, budget=0.0, horizon=1, backlog="mean", ewma=0.5)
    users, topk, gates = np.array([0]), profile.topk[:1, 0].astype(np.int64), profile.gates[:1, 0]
    for load in ([0.0, 0.0, 0.4, 0.0], [0.0, 0.0, 0.0, 0.2]):
        pol.decide(0, topk, gates, pol.start(users), np.array(load))
    np.testing.assert_allclose(pol.node_wait, [0.0, 0.0, 0.1, 0.1])  # 0.4 halved twice; 0.2 halved once
    with pytest.raises(EdgeMoEError, match="backlog must be one of"):
        make_policy("ordermoe", ctx, backlog="later")


def test_mean_waits_step_once_per_row_whatever_the_grouping():
    """Two rows decided in one call move the EWMA as two one-row calls do (0.4 halved twice: 0.3 at node 2), and
    each row prices the EWMA after its own step, so grouping rows into calls changes no wait."""
    profile, ctx = herding_setup()
    users, load = np.array([0, 0]), np.array([0.0, 0.0, 0.4, 0.0])  # two rows of the one user
    topk, gates = np.repeat(profile.topk[:1, 0].astype(np.int64), 2, axis=0), np.repeat(profile.gates[:1, 0], 2, axis=0)
    one = make_policy("ordermoe", ctx, budget=0.0, horizon=1, backlog="mean", ewma=0.5)
    keep, dev = one.mean_waits(load, 2)
    np.testing.assert_allclose(keep, [0.5, 0.25])
    np.testing.assert_allclose(load + keep[:, None] * dev, [[0.0, 0.0, 0.2, 0.0], [0.0, 0.0, 0.3, 0.0]])
    np.testing.assert_allclose(one.node_wait, [0.0, 0.0, 0.3, 0.0])
    grouped = make_policy("ordermoe", ctx, budget=0.0, horizon=1, backlog="mean", ewma=0.5)
    grouped.decide(0, topk, gates, grouped.start(users), load)
    single = make_policy("ordermoe", ctx, budget=0.0, horizon=1, backlog="mean", ewma=0.5)
    for i in range(2):
        single.decide(0, topk[i:i + 1], gates[i:i + 1], single.start(users[i:i + 1]), load)
    np.testing.assert_allclose(grouped.node_wait, single.node_wait, rtol=1e-15)
    np.testing.assert_allclose(grouped.node_wait, [0.0, 0.0, 0.3, 0.0])
    assert one.mean_waits(load, 0) is None and make_policy("ordermoe", ctx, horizon=1, backlog="now").mean_waits(load, 2) is None


def test_exposure_rows_too_large_are_a_clear_error(monkeypatch):
    """Above EXPOSURE_MAX_BYTES the policy names the rows' size and shape and the ways out instead of keeping
    them; with home_trip=False (one exposure row for every home) the same context fits."""
    from edgemoe.errors import EdgeMoEError
    from edgemoe.runtime.policies import ordermoe as om

    _, ctx = context(0, "migrate")
    one_home = make_policy("ordermoe", ctx, horizon=2, backlog="now", home_trip=False).lookahead.expo.nbytes
    per_home = make_policy("ordermoe", ctx, horizon=2, backlog="now").lookahead.expo.nbytes
    assert per_home > one_home > 0
    monkeypatch.setattr(om, "EXPOSURE_MAX_BYTES", one_home)  # one row fits, one per home does not
    om._LOOKAHEADS.clear()
    with pytest.raises(EdgeMoEError, match=r"exposure rows take .* GiB .*homes up to .*home_trip=False"):
        make_policy("ordermoe", ctx, horizon=2, backlog="mean")
    assert make_policy("ordermoe", ctx, horizon=2, backlog="mean", home_trip=False).backlog == "mean"
    with pytest.raises(EdgeMoEError, match=r"exposure rows take .*use backlog='off'"):  # the default is "mean"
        make_policy("ordermoe", ctx, horizon=2)
    assert make_policy("ordermoe", ctx, horizon=2, backlog="off").backlog == "off"  # no queue term: no exposure, no limit


@pytest.mark.parametrize("budget", [0.0, 0.05])  # no budget (exactly `exact`, the early return) and the full decision
def test_queue_pressure_steps_once_per_row_whatever_the_grouping(budget):
    """The adaptive weights' queue pressure takes one EWMA step per row toward mean wait / (mean wait + median
    round trip), as `mean`'s waits do: two rows in one call leave it where two one-row calls do, (1 - 0.5^2) x that
    share from 0, and each row prices it after its own step."""
    profile, ctx = herding_setup()
    users, load = np.array([0, 0]), np.array([0.0, 0.0, 0.4, 0.0])
    topk, gates = np.repeat(profile.topk[:1, 0].astype(np.int64), 2, axis=0), np.repeat(profile.gates[:1, 0], 2, axis=0)
    one = make_policy("ordermoe", ctx, budget=budget, horizon=1, ewma=0.5)
    share = 0.1 / (0.1 + one.rt_med)  # the mean wait is 0.1 s
    np.testing.assert_allclose(one.pressures(load, 2), [0.5 * share, 0.75 * share])
    assert one.queue_pressure == pytest.approx(0.75 * share) and one.pressures(load, 0).size == 0
    grouped = make_policy("ordermoe", ctx, budget=budget, horizon=1, ewma=0.5)
    grouped.decide(0, topk, gates, grouped.start(users), load)
    single = make_policy("ordermoe", ctx, budget=budget, horizon=1, ewma=0.5)
    for i in range(2):
        single.decide(0, topk[i:i + 1], gates[i:i + 1], single.start(users[i:i + 1]), load)
    assert grouped.queue_pressure == single.queue_pressure == pytest.approx(0.75 * share, rel=1e-15)
