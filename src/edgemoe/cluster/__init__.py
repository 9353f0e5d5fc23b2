"""Clusters: nodes, links and users from a file or preset, and the cost model (numpy core, no torch)."""

from .cost import (
    layer_s,
    local_call_s,
    migration_s,
    mm1_wait_s,
    node_compute_s,
    plan_problem,
    remote_call_s,
    roofline_s,
    round_trip_s,
    traffic_bytes,
    transfer_s,
)
from .hardware import Compute
from .presets import PRESETS, generate
from .schema import Cluster, Link, Node, User, build_cluster, load_cluster, validate_for_model

__all__ = [
    "PRESETS", "Cluster", "Compute", "Link", "Node", "User", "build_cluster", "generate", "layer_s",
    "load_cluster", "local_call_s", "migration_s", "mm1_wait_s", "node_compute_s", "plan_problem", "remote_call_s",
    "roofline_s", "round_trip_s", "traffic_bytes", "transfer_s", "validate_for_model",
]
