"""Helpers every planner shares: which nodes a planner may fill, per-node load and demand, free memory,
replica counts, and the coverage repair that keeps every expert on at least one non-cloud node.

Used by the baseline planners, SlimCaching, OrderMoE and the ILP.
"""

from __future__ import annotations

import numpy as np

from edgemoe.errors import EdgeMoEError

from .base import PlanProblem


def cache_nodes(problem: PlanProblem) -> np.ndarray:
    """[N'] node indices that a planner fills: edge servers and user devices (never the cloud)."""
    return np.array([n for n, k in enumerate(problem.node_kind) if k in ("edge", "device")], dtype=np.int64)


def fillable_nodes(problem: PlanProblem, fill: str = "edge") -> np.ndarray:
    """[N] bool: nodes a planner may put experts on. fill: comma-separated kinds from {"edge", "device"}."""
    kinds = {k.strip() for k in str(fill).split(",") if k.strip()}
    if not kinds or not kinds <= {"edge", "device"}:
        raise EdgeMoEError(f"fill={fill!r}; expected 'edge', 'device' or 'edge,device' (the cloud is never filled)")
    mask = np.array([k in kinds for k in problem.node_kind], dtype=bool)
    if not mask.any():
        raise EdgeMoEError(f"fill={fill!r}: the cluster has no node of that kind ({sorted(set(problem.node_kind))})")
    return mask


def has_cloud(problem: PlanProblem) -> bool:
    return bool(problem.is_cloud.any())


def resolve_coverage(problem: PlanProblem, coverage: bool | None) -> bool:
    """Default coverage: required exactly when there is no cloud to fall back on."""
    return (not has_cloud(problem)) if coverage is None else bool(coverage)


def access_nodes(problem: PlanProblem, fillable: np.ndarray) -> np.ndarray:
    """[U] node each user's load counts against: its home if fillable, else its nearest fillable node.

    Nearest = least `comm_s[u, n]` (ties: lower index). This is how devices' users are attributed to edge
    servers in the device-edge-cloud setting.
    """
    home = np.asarray(problem.user_home, dtype=np.int64)
    comm = np.where(fillable[None, :], problem.comm_s, np.inf)
    nearest = np.argmin(comm, axis=1)
    return np.where(fillable[home], home, nearest)


def node_load(problem: PlanProblem, fillable: np.ndarray) -> np.ndarray:
    """[N] share of tokens whose access node is n (OrderMoE's lambda_s); zero on non-fillable nodes."""
    load = np.zeros(problem.num_nodes)
    np.add.at(load, access_nodes(problem, fillable), problem.user_weight)
    return load


def node_demand(problem: PlanProblem, fillable: np.ndarray) -> np.ndarray:
    """[N, L, E] expected activations per token of (l, e) among the users whose access node is n."""
    weighted = problem.user_weight[:, None, None] * problem.user_freq()  # [U, L, E]
    demand = np.zeros((problem.num_nodes, *problem.expert_bytes.shape))
    np.add.at(demand, access_nodes(problem, fillable), weighted)
    return demand


def global_demand(problem: PlanProblem) -> np.ndarray:
    """[L, E] user-weighted activations per token (the load each expert receives)."""
    return np.einsum("u,ule->le", problem.user_weight, problem.user_freq())


def free_bytes(problem: PlanProblem, hosts: np.ndarray) -> np.ndarray:
    """[N] capacity minus bytes held (cloud: meaningless, never used)."""
    used = (hosts * problem.expert_bytes[None]).sum(axis=(1, 2))
    return np.asarray(problem.capacity_bytes, dtype=np.int64) - used.astype(np.int64)


def replica_counts(hosts: np.ndarray, fillable: np.ndarray) -> np.ndarray:
    """[L, E] copies of each expert on fillable nodes."""
    return hosts[fillable].sum(axis=0)


def fill_by_order(problem: PlanProblem, hosts: np.ndarray, node: int, order: np.ndarray) -> None:
    """Add experts to `node` in `order` ([M] flat (l, e) indices), skipping held or non-fitting ones. In place."""
    E = problem.expert_bytes.shape[1]
    bytes_flat = problem.expert_bytes.ravel()
    free = int(free_bytes(problem, hosts)[node])
    held = hosts[node].ravel().copy()
    for flat in order:
        if not held[flat] and bytes_flat[flat] <= free:
            held[flat] = True
            free -= int(bytes_flat[flat])
            hosts[node, flat // E, flat % E] = True


def ensure_coverage(problem: PlanProblem, hosts: np.ndarray, fillable: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Give every uncovered expert a copy, evicting the least valuable duplicates when memory is full.

    hosts: [N, L, E] (modified in place and returned); value: [L, E] how much a copy is worth (evict low,
    cover high first). An expert is placed on the fitting fillable node with the largest free fraction;
    with none fitting, the duplicate copy (an expert held on >= 2 fillable nodes) of least value whose
    removal makes room is evicted. Experts that still do not fit stay uncovered (memory too small).
    """
    capacity = np.maximum(np.asarray(problem.capacity_bytes, dtype=np.float64), 1.0)
    return cover_uncovered(problem, hosts, fillable, value,
                  pick=lambda layer, expert, free, fits: int(np.argmax(np.where(fits, free / capacity, -np.inf))),
                  eviction_cost=lambda layer, expert: value[None])


def cover_uncovered(problem: PlanProblem, hosts: np.ndarray, fillable: np.ndarray, order_value: np.ndarray, pick,
           eviction_cost) -> np.ndarray:
    """The coverage repair both planners share: each expert held on no fillable node, most valuable first
    (order_value [L, E]), takes the node `pick(layer, expert, free [N], fits [N])` where it fits; with none
    fitting, it replaces the duplicate copy (held on >= 2 fillable nodes, on a node where removing it makes
    room) of least `eviction_cost(layer, expert)` (broadcast to [N, L, E]). hosts [N, L, E] in place."""
    sizes = problem.expert_bytes
    uncovered = np.argwhere(~hosts[fillable].any(axis=0))
    order = np.argsort(-order_value[uncovered[:, 0], uncovered[:, 1]], kind="stable")
    for layer, expert in uncovered[order]:
        need = sizes[layer, expert]
        free = free_bytes(problem, hosts)
        fits = fillable & (free >= need)
        if fits.any():
            node = pick(layer, expert, free, fits)
        else:
            duplicate = replica_counts(hosts, fillable) >= 2  # [L, E]
            room = (free[:, None, None] + sizes[None]) >= need  # [N, L, E]
            evictable = hosts & fillable[:, None, None] & duplicate[None] & room
            if not evictable.any():
                continue
            cost = np.where(evictable, eviction_cost(layer, expert), np.inf)
            node, l2, e2 = np.unravel_index(int(np.argmin(cost)), cost.shape)
            hosts[node, l2, e2] = False
        hosts[node, layer, expert] = True
    return hosts


def proportional_slots(problem: PlanProblem, fillable: np.ndarray) -> np.ndarray:
    """[N, L] per-layer expert slots of each fillable node, its memory spread evenly over the layers.

    A slot of layer l is sized for its largest expert, so any expert of the layer fits one. Slots are
    handed out one at a time to the layer with the fewest slots on that node (at most E per layer); ties
    rotate with the node index so the remainders land on different layers on different nodes.
    """
    L, E = problem.expert_bytes.shape
    slot_bytes = problem.expert_bytes.max(axis=1)  # [L]
    slots = np.zeros((problem.num_nodes, L), dtype=np.int64)
    for node in np.flatnonzero(fillable):
        remaining = int(problem.capacity_bytes[node])
        rotation = (np.arange(L) - node) % L
        while True:
            open_layers = (slots[node] < E) & (slot_bytes <= remaining)
            if not open_layers.any():
                break
            key = np.where(open_layers, slots[node] * L + rotation, np.iinfo(np.int64).max)
            layer = int(np.argmin(key))
            slots[node, layer] += 1
            remaining -= int(slot_bytes[layer])
    return slots


def argmax_lex(primary: np.ndarray, secondary: np.ndarray, allowed: np.ndarray) -> int:
    """Index with the largest `primary` among `allowed` ([N] bool), ties by largest `secondary`, then lowest index."""
    p = np.where(allowed, primary, -np.inf)
    best = allowed & np.isclose(p, p.max(), rtol=1e-12, atol=0.0)
    return int(np.argmax(np.where(best, secondary, -np.inf)))


def cover_edges(problem: PlanProblem, hosts: np.ndarray) -> np.ndarray:
    """Give every expert an edge-server copy (in place), evicting the least demanded duplicates if needed.

    The shared repair of the other planners (`ensure_coverage`), on edge servers only: a device
    serves only its owner, so a copy there does not make an expert reachable for everyone.
    """
    edge = np.array([k == "edge" for k in problem.node_kind])
    if edge.any():
        ensure_coverage(problem, hosts, edge, global_demand(problem))
    return hosts
