"""The cost model: seconds of expert calls, transfers and layers, and the cost tables of a model on a cluster.

Formulas (docs/cluster.md, "Cost model"; ALGORITHMS.md §2.3 and §3.3):
- compute of one expert call with `tokens` tokens batched (roofline; weights streamed once per call):
      overhead + max(tokens * flops_per_token / peak_flops, weight_bytes / mem_bandwidth)
- one-way transfer of `nbytes`: latency + nbytes / bandwidth
- M/M/1 waiting time at a node: W = rho / (mu (1 - rho))
- remote call: transfer there + queueing + compute + transfer back; local call: compute only
- a layer: the slowest of its K parallel branches; traffic: 2 x hidden_bytes per remote branch.
Every function is vectorised: arguments broadcast like numpy arrays. `cost_tables` gathers the tables a
planning problem is made of as plain arrays; `edgemoe.plan.problem.plan_problem` builds the problem from them
(data flows profile -> cluster -> plan; nothing here knows a profile or a planner).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError

from .schema import Cluster, validate_for_model


def roofline_s(flops_per_token, weight_bytes, peak_flops, mem_bw_Bps, overhead_s, tokens=1) -> np.ndarray:
    """[...] seconds of one expert call on `tokens` tokens: overhead + max(compute time, weight-read time).

    The weights are read once per call, so tokens batched in one call share that read; activations'
    memory traffic is ignored (small next to the weights at the batch sizes of interest).
    """
    compute = np.asarray(tokens, dtype=float) * np.asarray(flops_per_token, dtype=float) / np.asarray(peak_flops, dtype=float)
    memory = np.asarray(weight_bytes, dtype=float) / np.asarray(mem_bw_Bps, dtype=float)
    return np.asarray(overhead_s, dtype=float) + np.maximum(compute, memory)


def transfer_s(nbytes, latency_s, bandwidth_Bps) -> np.ndarray:
    """[...] seconds to move `nbytes` one way: latency + nbytes / bandwidth (inf bandwidth: no serialisation)."""
    return np.asarray(latency_s, dtype=float) + np.asarray(nbytes, dtype=float) / np.asarray(bandwidth_Bps, dtype=float)


def mm1_wait_s(utilisation, service_s) -> np.ndarray:
    """[...] M/M/1 mean waiting time before service, W = rho / (mu (1 - rho)) with mu = 1 / service_s.

    utilisation rho must lie in [0, 1); at rho -> 1 the queue grows without bound.
    """
    rho = np.asarray(utilisation, dtype=float)
    if ((rho < 0) | (rho >= 1)).any():
        raise EdgeMoEError(f"utilisation must be in [0, 1), got {rho[(rho < 0) | (rho >= 1)].ravel()[:3]}")
    return rho * np.asarray(service_s, dtype=float) / (1.0 - rho)


def remote_call_s(hidden_bytes, lat_out_s, bw_out_Bps, lat_back_s, bw_back_Bps, compute_s, queue_s=0.0) -> np.ndarray:
    """[...] seconds of a remote expert call: hidden state there, wait, compute, result back."""
    return (transfer_s(hidden_bytes, lat_out_s, bw_out_Bps) + np.asarray(queue_s, dtype=float)
            + np.asarray(compute_s, dtype=float) + transfer_s(hidden_bytes, lat_back_s, bw_back_Bps))


def local_call_s(compute_s) -> np.ndarray:
    """[...] seconds of an expert call on the node where the token is: compute only, no network."""
    return np.asarray(compute_s, dtype=float)


def layer_s(branch_s) -> np.ndarray:
    """[..., K] seconds of each parallel branch -> [...] seconds of the layer (the slowest branch)."""
    return np.asarray(branch_s, dtype=float).max(axis=-1)


def traffic_bytes(remote, hidden_bytes) -> np.ndarray:
    """[..., K] bool remote branches -> [...] bytes on the wire (hidden state both ways per remote branch)."""
    return 2 * np.asarray(hidden_bytes, dtype=np.int64) * np.asarray(remote, dtype=np.int64).sum(axis=-1)


# ----------------------------------------------------------------------------------------------------------
# Cluster-level tables
# ----------------------------------------------------------------------------------------------------------


def node_compute_s(cluster: Cluster, expert_flops, expert_bytes, tokens: int = 1) -> np.ndarray:
    """[N, L, E] seconds for node n to run expert (l, e) on a call of `tokens` tokens (roofline)."""
    flops, nbytes = np.asarray(expert_flops, dtype=float), np.asarray(expert_bytes, dtype=float)
    peak = np.array([n.compute.peak_flops for n in cluster.nodes])[:, None, None]
    bw = np.array([n.compute.mem_bw_Bps for n in cluster.nodes])[:, None, None]
    overhead = np.array([n.compute.overhead_s for n in cluster.nodes])[:, None, None]
    return roofline_s(flops[None], nbytes[None], peak, bw, overhead, tokens)


def round_trip_s(cluster: Cluster, nbytes) -> np.ndarray:
    """[N, N] seconds to send `nbytes` from node i to node j and the same amount back (0 on the diagonal)."""
    there = transfer_s(nbytes, cluster.lat_s, cluster.bw_Bps)
    return there + there.T


def one_way_s(cluster: Cluster, nbytes) -> np.ndarray:
    """[N, N] seconds to send `nbytes` from node i to node j once (0 on the diagonal)."""
    return transfer_s(nbytes, cluster.lat_s, cluster.bw_Bps)


def migration_s(cluster: Cluster, hidden_bytes: int, kv_bytes: int = 0) -> np.ndarray:
    """[N, N] seconds for a token to continue on node j after node i ran its expert (`migrate` mode).

    The hidden state moves one way; `kv_bytes` is whatever KV state the new node needs for this token
    (0 when the backbone's KV stays at home or is replicated). Staying put (i == j) costs nothing.
    """
    return one_way_s(cluster, hidden_bytes + kv_bytes)


def node_queue_s(cluster: Cluster, compute_s: np.ndarray, freq: np.ndarray | None = None) -> np.ndarray:
    """[N] M/M/1 waiting seconds at each node from its `utilisation` knob.

    compute_s: [N, L, E] call times; freq: [L, E] activation weights for the mean service time (default
    uniform). mu is the node's `service_rate` when given, else 1 / (its mean expert call time).
    """
    weights = np.ones(compute_s.shape[1:]) if freq is None else np.asarray(freq, dtype=float)
    mean_service = (compute_s * weights[None]).sum(axis=(1, 2)) / max(weights.sum(), 1e-300)
    service = np.array([1.0 / n.service_rate if n.service_rate else s for n, s in zip(cluster.nodes, mean_service, strict=True)])
    return mm1_wait_s(np.array([n.utilisation for n in cluster.nodes]), service)


def user_domain_index(cluster: Cluster, domains: list[str] | tuple[str, ...], fallback: bool = False) -> tuple[np.ndarray, dict]:
    """[U] index of each user's domain in `domains` and the name map used.

    A profile with a single domain serves every user (there is nothing to choose). With `fallback`,
    domains not among `domains` are mapped round-robin (in order of first appearance) onto `domains` (for
    synthetic profiles whose domains are "domain0", ...); otherwise they are an error.
    """
    domains = list(domains)
    if not domains:
        raise EdgeMoEError("profile.meta.domains is empty; a profile needs at least one domain")
    mapping: dict[str, str] = {d: d for d in domains}
    unknown = [u for u in dict.fromkeys(u.domain for u in cluster.users) if u not in mapping]
    if unknown and not fallback and len(domains) > 1:
        i = next(i for i, u in enumerate(cluster.users) if u.domain == unknown[0])
        raise EdgeMoEError(
            f"cluster {cluster.name!r}: users[{i}].domain is {unknown[0]!r}, not among the profile's domains "
            f"{domains}; name one of them in the cluster file, or pass --domain-fallback to map unknown domains "
            "round-robin onto the profile's")
    for k, name in enumerate(unknown):
        mapping[name] = domains[k % len(domains)]
    index = np.array([domains.index(mapping[u.domain]) for u in cluster.users], dtype=np.int64)
    return index, {u: mapping[u] for u in dict.fromkeys(u.domain for u in cluster.users)}


@dataclass(frozen=True)
class CostTables:
    """The cost tables of one model on one cluster, as plain arrays (what a planning problem is made of).

    N nodes, U users, L layers, E experts per layer.
    """

    capacity_bytes: np.ndarray  # [N] int64 bytes for experts (memory / memory_fraction resolved; cloud: all)
    compute_s: np.ndarray  # [N, L, E] roofline seconds of one call of `tokens_per_call` tokens
    comm_s: np.ndarray  # [U, N] round trip home -> n of the call's hidden states (+ n's queue when n != home)
    xfer_s: np.ndarray  # [N, N] one-way seconds of the same hidden states, no queue, 0 on the diagonal
    queue_s: np.ndarray  # [N] M/M/1 waiting seconds at each node (0 without queueing)


def cost_tables(cluster: Cluster, expert_bytes, expert_flops, hidden_bytes: int, freq=None,
                tokens_per_call: int = 1, queueing: bool = True) -> CostTables:
    """Cost tables for a model with experts of `expert_bytes` / `expert_flops` [L, E] on `cluster`.

    - capacity_bytes [N]: checked by `validate_for_model` (raises when the model cannot be served).
    - compute_s [N, L, E]: roofline time of one call carrying `tokens_per_call` tokens (the latency each
      of those tokens sees).
    - comm_s [U, N]: round trip of `tokens_per_call` hidden states (`hidden_bytes` each) from the user's
      home to node n over the shortest-latency path; 0 at home. With `queueing` and any node utilisation
      > 0, the node's M/M/1 wait (mean service weighted by `freq` [L, E], default uniform) is added for
      n != home, so comm_s + compute_s is exactly the remote-call latency and a local call stays compute only.
    - xfer_s [N, N]: one-way seconds of the same hidden states between any two nodes (the `migrate` mode's hops).
    """
    if tokens_per_call < 1:
        raise EdgeMoEError(f"tokens_per_call must be >= 1, got {tokens_per_call}")
    capacity = validate_for_model(cluster, expert_bytes)
    compute = node_compute_s(cluster, expert_flops, expert_bytes, tokens_per_call)
    home = cluster.user_home
    one_way = one_way_s(cluster, tokens_per_call * hidden_bytes)
    np.fill_diagonal(one_way, 0.0)
    comm = round_trip_s(cluster, tokens_per_call * hidden_bytes)[home]
    queue = node_queue_s(cluster, compute, freq) if queueing else np.zeros(cluster.num_nodes)
    away = np.arange(cluster.num_nodes)[None, :] != home[:, None]
    comm = comm + np.where(away, queue[None, :], 0.0)
    return CostTables(capacity_bytes=capacity, compute_s=compute, comm_s=comm, xfer_s=one_way, queue_s=queue)


def usable_nodes(node_kind, user_home) -> np.ndarray:
    """[U, N] bool: which nodes may serve each user. Edge and cloud nodes serve everyone; a device serves only
    the users homed on it. node_kind: [N] kinds; user_home: [U] node indices. The planner's runtime model
    and the runtime context both ask this."""
    is_device = np.array([k == "device" for k in node_kind])
    own = np.arange(len(node_kind))[None, :] == np.asarray(user_home)[:, None]
    return ~is_device[None, :] | own
