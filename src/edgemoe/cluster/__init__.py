"""Clusters: nodes, links and users from a file or preset, and the cost model (numpy core, no torch).

Nothing here knows a planner: `cost_tables` gives plain arrays and `edgemoe.plan.plan_problem` builds the
planning problem from them. Inside the package imports run one way: load -> presets -> schema, cost -> schema.
"""

from .cost import (
    CostTables,
    cost_tables,
    layer_s,
    local_call_s,
    migration_s,
    mm1_wait_s,
    node_compute_s,
    remote_call_s,
    roofline_s,
    round_trip_s,
    traffic_bytes,
    transfer_s,
)
from .hardware import Compute
from .load import load_cluster, read_cluster_file
from .presets import PRESETS, generate
from .schema import Cluster, Link, Node, User, build_cluster, validate_for_model

__all__ = [
    "PRESETS", "Cluster", "Compute", "CostTables", "Link", "Node", "User", "build_cluster", "cost_tables",
    "generate", "layer_s", "load_cluster", "local_call_s", "migration_s", "mm1_wait_s", "node_compute_s",
    "read_cluster_file", "remote_call_s", "roofline_s", "round_trip_s", "traffic_bytes", "transfer_s",
    "validate_for_model",
]
