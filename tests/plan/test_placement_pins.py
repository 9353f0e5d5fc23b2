"""Every planner's placement on small fixed instances, pinned bit for bit (sha256 of the host mask): moving
code around the planners (the pipeline, settings objects, the placement's recorded grouping) must not move a
single copy. A planner whose algorithm changes on purpose re-pins here and says why."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from edgemoe.cluster import generate, load_cluster
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile


def hosts_digest(hosts: np.ndarray) -> str:
    """sha256 (16 hex digits) of a [N, L, E] host mask and its shape."""
    h = hashlib.sha256(repr(hosts.shape).encode())
    h.update(np.packbits(np.ascontiguousarray(hosts, bool)).tobytes())
    return h.hexdigest()[:16]


CLUSTERS = {"edge8": lambda: load_cluster("edge8"), "device-edge-cloud": lambda: load_cluster("device-edge-cloud"),
            "gen12": lambda: generate(12, 30, seed=5, copies=3, with_cloud=True)}
CASES = {  # name: (planner, params)
    "uniform": ("uniform", {}), "lfu": ("lfu", {}), "eplb": ("eplb", {}), "activation-aware": ("activation-aware", {}),
    "random": ("random", {}), "greedy": ("greedy", {}), "u-shaped": ("u-shaped", {}),
    "slimcaching": ("slimcaching", {}), "slimcaching-1pass": ("slimcaching", {"refine": False, "passes": 1}),
    "slimcaching-passes3": ("slimcaching", {"passes": 3, "kicks": 16}),
}


@pytest.fixture(scope="module")
def problems():
    profile = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=400, seed=11)
    return {name: plan_problem(profile, make(), domain_fallback=True) for name, make in CLUSTERS.items()}


def compute_pins(problems) -> dict:
    return {(c, case): hosts_digest(plan(problems[c], method, **params).hosts)
            for c in CLUSTERS for case, (method, params) in CASES.items()}


# hosts_digest of each case on evalarch at cf8cc7b, before the pipeline and settings changes
PINNED = {
    ('edge8', 'uniform'): 'a6a3dda11a981df8',
    ('edge8', 'lfu'): '1f176b5f1beaa8a7',
    ('edge8', 'eplb'): 'ef020a1444a8d811',
    ('edge8', 'activation-aware'): 'a7dd12b441bb393c',
    ('edge8', 'random'): 'e0e586f91b08b900',
    ('edge8', 'greedy'): 'e22171e7c05c905a',
    ('edge8', 'u-shaped'): 'cbd0c97d18b97847',
    ('edge8', 'slimcaching'): '75a1bf6055e0b302',
    ('edge8', 'slimcaching-1pass'): '356245a84709f0b7',
    ('edge8', 'slimcaching-passes3'): '75a1bf6055e0b302',
    ('device-edge-cloud', 'uniform'): '6f5053bdaae37a3e',
    ('device-edge-cloud', 'lfu'): 'dff64d1d2cddd8bd',
    ('device-edge-cloud', 'eplb'): 'c0e02dd121b0e393',
    ('device-edge-cloud', 'activation-aware'): '595da47d695c94e9',
    ('device-edge-cloud', 'random'): '6173fbb73cdd3b55',
    ('device-edge-cloud', 'greedy'): '46f1554fae98ec68',
    ('device-edge-cloud', 'u-shaped'): 'a0200fdb8209c7dc',
    ('device-edge-cloud', 'slimcaching'): 'af0e2f85fa36681c',
    ('device-edge-cloud', 'slimcaching-1pass'): '91f63e5f77c64d8a',
    ('device-edge-cloud', 'slimcaching-passes3'): 'af0e2f85fa36681c',
    ('gen12', 'uniform'): '818629fa8fac40bf',
    ('gen12', 'lfu'): '40e3db542be3706b',
    ('gen12', 'eplb'): '53717fbf4272626c',
    ('gen12', 'activation-aware'): '1c9a642eb51d0806',
    ('gen12', 'random'): 'be9f9f3143b8c60f',
    ('gen12', 'greedy'): '13cb394e73a6be20',
    ('gen12', 'u-shaped'): '40547f02af584254',
    ('gen12', 'slimcaching'): '41230675335cb4db',
    ('gen12', 'slimcaching-1pass'): '1fe002fe4e43a813',
    ('gen12', 'slimcaching-passes3'): '41230675335cb4db',
}


def test_placements_are_pinned(problems):
    got = compute_pins(problems)
    assert got == PINNED
