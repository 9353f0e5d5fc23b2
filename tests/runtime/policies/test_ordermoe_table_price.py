"""OrderMoE's look-ahead tables with the future layers' quality priced (`table_price`): known answers on the
tables themselves (no price: the unpriced tables bit for bit; a price only adds to every entry) and the
decision's view of them (priced budget is worth less, so the policy spends at least as often at layer 0)."""

from __future__ import annotations

import numpy as np

from edgemoe.runtime import make_policy

from .test_ordermoe_equivalence import context


def test_a_zero_price_gives_the_unpriced_tables():
    _, ctx = context(1, "migrate")
    free = make_policy("ordermoe", ctx, budget=0.1, horizon=2, quality_price=0.0).lookahead
    priced = make_policy("ordermoe", ctx, budget=0.1, horizon=2, quality_price=0.0, table_price=True).lookahead
    np.testing.assert_array_equal(priced.stacked, free.stacked)
    np.testing.assert_array_equal(priced.home, free.home)


def test_a_price_only_raises_the_cost_to_go_and_keeps_the_no_budget_level():
    for seed in range(3):
        _, ctx = context(seed, "migrate")
        free = make_policy("ordermoe", ctx, budget=0.1, horizon=2).lookahead
        pol = make_policy("ordermoe", ctx, budget=0.1, horizon=2, table_price=True)
        priced = pol.lookahead
        assert pol.quality_price > 0 and priced is not free and pol.params["table_price"] is True
        assert (priced.home >= free.home - 1e-12).all()
        # with no budget left no action spends, so there is nothing to price
        np.testing.assert_array_equal(priced.home[..., 0], free.home[..., 0])
