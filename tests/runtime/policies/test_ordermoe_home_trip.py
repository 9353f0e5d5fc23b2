"""OrderMoE's look-ahead with the trip to the token's real home (`home_trip`): a window that reaches the last
layer charges the trip from its last meeting node to the token's home, not to the node it is at there.
Brute force (two layers, one routing: the tables are then exact, so the steered path is the oracle's), the
tables' known answers, and where the default policy has it on (migrate mode, compiled paths included)."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.runtime import make_policy
from edgemoe.runtime.local import replay_decisions

from ..conftest import CALL, XFER, tiny_cluster, tiny_context, tiny_profile


def random_setting(seed: int, homes=("a",), mode: str = "migrate"):
    """3-4 edge nodes with links of 5, 10 or 30 ms, two layers of fixed routing (1-2 of 4 experts) and every
    expert of a layer on 1-2 random nodes; migrate mode unless told."""
    rng = np.random.default_rng(seed)
    N, E, K = int(rng.integers(3, 5)), 4, int(rng.integers(1, 3))
    routes = np.array([rng.choice(E, K, replace=False) for _ in range(2)])
    names = tuple("abcd"[:N])
    latency = {(names[i], names[j]): float(rng.choice([0.005, 0.01, 0.03])) for i in range(N) for j in range(i + 1, N)}
    held = {n: [] for n in names}
    for layer in range(2):
        for e in range(E):
            for n in rng.choice(names, int(rng.integers(1, 3)), replace=False):
                held[n].append((layer, e))
    profile = tiny_profile(routes, num_experts=E)
    return profile, tiny_context(profile, tiny_cluster(names, homes=homes, latency=latency), held, mode=mode)


def path_s(ctx, profile, **kw) -> float:
    users, topk, gates = np.array([0]), profile.topk[:1].astype(np.int64), profile.gates[:1]
    return float(replay_decisions(make_policy("ordermoe", ctx, budget=0.0, **kw), users, topk, gates).token_latency_s[0])


def test_two_layer_steered_path_is_the_oracles_with_the_home_trip():
    """Two layers, every calibration token routed alike, budget 0, H = 1: the tables hold the last layer's exact
    cost (the trip home included) from every node, so the steered path is optimal; without the home trip the
    tables price ending away from home as free and some paths are longer."""
    longer = 0
    for seed in range(40):
        profile, ctx = random_setting(seed)
        users, topk, gates = np.array([0]), profile.topk[:1].astype(np.int64), profile.gates[:1]
        oracle = replay_decisions(make_policy("oracle", ctx, budget=0.0, routing=(topk, gates)), users, topk, gates)
        best = float(oracle.token_latency_s[0])
        assert path_s(ctx, profile, horizon=1, home_trip=True) == pytest.approx(best, abs=1e-12), seed
        longer += path_s(ctx, profile, horizon=1, home_trip=False) > best + 1e-12
    assert longer > 0  # the case exists: the brute force above tells the two tables apart


def test_home_tables_known_answers():
    """Three layers routing experts 0, 1, 1; layers 1 and 2 run expert 1 only on c; every link XFER; users at a
    and b. With H = 1 the last layer's table from c is a call and the trip home, from a or b a trip there too;
    without the home trip, ending at c looks free. Where the home is the token's node, and for a window that
    ends before the last layer, the tables are the home-free ones (same bits)."""
    profile = tiny_profile([[0], [1], [1]], num_experts=2)
    ctx = tiny_context(profile, tiny_cluster(("a", "b", "c"), homes=("a", "b")),
                       {"a": [(0, 1), (1, 0), (2, 0)], "b": [(0, 0)], "c": [(0, 0), (1, 1), (2, 1)]}, mode="migrate")
    free = make_policy("ordermoe", ctx, budget=0.0, horizon=1, home_trip=False).lookahead
    home = make_policy("ordermoe", ctx, budget=0.0, horizon=1, home_trip=True).lookahead
    assert home.homes.tolist() == [0, 1]
    # only the last layer's window (H = 1) depends on the home: one per-home layer is kept, not L + 1
    assert home.home.shape[:3] == (1, 2, 3) and home.home_slot.tolist() == [-1, -1, 0, -1]
    np.testing.assert_allclose(free.stacked[2], np.array([2 * XFER + CALL, 2 * XFER + CALL, CALL])[:, None, None]
                               * np.ones(free.stacked.shape[2:]), rtol=1e-12)
    for i, h in enumerate(home.homes):
        expect = np.array([2 * XFER + CALL, 2 * XFER + CALL, XFER + CALL])  # from a, b, c to home a or b
        np.testing.assert_allclose(home.home_table(2)[i], expect[:, None, None] * np.ones(home.home.shape[3:]),
                                   rtol=1e-12)
        np.testing.assert_array_equal(home.home_table(2)[i, h], free.stacked[2, h])
        np.testing.assert_array_equal(home.home_table(1)[i], free.stacked[1])  # window of layer 1 only
    assert not home.home_table(0).any() and not home.home_table(3).any()
    np.testing.assert_array_equal(home.stacked[:2], free.stacked[:2])


def test_default_policy_charges_the_trip_home_in_migrate_mode_on_its_compiled_paths():
    profile, ctx = random_setting(41)
    default = make_policy("ordermoe", ctx, budget=0.05, horizon=2)
    assert ctx.mode == "migrate" and default.lookahead.home_trip and "home_trip" not in default.params
    assert default.compiled_rule() == "ordermoe" and default.decode_path() is not None  # they read the home axis
    off = make_policy("ordermoe", ctx, budget=0.05, horizon=2, home_trip=False)
    assert not off.lookahead.home_trip and off.params["home_trip"] is False and off.compiled_rule() == "ordermoe"
    assert make_policy("ordermoe", ctx, horizon=2, backlog="now").lookahead.home_trip  # the exposure has a home axis
    _, home_ctx = random_setting(41, mode="home")
    assert not make_policy("ordermoe", home_ctx, horizon=2).lookahead.home_trip  # a token never leaves home there
    token = make_policy("ordermoe", ctx, budget=0.05, horizon=2, stand_in_choice="token")
    assert token.lookahead.home_trip  # on by default with per-token stand-ins
    assert not make_policy("ordermoe", ctx, horizon=2, stand_in_choice="token", home_trip=False).lookahead.home_trip
    assert not make_policy("ordermoe", ctx, horizon=0, stand_in_choice="token").lookahead.home_trip  # no tables


@pytest.mark.parametrize("horizon", [1, 2, 3, 50])
def test_only_the_home_dependent_layers_are_kept_per_home(horizon):
    """The per-home part of the tables holds the last min(H, L - 1) layers, the others are read from `stacked`;
    `home_table` gives each layer's per-home view, every table is a view of `flat` (no second copy), and
    `flat_index` finds the same cells through either part."""
    profile, ctx = random_setting(7, homes=("a", "b"))
    la = make_policy("ordermoe", ctx, budget=0.05, horizon=horizon).lookahead
    L, N = ctx.num_layers, ctx.num_nodes
    D = min(horizon, L - 1)
    _, _, C, m = la.stacked.shape
    assert la.home_trip and la.home.shape == (D, len(la.homes), N, C, m)
    assert la.home_slot.tolist() == [-1] * (L - D) + list(range(D)) + [-1]
    assert la.flat.size == ((L + 1) + D * len(la.homes)) * N * C * m
    for layer, table in la.tables.items():
        assert np.shares_memory(table, la.flat)
        per_home = la.home_table(layer)
        assert per_home.shape == (len(la.homes), N, C, m)
        np.testing.assert_array_equal(per_home, table if table.ndim == 4 else np.broadcast_to(table, per_home.shape))
        np.testing.assert_array_equal(la.stacked[layer], per_home[0])  # `stacked`: the first home's
    key = np.zeros(len(la.homes), np.int64)
    for layer in range(L):
        flat, base, stride = la.flat_index(np.full(len(la.homes), layer), la.homes, key)
        for i in range(len(la.homes)):
            cells = flat[base[i] + np.arange(N)[:, None] * stride + np.arange(m)[None, :]]  # [N, m] of key 0
            np.testing.assert_array_equal(cells, la.home_table(layer + 1)[i, :, 0] if layer + 1 < L
                                          else np.zeros((N, m)))


def test_tables_above_their_limit_are_refused_before_they_are_built(monkeypatch):
    """Above TABLE_MAX_BYTES the policy names the tables' shape and the ways out; a `levels` of a hundred
    million is refused, where numpy's MemoryError (or the OOM killer) used to end the process."""
    import edgemoe.runtime.policies.ordermoe as om
    from edgemoe.errors import EdgeMoEError

    _, ctx = random_setting(7, homes=("a", "b"))
    with pytest.raises(EdgeMoEError, match=r"look-ahead tables would take .*levels=100000000.*fewer budget levels"):
        make_policy("ordermoe", ctx, budget=0.05, horizon=2, levels=10**8)
    la = make_policy("ordermoe", ctx, budget=0.05, horizon=2).lookahead
    monkeypatch.setattr(om, "TABLE_MAX_BYTES", la.flat.nbytes - 1)
    om._LOOKAHEADS.clear()
    with pytest.raises(EdgeMoEError, match=r"per home for 2 homes \(home_trip\).*home_trip=False"):
        make_policy("ordermoe", ctx, budget=0.05, horizon=2)
    assert make_policy("ordermoe", ctx, budget=0.05, horizon=2, home_trip=False).lookahead.flat.nbytes < la.flat.nbytes
