"""The compiled steered decision (`ordermoe_kernel`) decides exactly as the numpy path it replaces: every
Decision field equal, bit for bit, on small random deployments in both modes, with enumerated (K <= max_enum_k)
and prefix (K > max_enum_k) action sets, H = 0 (steered without look-ahead), 1 and 2, with and without budgets
and load. So does the whole decision in one compiled call (`DecodePath`, the decode path of `decide`), with
the adaptive weights moving between passes."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.jit import HAVE_NUMBA
from edgemoe.runtime import make_policy
from edgemoe.runtime.policies import ordermoe as om
from edgemoe.runtime.policies import ordermoe_kernel as ok

from .test_ordermoe_equivalence import FIELDS, assert_same, context, decisions


def both_paths(monkeypatch, ctx, profile, rows, users, load, params):
    """(compiled, numpy) decisions of one policy configuration over every layer."""
    out = []
    monkeypatch.setattr(om, "COMPILED_DECODE", False)  # the steered kernel on its own (the decode path: below)
    for compiled in (True, False):
        monkeypatch.setattr(om, "COMPILED_STEER", compiled)
        out.append(decisions(make_policy("ordermoe", ctx, **params), profile, ctx, rows, users, load))
    return out


@pytest.mark.skipif(not HAVE_NUMBA, reason="without numba the numpy path is the only one")
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", ["migrate", "home"])
@pytest.mark.parametrize("horizon", [0, 1, 2])
def test_compiled_steered_decision_equals_numpy(monkeypatch, seed, mode, horizon):
    profile, ctx = context(seed, mode)
    rng = np.random.default_rng(1000 + 10 * seed + horizon)
    rows = rng.integers(0, profile.num_tokens, 33)
    users = rng.integers(0, ctx.num_users, 33)
    for budget in (0.0, 0.01, 0.1, 1.0):
        load = rng.exponential(0.01, ctx.num_nodes) if rng.integers(2) else None
        # max_enum_k below K: prefix actions (K + 1 of them) instead of all 2^K subsets
        params = dict(budget=budget, horizon=horizon, steer=True, max_enum_k=int(rng.choice([1, 2, 4])),
                      substitutes=str(rng.choice(["sub,drop,zero", "sub", "drop,zero"])), backlog=str(rng.choice(["off", "now", "mean"])))
        compiled, reference = both_paths(monkeypatch, ctx, profile, rows, users, load, params)
        assert_same(compiled, reference)


def test_the_steered_decision_takes_the_compiled_path_when_numba_is_there(monkeypatch):
    """Guards the test above: with COMPILED_STEER the steered options come without their [R, M, G] latency."""
    profile, ctx = context(0, "migrate")
    seen = []
    real = om.steered_pick

    def spy(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(om, "steered_pick", spy)
    monkeypatch.setattr(om, "COMPILED_STEER", True)
    monkeypatch.setattr(om, "COMPILED_DECODE", False)  # `choose`'s own path (the decode path skips it)
    rows = np.arange(10)
    decisions(make_policy("ordermoe", ctx, horizon=2, budget=0.1), profile, ctx, rows, rows % ctx.num_users, None)
    assert len(seen) == ctx.num_layers


def spy_on_decode_path(monkeypatch) -> list[bool]:
    """A list that gets, per DecodePath call, whether it decided (returned a Decision) rather than declined."""
    calls = []
    real = ok.DecodePath.__call__

    def spy(self, *args):
        dec = real(self, *args)
        calls.append(dec is not None)
        return dec

    monkeypatch.setattr(ok.DecodePath, "__call__", spy)
    return calls


@pytest.mark.skipif(not HAVE_NUMBA, reason="without numba the numpy path is the only one")
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["migrate", "home"])
def test_the_decode_path_decides_as_the_numpy_path(monkeypatch, seed, mode):
    profile, ctx = context(seed, mode)
    rng = np.random.default_rng(2000 + seed)
    used = spy_on_decode_path(monkeypatch)
    monkeypatch.setattr(om, "COMPILED_STEER", False)  # the reference: numpy all through
    expected = 0  # decide calls the decode path should have made
    for T in (1, 5, 70):  # 70 rows: more than the decode tables start with (64), so they grow
        rows = rng.integers(0, profile.num_tokens, T)
        users = rng.integers(0, ctx.num_users, T)
        params = dict(budget=float(rng.choice([0.0, 0.02, 0.3])), horizon=int(rng.integers(0, 3)),
                      steer=[None, True, False][int(rng.integers(3))], pace=bool(rng.integers(2)),
                      substitutes=str(rng.choice(["sub,drop,zero", "sub", "drop,zero"])), backlog=str(rng.choice(["off", "now", "mean"])))
        loads = [rng.exponential(0.01, ctx.num_nodes) if rng.integers(2) else None for _ in range(2)]
        runs = []
        for decode in (True, False):
            monkeypatch.setattr(om, "COMPILED_DECODE", decode)
            pol = make_policy("ordermoe", ctx, **params)
            if decode and pol.compiled_rule() == "ordermoe":
                expected += len(loads) * ctx.num_layers
            out = []
            for p, load in enumerate(loads):  # two passes; the feedback between them moves the weights
                state = pol.start(users, tokens=rows)
                for layer in range(ctx.num_layers):
                    dec = pol.decide(layer, profile.topk[rows, layer].astype(np.int64), profile.gates[rows, layer],
                                     state, load)
                    out.append({f: getattr(dec, f) for f in FIELDS})
                out.append({f: getattr(state, f) for f in ("location", "budget_used", "layer", "prev_top1")})
                out.append({"pressure": np.array(pol.queue_pressure)})
                pol.observe(users, np.full(T, 0.02 * (p + 1)), np.full(T, 0.015), state.budget_used, state.budget_total)
            runs.append(out)
        for a, b in zip(*runs, strict=True):
            for f in a:
                np.testing.assert_array_equal(a[f], b[f], err_msg=f"T={T} {params} {f}")
    assert len(used) == expected and all(used)  # it ran wherever it applies, and decided every call


@pytest.mark.skipif(not HAVE_NUMBA, reason="without numba the numpy path is the only one")
@pytest.mark.parametrize("top_k,max_enum_k", [(5, 4), (7, 2), (8, 4), (8, 8), (3, 1)])
@pytest.mark.parametrize("mode", ["migrate", "home"])
def test_the_decode_path_decides_as_the_numpy_path_with_prefix_actions(monkeypatch, top_k, max_enum_k, mode):
    """K > max_enum_k (the K + 1 prefixes by decreasing remote latency) and all 2^K subsets up to K = 8: the
    decode path's picks and bits are the numpy path's, with the drop stand-in's 8-slot einsum order."""
    from edgemoe.cluster import generate
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan
    from edgemoe.profile import synthetic_profile
    from edgemoe.runtime import make_context

    profile = synthetic_profile(num_layers=3, num_experts=16, top_k=top_k, num_tokens=200, seed=top_k)
    cluster = generate(10 if top_k % 2 else 20, 6, seed=top_k)  # all-node and replica steering
    ctx = make_context(profile, cluster, plan(plan_problem(profile, cluster, domain_fallback=True), "random"),
                       mode=mode, domain_fallback=True)
    rng = np.random.default_rng(top_k)
    calls = spy_on_decode_path(monkeypatch)
    monkeypatch.setattr(om, "COMPILED_STEER", False)
    for T in (1, 40):
        rows = rng.integers(0, profile.num_tokens, T)
        users = rng.integers(0, ctx.num_users, T)
        for budget, horizon, kinds in ((0.3, 2, "sub,drop,zero"), (2.0, 1, "drop,zero"), (0.05, 0, "sub,drop,zero")):
            params = dict(budget=budget, horizon=horizon, substitutes=kinds, max_enum_k=max_enum_k)
            load = rng.exponential(0.01, ctx.num_nodes)
            runs = []
            for decode in (True, False):
                monkeypatch.setattr(om, "COMPILED_DECODE", decode)
                pol = make_policy("ordermoe", ctx, **params)
                assert pol.compiled_rule() == "ordermoe"
                runs.append(decisions(pol, profile, ctx, rows, users, load))
            assert_same(*runs)
    assert calls and all(calls)
