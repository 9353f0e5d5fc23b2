"""Small hand-made clusters shared by the cluster tests."""

from __future__ import annotations

import copy

import pytest

# Two edge servers and a cloud; numbers chosen so that answers are easy by hand.
# a <-> b: 10 ms one way, 1 MB/s; a, b <-> cloud: 50 ms, 10 MB/s.
TRIANGLE = {
    "name": "triangle",
    "nodes": [
        {"name": "a", "kind": "edge", "memory": 3_000_000,
         "compute": {"peak_flops": 1e12, "memory_bandwidth": 1e9, "overhead": 1e-4}},
        {"name": "b", "kind": "edge", "memory_fraction": 0.5,
         "compute": {"peak_flops": "2TFLOPS", "memory_bandwidth": "2GB/s", "overhead": "100us"}},
        {"name": "cloud", "kind": "cloud", "compute": "h200"},
    ],
    "links": [
        {"src": "a", "dst": "b", "latency": "10ms", "bandwidth": "1MB/s"},
        {"src": "a", "dst": "cloud", "latency": 0.05, "bandwidth": 1e7},
        {"src": "b", "dst": "cloud", "latency": "50ms", "bandwidth": "80Mbit/s"},
    ],
    "users": [
        {"name": "alice", "home": "a", "weight": 3, "domain": "wiki"},
        {"name": "bob", "home": "b", "weight": 1, "domain": "code"},
    ],
}


@pytest.fixture
def triangle() -> dict:
    return copy.deepcopy(TRIANGLE)
