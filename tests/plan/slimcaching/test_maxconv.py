"""Max-convolution variants agree with each other and with brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.plan.slimcaching.maxconv import (
    is_concave,
    maxconv_concave,
    maxconv_naive,
    solve_layers,
    solve_layers_dp,
    solve_layers_fptas,
)


def brute_conv(a, b):
    C = len(a) - 1
    return np.array([max(a[c - j] + b[j] for j in range(c + 1)) for c in range(C + 1)])


def concave_table(rng, size):
    inc = np.sort(rng.uniform(0, 1, size - 1))[::-1]
    return np.concatenate([[0.0], np.cumsum(inc)])


def monotone_table(rng, size):
    return np.concatenate([[0.0], np.cumsum(rng.uniform(0, 1, size - 1) * (rng.random(size - 1) < 0.7))])


def brute_layers(tables):
    C = tables.shape[1] - 1
    best = -np.inf
    for budgets in itertools.product(range(C + 1), repeat=tables.shape[0]):
        if sum(budgets) <= C:
            best = max(best, sum(t[b] for t, b in zip(tables, budgets, strict=True)))
    return best


def value(tables, budgets):
    return float(tables[np.arange(len(budgets)), budgets].sum())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 12))
def test_naive_matches_brute_force_on_random_tables(seed, size):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=size), rng.normal(size=size)
    out, arg = maxconv_naive(a, b)
    assert np.allclose(out, brute_conv(a, b))
    c = np.arange(size)
    assert np.allclose(a[c - arg] + b[arg], out)  # the argmax really attains the max


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 30))
def test_concave_fast_path_equals_naive(seed, size):
    rng = np.random.default_rng(seed)
    a, b = concave_table(rng, size), concave_table(rng, size)
    fast, arg = maxconv_concave(a, b)
    slow, _ = maxconv_naive(a, b)
    assert np.allclose(fast, slow)
    c = np.arange(size)
    assert np.allclose(a[c - arg] + b[arg], fast)


def test_concave_fast_path_refuses_non_concave_tables():
    a = np.array([0.0, 0.0, 5.0])  # increments 0 then 5: convex
    assert not is_concave(a)
    with pytest.raises(ValueError, match="concave"):
        maxconv_concave(a, np.array([0.0, 1.0, 1.5]))


def test_concave_merge_is_wrong_on_convex_tables_so_the_check_matters():
    a, b = np.array([0.0, 0.0, 5.0]), np.array([0.0, 1.0, 1.0])
    inc = np.sort(np.concatenate([np.diff(a), np.diff(b)]))[::-1][:2]
    assert a[0] + b[0] + inc.sum() != maxconv_naive(a, b)[0][2]


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 5))
def test_layer_dp_is_optimal_and_feasible(seed, layers, capacity):
    rng = np.random.default_rng(seed)
    tables = np.stack([monotone_table(rng, capacity + 1) for _ in range(layers)])
    budgets = solve_layers_dp(tables, "naive")
    assert budgets.sum() <= capacity and (budgets >= 0).all()
    assert value(tables, budgets) == pytest.approx(brute_layers(tables))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 8))
def test_concave_layers_agree_with_naive(seed, layers, capacity):
    rng = np.random.default_rng(seed)
    tables = np.stack([concave_table(rng, capacity + 1) for _ in range(layers)])
    fast, method = solve_layers(tables, "auto")
    assert method == "concave"
    assert value(tables, fast) == pytest.approx(value(tables, solve_layers_dp(tables, "naive")))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 6), st.integers(1, 12), st.sampled_from([0.5, 0.2, 0.05]))
def test_fptas_within_epsilon_of_exact_dp(seed, layers, capacity, epsilon):
    rng = np.random.default_rng(seed)
    tables = np.stack([monotone_table(rng, capacity + 1) for _ in range(layers)])
    exact = value(tables, solve_layers_dp(tables, "naive"))
    budgets = solve_layers_fptas(tables, epsilon)
    assert budgets.sum() <= capacity
    assert value(tables, budgets) >= (1 - epsilon) * exact - 1e-12


def test_fptas_rejects_bad_epsilon():
    with pytest.raises(ValueError, match="epsilon"):
        solve_layers_fptas(np.zeros((2, 3)), 0.0)


# ------------------------------------------------------------------------------- the monotone fast path


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 60))
def test_monotone_path_equals_naive_with_an_arbitrary_running_table(seed, size):
    """b concave, a anything (even non-monotone): same values and the same budget split as naive."""
    from edgemoe.plan.slimcaching.maxconv import maxconv_monotone

    rng = np.random.default_rng(seed)
    a = rng.normal(size=size) if seed % 2 else np.concatenate([[0.0], np.cumsum(rng.uniform(0, 1, size - 1) ** 3)])
    b = concave_table(rng, size)
    if seed % 3 == 0:
        b = np.round(b * 4) / 4  # ties
        b = np.minimum.accumulate(np.diff(b, prepend=0.0)[::-1])[::-1].cumsum() if not is_concave(b) else b
    if not is_concave(b):
        return
    fast, fast_arg = maxconv_monotone(a, b)
    slow, slow_arg = maxconv_naive(a, b)
    assert np.allclose(fast, slow, rtol=0, atol=1e-12)
    assert np.allclose(a[np.arange(size) - fast_arg] + b[fast_arg], slow, atol=1e-12)


def test_monotone_path_refuses_a_non_concave_table():
    from edgemoe.plan.slimcaching.maxconv import maxconv_monotone

    with pytest.raises(ValueError, match="concave"):
        maxconv_monotone(np.zeros(4), np.array([0.0, 0.1, 1.0, 3.0]))


def test_auto_fires_the_monotone_path_where_its_condition_holds():
    """A convex first layer makes the running table non-concave; the concave layers after it then take
    the monotone path (not naive), and the result equals the naive DP's."""
    rng = np.random.default_rng(0)
    convex = np.arange(9, dtype=float) ** 2
    tables = np.stack([convex] + [concave_table(rng, 9) for _ in range(3)])
    counts: dict = {}
    budgets, method = solve_layers(tables, "auto", counts=counts)
    assert method == "monotone" and counts == {"monotone": 3}
    assert value(tables, budgets) == pytest.approx(value(tables, solve_layers_dp(tables, "naive")))
    mixed = np.stack([convex, concave_table(rng, 9), convex])
    counts = {}
    solve_layers(mixed, "auto", counts=counts)
    assert counts == {"monotone": 1, "naive": 1}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 10), st.integers(0, 40), st.sampled_from(["naive", "auto"]))
def test_compiled_dp_equals_numpy_dp(seed, layers, capacity, method):
    """The compiled DP picks the same method per step and returns the same budgets as the numpy loop, on
    a mix of concave, convex, arbitrary monotone and tied (rounded) tables."""
    from edgemoe.plan.slimcaching.maxconv import HAVE_NUMBA

    if not HAVE_NUMBA:
        pytest.skip("numba not installed: only the numpy DP runs")
    rng = np.random.default_rng(seed)
    size = capacity + 1
    make = [lambda: concave_table(rng, size), lambda: np.linspace(0, 1, size) ** 2,
            lambda: np.maximum.accumulate(rng.uniform(0, 1, size)), lambda: np.round(concave_table(rng, size), 1)]
    tables = np.stack([make[k]() for k in rng.integers(0, 4, layers)])
    fast_counts, slow_counts = {}, {}
    fast = solve_layers_dp(tables, method, fast_counts, compiled=True)
    slow = solve_layers_dp(tables, method, slow_counts, compiled=False)
    assert np.array_equal(fast, slow) and fast_counts == slow_counts
