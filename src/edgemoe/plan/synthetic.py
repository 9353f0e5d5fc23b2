"""A random PlanProblem for tests and benchmarks that need no cluster file or model."""

from __future__ import annotations

import numpy as np

from edgemoe.profile import synthetic_profile

from .base import PlanProblem


def synthetic_problem(
    num_servers: int = 4,
    num_users: int = 6,
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    slots_per_server: int = 6,
    with_cloud: bool = True,
    with_devices: bool = False,
    device_slots: int = 2,
    num_tokens: int = 2000,
    seed: int = 0,
) -> PlanProblem:
    """Edge servers (+ optional user devices and a cloud) with random links and speeds.

    Every expert costs 1 MB, so capacity is `slots * 1 MB`. Users are spread round-robin over the edge
    servers (or each gets its own device when `with_devices`). Comm times are 5-60 ms round trips
    between distinct nodes (cloud: 80-120 ms), compute 0.2-2 ms per expert call depending on the node.
    """
    rng = np.random.default_rng(seed)
    expert_bytes = 1_000_000
    profile = synthetic_profile(num_layers, num_experts, top_k, num_tokens, num_domains=3,
                                expert_bytes=expert_bytes, seed=seed)
    names = [f"edge{i}" for i in range(num_servers)]
    kinds = ["edge"] * num_servers
    caps = [slots_per_server * expert_bytes] * num_servers
    if with_devices:
        names += [f"dev{u}" for u in range(num_users)]
        kinds += ["device"] * num_users
        caps += [device_slots * expert_bytes] * num_users
    if with_cloud:
        names.append("cloud")
        kinds.append("cloud")
        caps.append(num_layers * num_experts * expert_bytes)
    N = len(names)
    home = (num_servers + np.arange(num_users)) if with_devices else (np.arange(num_users) % num_servers)
    node_rtt = rng.uniform(0.005, 0.060, size=(N, N))
    node_rtt = 0.5 * (node_rtt + node_rtt.T)
    np.fill_diagonal(node_rtt, 0.0)
    if with_cloud:
        node_rtt[-1, :-1] = node_rtt[:-1, -1] = rng.uniform(0.08, 0.12, size=N - 1)
    speed = rng.uniform(0.2e-3, 2e-3, size=N)
    if with_devices:
        speed[num_servers:num_servers + num_users] *= 4  # devices compute slowly
    compute = np.broadcast_to(speed[:, None, None], (N, num_layers, num_experts)).copy()
    weight = rng.uniform(0.5, 1.5, size=num_users)
    return PlanProblem(
        profile=profile, node_names=tuple(names), node_kind=tuple(kinds),
        capacity_bytes=np.array(caps, dtype=np.int64), user_names=tuple(f"user{u}" for u in range(num_users)),
        user_home=home.astype(np.int64), user_weight=weight / weight.sum(),
        user_domain=np.arange(num_users) % 3, comm_s=node_rtt[home], compute_s=compute,
        expert_bytes=np.full((num_layers, num_experts), expert_bytes, dtype=np.int64),
        params={"synthetic_seed": seed},
    )
