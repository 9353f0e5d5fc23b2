"""`u-shaped`: SlimCaching's split-inference baseline (ALGORITHMS.md §2.5.5), as a placement.

Our reading: the model is cut into three contiguous runs of whole MoE layers. The user's device runs the
first and the last layers (head and tail, alternately adding one layer to each end while the device
memory holds all of that layer's experts); every edge server holds all experts of the next middle layers
after the head, as many whole layers as its memory holds; what is left runs on the cloud. Users without
a device start the middle block at layer 0. No expert is chosen by routing statistics: this baseline
ignores which experts are popular, which is what it is measured against.

Evaluated under the common per-expert objective (`objective.py`) a middle-block layer costs one round
trip to the fastest edge server holding it, the same as a real U-shaped split pays per layer boundary it
crosses when consecutive layers sit on different nodes; a real split pays once per segment instead of
once per layer, so `native_latency_s` (in params) also reports that segment-based figure.

Without a cloud (or with coverage=True) the layers beyond the edge block would be held nowhere, so the
shared coverage repair (`nodes.cover_edges`) then gives every expert an edge copy: free memory
first, else in place of the least demanded duplicate (edge servers all hold the same middle block, so
there are many). The result is then no longer made of whole layers only.
"""

from __future__ import annotations

import time

import numpy as np

from ..base import Placement, PlanProblem, empty_hosts, make_placement, register
from ..nodes import cover_edges, resolve_coverage
from ..objective import expected_latency, require_covered, require_servable, slim_model


def _device_layers(layer_bytes: np.ndarray, capacity: int) -> list[int]:
    """Layers for a device: alternately the next head and tail layer, while whole layers fit."""
    L = layer_bytes.size
    head, tail, chosen, used = 0, L - 1, [], 0
    take_head = True
    while head <= tail:
        layer = head if take_head else tail
        if used + layer_bytes[layer] > capacity:
            break
        chosen.append(layer)
        used += int(layer_bytes[layer])
        head, tail = (head + 1, tail) if take_head else (head, tail - 1)
        take_head = not take_head
    return chosen


@register("u-shaped")
def ushaped(problem: PlanProblem, coverage: bool | None = None) -> Placement:
    """Device: head + tail layers; edge servers: the middle block of whole layers; cloud: the rest.

    coverage: repair so every expert has an edge copy; default (None) exactly when there is no cloud.
    """
    start = time.perf_counter()
    cover = resolve_coverage(problem, coverage)
    require_servable(problem, "u-shaped", cover)
    layer_bytes = problem.expert_bytes.sum(axis=1)  # [L]
    L = layer_bytes.size
    hosts = empty_hosts(problem)
    kinds = problem.node_kind
    head_len = L
    for n, kind in enumerate(kinds):
        if kind == "device":
            layers = _device_layers(layer_bytes, int(problem.capacity_bytes[n]))
            hosts[n, layers] = True
            head_len = min(head_len, sum(1 for layer in layers if layer < L / 2) if layers else 0)
    if not any(k == "device" for k in kinds):
        head_len = 0
    for n, kind in enumerate(kinds):
        if kind != "edge":
            continue
        used = 0
        for layer in range(head_len, L):
            if used + layer_bytes[layer] > problem.capacity_bytes[n]:
                break
            hosts[n, layer] = True
            used += int(layer_bytes[layer])
    if cover:
        cover_edges(problem, hosts)
        require_covered(problem, hosts, "u-shaped")
    return make_placement(problem, "u-shaped", hosts, head_layers=head_len, coverage=cover,
                          objective_s=expected_latency(problem, hosts), native_latency_s=native_latency(problem, hosts),
                          plan_seconds=time.perf_counter() - start)


def native_latency(problem: PlanProblem, hosts: np.ndarray) -> float:
    """Expected per-token latency if each run of consecutive layers on one node costs one round trip.

    Per user: layers on the own device cost compute only; otherwise each layer goes to the fastest node
    holding the whole layer (edge server, or the cloud). A round trip is paid when the serving node
    changes between consecutive layers (and to leave home), compute is paid per layer (slowest expert).
    """
    model = slim_model(problem)
    comm = np.asarray(problem.comm_s)
    compute = np.asarray(problem.compute_s).max(axis=2)  # [N, L] slowest expert of a layer on a node
    kinds = np.array(problem.node_kind)
    whole = hosts.all(axis=2) | (kinds == "cloud")[:, None]  # [N, L]
    total = 0.0
    for u in range(model.num_users):
        usable = np.isfinite(comm[u]) & ((kinds != "device") | (np.arange(len(kinds)) == problem.user_home[u]))
        cost = np.where(whole & usable[:, None], comm[u][:, None] + compute, np.inf)  # [N, L]
        node = cost.argmin(axis=0)  # [L]
        home = problem.user_home[u]
        latency = sum(compute[node[layer], layer] for layer in range(node.size))
        previous = home
        for layer in range(node.size):
            if node[layer] != previous and node[layer] != home:
                latency += comm[u, node[layer]]
            previous = node[layer]
        total += model.weight[u] * latency
    return float(total)
