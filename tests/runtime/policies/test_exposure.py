"""The exposure's compressed rows (`edgemoe.runtime.policies.exposure`): they hold exactly the dense tables'
nonzero entries, and the wait they price is the dense left-to-right sum bit for bit, for one-home and per-home
layers alike."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.runtime.policies.exposure import Exposure, ExposureLayer


def random_dense(rng, homes, n, c, density):
    """[homes, N, C, N] nonnegative with about `density` of the entries nonzero (rows left empty included)."""
    x = rng.random((homes, n, c, n)) * (rng.random((homes, n, c, n)) < density)
    return x * rng.integers(1, 4, size=x.shape)


@pytest.mark.parametrize("seed", range(6))
def test_rows_round_trip_and_price_waits_as_the_dense_sum(seed):
    rng = np.random.default_rng(seed)
    L, n, c, nh = 4, int(rng.integers(1, 7)), int(rng.integers(1, 5)), int(rng.integers(2, 4))
    dense = {layer: random_dense(rng, nh if layer >= 3 else 1, n, c, float(rng.choice([0.0, 0.2, 0.9])))
             for layer in range(1, L)}
    expo = Exposure({layer: ExposureLayer.from_dense(d, n, c) for layer, d in dense.items()}, L, n, c)
    full = expo.dense()
    assert full.shape == (L + 1, nh, n, c, n) and not full[0].any() and not full[L].any()
    for layer, d in dense.items():
        np.testing.assert_array_equal(full[layer], np.broadcast_to(d, (nh, n, c, n)))  # one-home rows in every home
    assert len(expo.val) == sum(int(np.count_nonzero(d)) for d in dense.values())  # only the nonzero entries
    T, G = 40, 3
    layer = rng.integers(0, L + 1, T)
    home_row, key = rng.integers(0, nh, T), rng.integers(0, c, T)
    nodes = rng.integers(0, n, (T, G))
    load = rng.exponential(0.01, n) * (rng.random(n) < 0.7)
    got = expo.wait(layer, home_row, nodes, key, load)
    for t in range(T):
        for g in range(G):
            row = full[layer[t], home_row[t], nodes[t, g], key[t]]
            s = row[0] * load[0]  # the dense sum, left to right
            for j in range(1, n):
                s += row[j] * load[j]
            assert got[t, g] == s  # the same bits
