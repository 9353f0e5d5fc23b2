"""The planning problem of a profile on a cluster: the one place where the two meet.

Data flows profile -> cluster -> plan: the cluster layer turns the model's expert sizes, FLOPs and hidden
size into cost tables of plain arrays (`edgemoe.cluster.cost.cost_tables`), and this module joins them with
the profile's routing statistics into the `PlanProblem` every planner sees.
"""

from __future__ import annotations

import numpy as np

from edgemoe.cluster.cost import cost_tables, node_compute_s, user_domain_index
from edgemoe.cluster.load import load_cluster
from edgemoe.cluster.schema import Cluster
from edgemoe.profile import Profile
from edgemoe.profile.dense import dense_cost_estimate

from .base import PlanProblem


def plan_problem(profile: Profile, cluster: Cluster | str, tokens_per_call: int = 1, queueing: bool = True,
                 domain_fallback: bool = False) -> PlanProblem:
    """The PlanProblem a planner sees for `profile` on `cluster` (a Cluster, or a file path / preset name).

    - capacity_bytes [N]: memory / memory_fraction resolved against the profile's expert bytes (cloud:
      all of them); checked by `validate_for_model`.
    - compute_s [N, L, E]: roofline time of one call carrying `tokens_per_call` tokens (the latency each
      of those tokens sees).
    - comm_s [U, N]: round trip of `tokens_per_call` hidden states (profile.meta.hidden_bytes each) from
      the user's home to node n over the shortest-latency path; 0 at home. With `queueing` and any
      node utilisation > 0, the node's M/M/1 wait is added for n != home, so comm_s + compute_s is
      exactly the remote-call latency and a local call stays compute only.
    - xfer_s [N, N]: one-way seconds of the same hidden states between any two nodes (no queue; the
      `migrate` mode's hops).
    - dense_s [N]: roofline seconds of one MoE layer's dense work (the backbone's 1/L share) for one token
      on each node, from `dense_cost_estimate(profile)`: what the runtime charges by default on a token's home
      (`make_context(dense=True)`); the same on every placement, it only moves the planner's absolute latency.
    - user_weight [U] normalised; user_domain [U] index into profile.meta.domains (`domain_fallback`:
      see `edgemoe.cluster.cost.user_domain_index`).
    - cluster: the Cluster itself, so that the runtime's context is built from this same join
      (`edgemoe.runtime.context.context_from_problem`) instead of joining profile and cluster again.
    """
    if not isinstance(cluster, Cluster):
        cluster = load_cluster(cluster)
    tables = cost_tables(cluster, profile.expert_bytes, profile.expert_flops, profile.meta.hidden_bytes,
                         freq=profile.freq, tokens_per_call=tokens_per_call, queueing=queueing)
    domain_index, domain_map = user_domain_index(cluster, profile.meta.domains, domain_fallback)
    dense = dense_cost_estimate(profile)
    L = max(int(profile.expert_bytes.shape[0]), 1)
    dense_s = node_compute_s(cluster, [[dense.flops_per_token / L]], [[dense.bytes / L]])[:, 0, 0]
    return PlanProblem(
        profile=profile, node_names=cluster.node_names, node_kind=cluster.node_kind,
        capacity_bytes=tables.capacity_bytes, user_names=cluster.user_names, user_home=cluster.user_home,
        user_weight=cluster.user_weight, user_domain=domain_index, comm_s=tables.comm_s,
        compute_s=tables.compute_s, expert_bytes=np.asarray(profile.expert_bytes, dtype=np.int64),
        xfer_s=tables.xfer_s, dense_s=dense_s, cluster=cluster,
        params={"cluster": cluster.name, "cluster_source": cluster.source, "tokens_per_call": tokens_per_call,
                "hidden_bytes": int(profile.meta.hidden_bytes),
                "queue_s": dict(zip(cluster.node_names, tables.queue_s.tolist(), strict=True)),
                "domain_map": domain_map},
    )
