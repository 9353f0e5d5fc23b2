"""The restructured ordermoe hot path decides exactly as before: every Decision field of `ordermoe` (H = 0..3,
each stand-in kind set, both modes, enumerated and prefix action sets, with and without load) and of the
`oracle` equals, bit for bit, that of the pre-optimisation decision kept in `_ordermoe_reference` (which
looks the tables up unpaced, so `ordermoe` runs with pace=False here; pacing has its own tests)."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.cluster import generate
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy

from ._ordermoe_reference import ReferenceOracle, ReferenceOrderMoE

FIELDS = ("experts", "node", "location", "next_location", "quality_cost", "latency_s", "zero_mask")
CONTEXTS: dict = {}


def context(seed: int, mode: str):
    """A small random deployment: 1-6 routed experts of 4 or 8, 2-19 servers (all-node steering up to 16,
    replica steering beyond), internet or device-edge-cloud, three planners."""
    if (seed, mode) not in CONTEXTS:
        rng = np.random.default_rng(seed)
        E = int(rng.choice([4, 8]))
        profile = synthetic_profile(num_layers=int(rng.integers(2, 5)), num_experts=E, top_k=int(rng.integers(1, min(E, 6) + 1)),
                                    num_tokens=200, seed=seed)
        cluster = generate(int(rng.integers(2, 20)), int(rng.integers(2, 8)), seed=seed,
                           topology=("internet", "device-edge-cloud")[seed % 2])
        placement = plan(plan_problem(profile, cluster, domain_fallback=True), ("uniform", "random", "ordermoe")[seed % 3])
        CONTEXTS[seed, mode] = profile, make_context(profile, cluster, placement, mode=mode, domain_fallback=True)
    return CONTEXTS[seed, mode]


def decisions(pol, profile, ctx, rows, users, load):
    state = pol.start(users, tokens=rows)
    out = []
    for layer in range(ctx.num_layers):
        dec = pol.decide(layer, profile.topk[rows, layer].astype(np.int64), profile.gates[rows, layer], state, load)
        out.append({f: getattr(dec, f) for f in FIELDS})
    return out


def assert_same(a, b):
    for layer, (da, db) in enumerate(zip(a, b, strict=True)):
        for f in FIELDS:
            np.testing.assert_array_equal(da[f], db[f], err_msg=f"layer {layer}, field {f}")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["migrate", "home"])
@pytest.mark.parametrize("horizon", [0, 1, 2, 3])
def test_ordermoe_decisions_equal_the_reference(seed, mode, horizon):
    profile, ctx = context(seed, mode)
    rng = np.random.default_rng(100 * seed + horizon)
    rows = rng.integers(0, profile.num_tokens, 40)
    users = rng.integers(0, ctx.num_users, 40)
    for kinds in ("sub,drop,zero", "sub", "drop", "zero"):
        budget = float(rng.choice([0.0, 0.01, 0.1, 1.0]))
        load = rng.exponential(0.01, ctx.num_nodes) if rng.integers(2) else None
        params = dict(budget=budget, horizon=horizon, substitutes=kinds, max_enum_k=(4, 2)[seed % 2],
                      quality_power=(2.0, 1.0)[seed % 3 == 2])
        # the reference predates pacing, the trip home and the queue term: unpaced, the tables are looked up at the
        # whole remaining budget, they take the token's home to be its node at the last layer, and no wait is priced
        new = decisions(make_policy("ordermoe", ctx, pace=False, home_trip=False, backlog="off", **params), profile,
                        ctx, rows, users, load)
        ref = decisions(ReferenceOrderMoE(ctx, home_trip=False, backlog="off", **params), profile, ctx, rows, users,
                        load)
        assert_same(new, ref)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", ["migrate", "home"])
def test_oracle_decisions_equal_the_reference(seed, mode):
    profile, ctx = context(seed, mode)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, profile.num_tokens, 30)
    users = rng.integers(0, ctx.num_users, 30)
    load = rng.exponential(0.01, ctx.num_nodes)
    params = dict(budget=0.1, routing=(profile.topk, profile.gates), max_enum_k=(4, 2)[seed % 2])
    assert_same(decisions(make_policy("oracle", ctx, **params), profile, ctx, rows, users, load),
                decisions(ReferenceOracle(ctx, **params), profile, ctx, rows, users, load))
