"""Routing statistics: known answers, invariants and hypothesis properties (pure numpy)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.profile import stats


def test_known_answer_two_tokens():
    # T=2 tokens, L=2 layers, K=2, E=3
    topk = np.array([[[0, 1], [1, 2]], [[0, 2], [1, 0]]])
    freq = stats.activation_frequency(topk, 3)
    assert np.allclose(freq, [[1.0, 0.5, 0.5], [0.5, 1.0, 0.5]])
    coact = stats.coactivation(topk, 3)
    assert np.allclose(coact[0], [[2, 1, 1], [1, 1, 0], [1, 0, 1]])
    trans = stats.transitions(topk, 3)
    # expert 0 at layer 0 -> {1,2} (token 0) and {1,0} (token 1): counts 0:1, 1:2, 2:1
    assert np.allclose(trans[0, 0], [0.25, 0.5, 0.25])
    assert np.allclose(trans[0, 1], [0.0, 0.5, 0.5])


def test_similarity_known_answer():
    logits = np.zeros((3, 1, 3))
    logits[:, 0, 0] = [1, 0, 0]
    logits[:, 0, 1] = [2, 0, 0]  # same direction as expert 0
    logits[:, 0, 2] = [0, 1, 0]  # orthogonal
    sim = stats.router_similarity(logits)[0]
    assert np.allclose(sim, [[1, 1, 0], [1, 1, 0], [0, 0, 1]])


topk_sets = st.integers(1, 4).flatmap(
    lambda K: st.tuples(st.integers(1, 30), st.integers(2, 4), st.integers(K, 7)).flatmap(
        lambda s: st.builds(
            lambda seed: _random_topk(seed, s[0], s[1], K, s[2]), st.integers(0, 2**31 - 1))))


def _random_topk(seed, T, L, K, E):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(T)]), E


@settings(max_examples=40, deadline=None)
@given(topk_sets)
def test_invariants(case):
    topk, E = case
    T, L, K = topk.shape
    freq = stats.activation_frequency(topk, E)
    assert np.allclose(freq.sum(1), K)
    coact = stats.coactivation(topk, E)
    assert np.allclose(coact, coact.transpose(0, 2, 1))
    assert np.allclose(np.diagonal(coact, axis1=1, axis2=2), freq * T)
    trans = stats.transitions(topk, E)
    rows = trans.sum(2)
    seen = freq[:-1] > 0
    assert np.allclose(rows[seen], 1.0) and np.allclose(rows[~seen], 0.0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 50), st.integers(2, 9))
def test_similarity_symmetric_unit_diagonal(seed, T, E):
    logits = np.random.default_rng(seed).normal(size=(T, 3, E))
    sim = stats.router_similarity(logits)
    assert np.allclose(sim, sim.transpose(0, 2, 1))
    assert np.allclose(np.diagonal(sim, axis1=1, axis2=2), 1.0)
    assert (sim <= 1 + 1e-12).all() and (sim >= -1 - 1e-12).all()
