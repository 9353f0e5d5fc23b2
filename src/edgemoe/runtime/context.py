"""What a runtime policy and the simulator know about one deployment, as arrays (pure numpy).

`context_from_problem(problem, placement)` turns a planning problem (the one join of the routing profile
and the cluster, `edgemoe.plan.problem.plan_problem`) and a placement into a frozen `RuntimeContext`;
`make_context(profile, cluster, placement)` makes the problem first. N nodes, U users, L MoE layers,
E experts, S substitutes. Decisions in docs/runtime.md ("Context").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgemoe.cluster.cost import node_compute_s, roofline_s, transfer_s, usable_nodes
from edgemoe.cluster.load import load_cluster
from edgemoe.cluster.schema import Cluster
from edgemoe.errors import EdgeMoEError

MODES = ("migrate", "home")


@dataclass(frozen=True)
class RuntimeContext:
    """Arrays every policy and backend reads. Shapes as in ARCHITECTURE.md."""

    node_names: tuple[str, ...]  # [N]
    node_kind: tuple[str, ...]  # [N] "device" | "edge" | "cloud"
    is_cloud: np.ndarray  # [N] bool
    lat_s: np.ndarray  # [N, N] one-way latency of the closure's path (0 on the diagonal)
    bw_Bps: np.ndarray  # [N, N] bottleneck bandwidth (inf on the diagonal)
    xfer_s: np.ndarray  # [N, N] seconds to move one hidden state (wire_bytes) one way; 0 on the diagonal
    compute_s: np.ndarray  # [N, L, E] roofline seconds of one expert call carrying one token
    peak_flops: np.ndarray  # [N] roofline parameters, for batched calls (`call_s`)
    mem_bw_Bps: np.ndarray  # [N]
    overhead_s: np.ndarray  # [N]
    expert_flops: np.ndarray  # [L, E]
    expert_bytes: np.ndarray  # [L, E]
    hosts: np.ndarray  # [N, L, E] bool, cloud rows all True
    usable: np.ndarray  # [U, N] bool: node n may serve user u (a device serves only its own user)
    hidden_bytes: int  # the profile's hidden state bytes (one token, one direction)
    wire_bytes: int  # bytes actually put on the wire per hidden-state transfer (default hidden_bytes)
    mode: str  # "migrate" | "home"
    freq: np.ndarray  # [L, E]
    trans: np.ndarray  # [L-1, E, E]
    subst_err: np.ndarray  # [L, E, E]
    groups: object  # edgemoe.profile.groups.SimilarityGroups
    best_sub: np.ndarray  # [N, L, E] int: best-ranked substitute of (l, e) that node n holds, -1 if none
    best_sub_err: np.ndarray  # [N, L, E] its measured substitution error (inf if none)
    user_names: tuple[str, ...]  # [U]
    user_home: np.ndarray  # [U] int node index
    user_weight: np.ndarray  # [U] float, sums to 1
    user_domain: np.ndarray  # [U] int index into profile domains
    profile_topk: np.ndarray  # [T, L, K] calibration routing (look-ahead set statistics)
    profile_gates: np.ndarray  # [T, L, K]
    placement_method: str = ""
    cluster_name: str = ""
    # the budget the placement was planned for (Placement.budget; None: its planner has none): the default
    # budget of every policy that spends one (`runtime.make_policy`)
    placement_budget: float | None = None
    # The dense part (docs/runtime.md, "Dense part"): per MoE layer, the backbone's FLOPs per token and weight
    # bytes (the whole backbone spread evenly over the L MoE layers). "off": the dense part takes no time.
    dense_flops: float = 0.0
    dense_bytes: float = 0.0
    dense_source: str = "off"  # "model" | "estimate" | "off"

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    @property
    def num_layers(self) -> int:
        return int(self.compute_s.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.compute_s.shape[2])

    @property
    def top_k(self) -> int:
        return int(self.profile_topk.shape[2])

    @property
    def num_users(self) -> int:
        return len(self.user_names)

    @property
    def round_trip_s(self) -> np.ndarray:
        """[N, N] seconds to send one hidden state i -> j and back."""
        return self.xfer_s + self.xfer_s.T

    def call_s(self, node, layer, expert, tokens=1) -> np.ndarray:
        """[...] roofline seconds of one call of (layer, expert) on `node` carrying `tokens` tokens."""
        node = np.asarray(node)
        return roofline_s(self.expert_flops[layer, expert], self.expert_bytes[layer, expert],
                          self.peak_flops[node], self.mem_bw_Bps[node], self.overhead_s[node], tokens)

    @property
    def dense_on(self) -> bool:
        return self.dense_source != "off"

    def dense_s(self, node, rows=1) -> np.ndarray:
        """[...] nominal seconds of one MoE layer's dense work (attention, norms, router, its share of the
        embeddings and LM head) for a pass of `rows` rows on `node`'s hardware: one call overhead plus the
        roofline of the backbone's per-layer share (its weights read once for all rows); 0 when off."""
        node = np.asarray(node)
        if not self.dense_on:
            return np.zeros(np.broadcast_shapes(node.shape, np.shape(rows)))
        return roofline_s(self.dense_flops, self.dense_bytes, self.peak_flops[node], self.mem_bw_Bps[node],
                          self.overhead_s[node], rows)

    def median_round_trip_s(self) -> float:
        """Median round trip between distinct non-device nodes (the scale of one remote call)."""
        keep = np.array([k != "device" for k in self.node_kind])
        rt = self.round_trip_s[np.ix_(keep, keep)]
        off = rt[~np.eye(rt.shape[0], dtype=bool)]
        if off.size == 0:
            rt = self.round_trip_s
            off = rt[~np.eye(rt.shape[0], dtype=bool)]
        return float(np.median(off)) if off.size else 0.0


def make_context(
    profile,
    cluster: Cluster | str,
    placement,
    mode: str = "migrate",
    groups=None,
    wire_bytes: int | None = None,
    domain_fallback: bool = False,
    dense=True,
) -> RuntimeContext:
    """The RuntimeContext of `placement` (edgemoe.plan.base.Placement) on `cluster` for `profile`: their planning
    problem (`edgemoe.plan.problem.plan_problem`, the one place profile and cluster are joined), then
    `context_from_problem`. Callers that already hold the problem (the planners' one) pass it there directly.

    domain_fallback: map cluster domains the profile lacks round-robin (synthetic profiles). The other
    arguments are `context_from_problem`'s.
    """
    from edgemoe.plan.problem import plan_problem

    if mode not in MODES:
        raise EdgeMoEError(f"mode={mode!r}; expected one of {list(MODES)}")
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster)
    problem = plan_problem(profile, cluster, domain_fallback=domain_fallback)
    return context_from_problem(problem, placement, mode=mode, groups=groups, wire_bytes=wire_bytes, dense=dense)


def context_from_problem(problem, placement, mode: str = "migrate", groups=None, wire_bytes: int | None = None,
                         dense=True) -> RuntimeContext:
    """Build the RuntimeContext of `placement` for a planning problem (edgemoe.plan.base.PlanProblem made by
    `plan_problem`): its profile, its users (homes, weights, domains) and its nodes as the planner saw them,
    with links and hardware from the cluster it carries.

    mode: "migrate" (the token continues from the server that ran its expert) or "home" (round trips).
    groups: SimilarityGroups (default: the grouping the placement was planned with, `placement_groups`).
    wire_bytes: bytes of one hidden-state transfer (default profile.meta.hidden_bytes).
    dense: the backbone's cost (edgemoe.runtime.dense.DenseCost, e.g. `dense_cost_of_model(adapter)`); True
    (default): estimated from the profile's shapes (`dense_cost_estimate`); False: the dense part takes no
    time.
    """
    from edgemoe.plan.base import check_placement_matches

    from .dense import DenseCost, dense_cost_estimate

    if mode not in MODES:
        raise EdgeMoEError(f"mode={mode!r}; expected one of {list(MODES)}")
    profile, cluster = problem.profile, problem.cluster
    if not isinstance(cluster, Cluster):
        raise EdgeMoEError("the planning problem carries no cluster (it was built from arrays, not by plan_problem): "
                           "a runtime context needs the cluster's links and hardware")
    L, E = profile.L, profile.E
    check_placement_matches(placement, problem.node_names, (L, E), f"placement on cluster {cluster.name!r}",
                            profile.meta.model)
    if dense is True:
        dense = dense_cost_estimate(profile)
    elif dense is not False and not isinstance(dense, DenseCost):
        raise EdgeMoEError(f"dense={dense!r}; expected True, False or a DenseCost")
    wire = int(profile.meta.hidden_bytes if wire_bytes is None else wire_bytes)
    if wire <= 0:
        raise EdgeMoEError(f"wire_bytes must be > 0, got {wire}")
    groups = placement_groups(profile, placement) if groups is None else groups
    is_cloud = problem.is_cloud
    hosts = np.asarray(placement.hosts, dtype=bool).copy()
    hosts[is_cloud] = True
    home = np.asarray(problem.user_home)
    usable = usable_nodes(problem.node_kind, home)
    _check_reachable(hosts, usable, problem.user_names)
    xfer = transfer_s(wire, cluster.lat_s, cluster.bw_Bps)
    np.fill_diagonal(xfer, 0.0)
    best_sub, best_err = best_local_substitutes(hosts, groups.substitute_ids, profile.subst_err)
    arrays = dict(
        is_cloud=is_cloud, lat_s=np.asarray(cluster.lat_s, float), bw_Bps=np.asarray(cluster.bw_Bps, float), xfer_s=xfer,
        compute_s=node_compute_s(cluster, profile.expert_flops, profile.expert_bytes, 1),
        peak_flops=np.array([n.compute.peak_flops for n in cluster.nodes], float),
        mem_bw_Bps=np.array([n.compute.mem_bw_Bps for n in cluster.nodes], float),
        overhead_s=np.array([n.compute.overhead_s for n in cluster.nodes], float),
        expert_flops=np.asarray(profile.expert_flops, float), expert_bytes=np.asarray(profile.expert_bytes, float),
        hosts=hosts, usable=usable, freq=np.asarray(profile.freq, float), trans=np.asarray(profile.trans, float),
        subst_err=np.asarray(profile.subst_err, float), best_sub=best_sub, best_sub_err=best_err,
        user_home=home.copy(), user_weight=np.asarray(problem.user_weight, float).copy(),
        user_domain=np.asarray(problem.user_domain).copy(),
        profile_topk=np.asarray(profile.topk, np.int64), profile_gates=np.asarray(profile.gates, float),
    )
    for a in arrays.values():
        a.setflags(write=False)
    return RuntimeContext(
        node_names=tuple(problem.node_names), node_kind=tuple(problem.node_kind),
        hidden_bytes=int(profile.meta.hidden_bytes), wire_bytes=wire, mode=mode, groups=groups,
        user_names=tuple(problem.user_names), placement_method=placement.method, cluster_name=cluster.name,
        placement_budget=getattr(placement, "budget", None),
        dense_flops=float(dense.flops_per_token) / L if dense else 0.0, dense_bytes=float(dense.bytes) / L if dense else 0.0,
        dense_source=dense.source or "given" if dense else "off", **arrays,
    )


def placement_groups(profile, placement):
    """The SimilarityGroups `placement` was planned with (Placement.grouping, rebuilt from `profile`); OrderMoE's
    layer-aware grouping (`groups_for(profile)`) for a placement whose planner groups nothing."""
    from edgemoe.profile.groups import groups_for

    g = getattr(placement, "grouping", None)
    return groups_for(profile) if g is None else groups_for(profile, g["kind"], **g["params"])


def _check_reachable(hosts: np.ndarray, usable: np.ndarray, user_names: tuple[str, ...]) -> None:
    """Every user must reach a copy of every expert (else no policy can run the model exactly)."""
    reach = np.einsum("un,nle->ule", usable.astype(np.int64), hosts.astype(np.int64)) > 0  # [U, L, E]
    bad = np.argwhere(~reach)
    if len(bad):
        u, layer, e = bad[0]
        raise EdgeMoEError(f"placement leaves expert (layer {layer}, expert {e}) out of reach of user "
                           f"{user_names[u]!r} ({len(bad)} (user, expert) pairs in all): no node it may use holds it")


def best_local_substitutes(hosts: np.ndarray, substitute_ids: np.ndarray, subst_err: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([N, L, E] int, [N, L, E] float): the best-ranked substitute of (l, e) held by node n, and its error.

    hosts: [N, L, E]; substitute_ids: [L, E, S] ranked (best first), -1 padded; subst_err: [L, E, E].
    Ranking is the groups' (lowest measured error first); -1 / inf where node n holds no group member.
    """
    N, L, E = hosts.shape
    S = substitute_ids.shape[2]
    if S == 0:
        return np.full((N, L, E), -1, np.int64), np.full((N, L, E), np.inf)
    ids = np.asarray(substitute_ids, dtype=np.int64)
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    layer_idx = np.arange(L)[:, None, None]
    held = hosts[:, layer_idx, safe] & valid[None]  # [N, L, E, S]
    has = held.any(axis=3)
    first = held.argmax(axis=3)  # first True = best ranked
    sub = np.where(has, np.take_along_axis(np.broadcast_to(safe, held.shape), first[..., None], 3)[..., 0], -1)
    err = np.where(has, np.asarray(subst_err)[np.arange(L)[:, None], np.arange(E)[None, :], np.maximum(sub, 0)], np.inf)
    return sub.astype(np.int64), err.astype(float)
