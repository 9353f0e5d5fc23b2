"""The dense part's cost: the backbone's FLOPs and weight bytes per pass, as a record and
as an estimate from a profile's shapes alone. It sits with the profile so that the planner (which may not
import the runtime, tests/test_layers.py) prices the same dense part the runtime charges by default;
`edgemoe.runtime.dense` re-exports both and counts them on a loaded model (docs/runtime.md, "Dense part").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DenseCost:
    """The backbone's work for one token through the whole model (one pass), as the roofline needs it.

    flops_per_token: 2 x the backbone's matmul parameters (attention projections, router, norms, shared
    experts, dense FFN layers, LM head); bytes: the same parameters' bytes in the storage dtype, read once per
    pass whatever its row count (the input embedding is a lookup of one row per token: not counted, unless it
    is tied to the LM head, which reads it whole). Attention scores over the context and KV-cache reads are
    not counted (docs/runtime.md, "Dense part").
    """

    flops_per_token: float
    bytes: float
    source: str = ""  # "model" (counted on the checkpoint) or "estimate" (from the profile's shapes)


def dense_cost_estimate(profile) -> DenseCost:
    """A backbone estimate from the profile alone (no model at hand: synthetic profiles, traces): per MoE
    layer 4 H^2 attention parameters (q, k, v, o) and H x E for the router, at the experts' bytes per
    parameter; no LM head (the vocabulary is not in the profile)."""
    H, L, E = profile.meta.hidden_size, profile.L, profile.E
    n = L * (4 * H * H + H * E)
    itemsize = float(profile.expert_bytes[0, 0]) / max(float(profile.expert_flops[0, 0]) / 2.0, 1.0)
    return DenseCost(flops_per_token=2.0 * n, bytes=n * itemsize, source="estimate")
