"""The exposure's compressed rows (`edgemoe.runtime.policies.exposure`): they hold exactly the dense tables'
nonzero entries, identical rows share one copy of them, and the wait they price is the dense left-to-right sum
bit for bit, for one-home and per-home layers alike."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.runtime.policies import exposure as exposure_module
from edgemoe.runtime.policies.exposure import Exposure, ExposureLayer, shared_rows


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
    assert len(expo.val) <= sum(int(np.count_nonzero(d)) for d in dense.values())  # only the nonzero entries
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


def rows_of(span, node, val):
    """[(nodes, values)] of every row of a (span, node, val) triple."""
    return [(node[a:b].tolist(), val[a:b].tolist()) for a, b in span]


def expected_rows(ptr, node, val):
    """[(nodes, values)] of every row of a (ptr, node, val) triple."""
    return rows_of(np.stack([ptr[:-1], ptr[1:]], axis=1), node, val)


def compressed(rng, rows, width, distinct):
    """(ptr, node, val) of `rows` rows drawn from `distinct` random rows (so most repeat), some of them empty."""
    pool = []
    for _ in range(distinct):
        k = int(rng.integers(0, width + 1))
        pool.append((np.sort(rng.choice(width, k, replace=False)), rng.integers(1, 4, k) * 0.25))
    pick = rng.integers(0, distinct, rows)
    ptr = np.concatenate([[0], np.cumsum([len(pool[p][0]) for p in pick])]).astype(np.int64)
    node = np.concatenate([pool[p][0] for p in pick] + [np.zeros(0, np.int64)]).astype(np.int64)
    val = np.concatenate([pool[p][1] for p in pick] + [np.zeros(0)])
    return ptr, node, val


@pytest.mark.parametrize("seed", range(4))
def test_shared_rows_keep_every_row_and_store_each_distinct_one_once(seed):
    rng = np.random.default_rng(seed)
    ptr, node, val = compressed(rng, rows=300, width=6, distinct=12)
    span, n2, v2 = shared_rows(ptr, node, val)
    assert rows_of(span, n2, v2) == expected_rows(ptr, node, val)
    distinct = {(tuple(a), tuple(b)) for a, b in rows_of(span, n2, v2)}
    assert len(n2) == sum(len(a) for a, _ in distinct)  # each distinct row's entries stored once
    assert span.dtype == np.int32


def test_a_hash_collision_never_merges_different_rows(monkeypatch):
    """Every row hashed alike (a worst-case collision): rows are still compared entry by entry, so each keeps
    its own entries and only the ones equal to their group's first row share its copy."""
    rng = np.random.default_rng(7)
    ptr, node, val = compressed(rng, rows=80, width=5, distinct=6)
    monkeypatch.setattr(exposure_module, "_mix", lambda x: x & np.uint64(0))
    span, n2, v2 = shared_rows(ptr, node, val)
    assert rows_of(span, n2, v2) == expected_rows(ptr, node, val)


def test_shared_rows_of_nothing():
    span, node, val = shared_rows(np.zeros(4, np.int64), np.zeros(0, np.int64), np.zeros(0))
    assert span.shape == (3, 2) and (span == 0).all() and len(node) == len(val) == 0
