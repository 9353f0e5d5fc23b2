"""Shared fixtures for planner tests: hand-built tiny problems and random synthetic ones."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edgemoe.plan.base import PlanProblem
from edgemoe.plan.synthetic import synthetic_problem
from edgemoe.profile import synthetic_profile

MB = 1_000_000


def symmetric_sim(num_experts: int, pairs: dict[tuple[int, int], float]) -> np.ndarray:
    """[E, E] raw-cosine matrix with a unit diagonal, `pairs` set symmetrically, 0 elsewhere."""
    sim = np.eye(num_experts)
    for (a, b), value in pairs.items():
        sim[a, b] = sim[b, a] = value
    return sim


def make_problem(
    freq: np.ndarray,
    sim: np.ndarray,
    slots: list[int],
    user_home: list[int],
    user_weight: list[float],
    comm_s: np.ndarray | None = None,
    compute_s: float = 0.001,
    subst_err: np.ndarray | None = None,
    with_cloud: bool = False,
    cloud_comm_s: float = 0.1,
    user_freq: np.ndarray | None = None,
    trans: np.ndarray | None = None,
) -> PlanProblem:
    """A hand-built problem: edge servers with `slots` 1 MB expert slots, every user in one domain.

    freq: [L, E] (also every user's frequency unless `user_freq` [U, L, E] gives each user a domain of
    its own); sim: [L, E, E]; trans: [L-1, E, E] (default: the synthetic profile's); comm_s: [U, N_edge]
    (default: 0 at home, 20 ms elsewhere). A cloud, if asked for, is the last node, `cloud_comm_s` away.
    """
    freq = np.asarray(freq, dtype=np.float64)
    L, E = freq.shape
    K = max(1, int(round(freq[0].sum())))
    base = synthetic_profile(L, E, min(K, E), num_tokens=50, num_domains=1, expert_bytes=MB, seed=0)
    if subst_err is None:
        subst_err = np.clip(1.0 - sim, 0.0, 2.0)
    num_edge, U = len(slots), len(user_home)
    by_domain = freq[None] if user_freq is None else np.asarray(user_freq, dtype=np.float64)
    profile = replace(base, freq=freq, freq_by_domain=by_domain, sim=np.asarray(sim, float),
                      subst_err=np.asarray(subst_err, float), trans=base.trans if trans is None else trans)
    if comm_s is None:
        comm_s = np.full((U, num_edge), 0.02)
        comm_s[np.arange(U), user_home] = 0.0
    names = [f"edge{i}" for i in range(num_edge)]
    kinds = ["edge"] * num_edge
    caps = [s * MB for s in slots]
    comm = np.asarray(comm_s, dtype=np.float64)
    if with_cloud:
        names.append("cloud")
        kinds.append("cloud")
        caps.append(L * E * MB)
        comm = np.concatenate([comm, np.full((U, 1), cloud_comm_s)], axis=1)
    N = len(names)
    weight = np.asarray(user_weight, dtype=np.float64)
    return PlanProblem(
        profile=profile, node_names=tuple(names), node_kind=tuple(kinds),
        capacity_bytes=np.array(caps, dtype=np.int64), user_names=tuple(f"user{u}" for u in range(U)),
        user_home=np.asarray(user_home, dtype=np.int64), user_weight=weight / weight.sum(),
        user_domain=np.zeros(U, dtype=np.int64) if user_freq is None else np.arange(U), comm_s=comm, compute_s=np.full((N, L, E), compute_s),
        expert_bytes=np.full((L, E), MB, dtype=np.int64),
    )


@pytest.fixture(scope="session")
def small_problem() -> PlanProblem:
    """4 edge servers x 6 slots + cloud, 4 layers x 8 experts, K=2."""
    return synthetic_problem(num_servers=4, num_users=6, num_layers=4, num_experts=8, slots_per_server=6, seed=0)


@pytest.fixture(scope="session")
def no_cloud_problem() -> PlanProblem:
    """Same shape without a cloud: 4 x 12 slots for 32 experts, so every expert must be held."""
    return synthetic_problem(num_servers=4, num_users=6, num_layers=4, num_experts=8, slots_per_server=12,
                             with_cloud=False, seed=1)


def heterogeneous(problem: PlanProblem, slots: list[int]) -> PlanProblem:
    """The problem with the edge servers' memories set to `slots` 1 MB slots (cloud untouched)."""
    caps = problem.capacity_bytes.copy()
    edge = np.flatnonzero([k == "edge" for k in problem.node_kind])
    caps[edge] = np.asarray(slots, dtype=np.int64) * MB
    return replace(problem, capacity_bytes=caps)
