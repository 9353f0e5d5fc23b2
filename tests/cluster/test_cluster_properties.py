"""Hypothesis properties: closure never exceeds direct links and equals brute force; costs are monotone."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.cluster import cost
from edgemoe.cluster.schema import shortest_paths

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def graphs(draw, max_nodes: int = 5):
    n = draw(st.integers(2, max_nodes))
    has = draw(st.lists(st.booleans(), min_size=n * n, max_size=n * n))
    # whole milliseconds (as integers) keep path sums exact, so ties compare exactly
    lat_values = draw(st.lists(st.integers(0, 100), min_size=n * n, max_size=n * n))
    bw_values = draw(st.lists(st.floats(1e3, 1e9), min_size=n * n, max_size=n * n))
    transit = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    has = np.array(has).reshape(n, n)
    lat = np.where(has, np.array(lat_values, dtype=float).reshape(n, n), np.inf)
    bw = np.where(has, np.array(bw_values).reshape(n, n), 0.0)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return lat, bw, transit


def brute_force(lat: np.ndarray, transit: np.ndarray) -> np.ndarray:
    """[N, N] minimum latency over every simple path whose inner nodes may relay."""
    n = len(lat)
    best = lat.copy()
    for i, j in itertools.product(range(n), range(n)):
        inner = [k for k in range(n) if k not in (i, j) and transit[k]]
        for r in range(1, len(inner) + 1):
            for mid in itertools.permutations(inner, r):
                nodes = (i, *mid, j)
                best[i, j] = min(best[i, j], sum(lat[a, b] for a, b in itertools.pairwise(nodes)))
    return best


@SETTINGS
@given(graphs())
def test_closure_never_exceeds_direct_links_and_matches_brute_force(graph):
    lat, bw, transit = graph
    closed, closed_bw, nxt = shortest_paths(lat, bw, transit)
    assert (closed <= lat).all()
    np.testing.assert_array_equal(closed, brute_force(lat, transit))


@SETTINGS
@given(graphs())
def test_next_hop_walks_the_reported_path(graph):
    lat, bw, transit = graph
    closed, closed_bw, nxt = shortest_paths(lat, bw, transit)
    n = len(lat)
    for i, j in itertools.product(range(n), range(n)):
        if i == j or not np.isfinite(closed[i, j]):
            continue
        path = [i]
        while path[-1] != j:
            path.append(int(nxt[path[-1], j]))
            assert len(path) <= n
        hops = list(itertools.pairwise(path))
        assert all(transit[k] for k in path[1:-1])
        assert sum(lat[a, b] for a, b in hops) == closed[i, j]
        assert closed_bw[i, j] == min(bw[a, b] for a, b in hops)


@SETTINGS
@given(st.floats(0, 1e9), st.floats(0, 1e9), st.floats(0, 0.1), st.floats(1e3, 1e10), st.floats(1e9, 1e15),
       st.floats(1e8, 1e13), st.floats(0, 1e-3), st.integers(1, 512))
def test_latencies_non_negative_and_monotone_in_bytes(b1, b2, latency, bandwidth, peak, mem_bw, overhead, tokens):
    small, large = sorted((b1, b2))
    t_small = cost.transfer_s(small, latency, bandwidth)
    t_large = cost.transfer_s(large, latency, bandwidth)
    assert 0 <= t_small <= t_large
    r_small = cost.roofline_s(small, small, peak, mem_bw, overhead, tokens)
    r_large = cost.roofline_s(large, large, peak, mem_bw, overhead, tokens)
    assert overhead <= r_small <= r_large
    call_small = cost.remote_call_s(small, latency, bandwidth, latency, bandwidth, r_small)
    call_large = cost.remote_call_s(large, latency, bandwidth, latency, bandwidth, r_small)
    assert cost.local_call_s(r_small) <= call_small <= call_large


@SETTINGS
@given(st.floats(0, 0.99), st.floats(0, 0.99), st.floats(1e-6, 1e-2))
def test_queue_wait_non_negative_and_grows_with_utilisation(rho1, rho2, service):
    lo, hi = sorted((rho1, rho2))
    assert 0 <= cost.mm1_wait_s(lo, service) <= cost.mm1_wait_s(hi, service)
