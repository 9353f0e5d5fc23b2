"""The compiled steered decision (`ordermoe_kernel`) decides exactly as the numpy path it replaces: every
Decision field equal, bit for bit, on small random deployments in both modes, with enumerated (K <= max_enum_k)
and prefix (K > max_enum_k) action sets, H = 0 (steered without look-ahead), 1 and 2, with and without budgets
and load."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.jit import HAVE_NUMBA
from edgemoe.runtime import make_policy
from edgemoe.runtime.policies import ordermoe as om

from .test_ordermoe_equivalence import assert_same, context, decisions


def both_paths(monkeypatch, ctx, profile, rows, users, load, params):
    """(compiled, numpy) decisions of one policy configuration over every layer."""
    out = []
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
                      substitutes=str(rng.choice(["sub,drop,zero", "sub", "drop,zero"])))
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
    rows = np.arange(10)
    decisions(make_policy("ordermoe", ctx, horizon=2, budget=0.1), profile, ctx, rows, rows % ctx.num_users, None)
    assert len(seen) == ctx.num_layers
