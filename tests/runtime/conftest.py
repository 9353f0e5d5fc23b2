"""Hand-built tiny deployments for runtime tests: two or three edge nodes with round-number costs."""

from __future__ import annotations

import numpy as np

from edgemoe.cluster.schema import build_cluster
from edgemoe.plan.base import Placement
from edgemoe.profile import ProfileMeta, build_profile
from edgemoe.profile.groups import threshold_groups
from edgemoe.runtime import make_context

HIDDEN = 1000  # bytes per hidden state on the wire
LINK_S = 0.010  # one-way latency of every link
BW = 1e6  # bytes/s: a hidden state takes 1 ms to serialise
XFER = LINK_S + HIDDEN / BW  # 0.011 s one way
CALL = 0.002  # every expert call: overhead 2 ms, compute and weight reads negligible


def tiny_cluster(nodes=("a", "b"), homes=("a",), latency: dict | None = None):
    """Edge nodes joined pairwise by 1 MB/s links of 10 ms (or `latency[(a, b)]`); users homed on `homes`."""
    latency = latency or {}
    compute = {"peak_flops": 1e30, "memory_bandwidth": 1e30, "overhead": CALL}
    return build_cluster({
        "name": "tiny",
        "nodes": [{"name": n, "kind": "edge", "memory": 10**9, "compute": compute} for n in nodes],
        "links": [{"src": a, "dst": b, "latency": latency.get((a, b), LINK_S), "bandwidth": BW}
                  for i, a in enumerate(nodes) for b in nodes[i + 1:]],
        "users": [{"name": f"u{i}", "home": h, "domain": "d0"} for i, h in enumerate(homes)],
    })


def tiny_profile(routes: np.ndarray, num_experts: int = 2, subst_err: float = 0.1, tokens: int = 8):
    """A profile whose every token picks `routes` [L, K] with equal gates; experts 2m and 2m+1 are similar."""
    routes = np.asarray(routes)
    L, K = routes.shape
    E = num_experts
    topk = np.broadcast_to(routes, (tokens, L, K)).copy()
    gates = np.full((tokens, L, K), 1.0 / K)
    logits = np.random.default_rng(0).normal(size=(tokens, L, E))
    err = np.full((L, E, E), 1.0)
    for e in range(0, E - 1, 2):
        err[:, e, e + 1] = err[:, e + 1, e] = subst_err
    err[:, np.arange(E), np.arange(E)] = 0.0
    meta = ProfileMeta(model="tiny", family="synthetic", weights_hash="tiny", num_layers=L, num_experts=E, top_k=K,
                       hidden_size=HIDDEN // 2, hidden_bytes=HIDDEN, wire_dtype="bfloat16", moe_layer_ids=list(range(L)),
                       domains=["d0"], num_tokens=tokens)
    return build_profile(meta, logits, topk, gates, np.zeros(tokens, np.int64), err,
                         np.full((L, E), 1000, np.int64), np.full((L, E), 1000, np.int64))


def pair_groups(profile):
    """Groups {0, 1}, {2, 3}, ... in every layer (similarity forced, independent of the random logits)."""
    L, E = profile.L, profile.E
    sim = np.zeros((L, E, E))
    for e in range(0, E - 1, 2):
        sim[:, e, e + 1] = sim[:, e + 1, e] = 0.9
    sim[:, np.arange(E), np.arange(E)] = 1.0
    return threshold_groups(sim, np.tile(np.arange(E, 0, -1), (L, 1)).astype(float), profile.subst_err,
                            np.full(L, 0.5))


def tiny_context(profile, cluster, held: dict, mode="home", groups=None, dense=False):
    """Context with `held` = {node name: [(layer, expert), ...]}; the dense part off unless asked (the
    hand-computed times here are the experts' and links')."""
    N, L, E = cluster.num_nodes, profile.L, profile.E
    hosts = np.zeros((N, L, E), bool)
    for name, pairs in held.items():
        for layer, e in pairs:
            hosts[cluster.node_index(name), layer, e] = True
    placement = Placement(method="hand", params={}, node_names=cluster.node_names,
                          capacity_bytes=np.full(N, 10**9, np.int64), hosts=hosts,
                          expert_bytes=np.asarray(profile.expert_bytes), node_kind=cluster.node_kind)
    return make_context(profile, cluster, placement, mode=mode, groups=groups, dense=dense)
