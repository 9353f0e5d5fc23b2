"""The dense part's cost (issue 12, item 5): the backbone's FLOPs and weight bytes per pass, counted on a
model or estimated from a profile. `RuntimeContext.dense_s` turns them into nominal seconds on a node's
hardware (the roofline of `edgemoe.cluster.cost`); both backends charge them (docs/runtime.md, "Dense part").
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


def dense_cost_of_model(adapter) -> DenseCost:
    """The backbone of a loaded MoEAdapter, counted: every parameter outside the routed experts' modules,
    less an untied input embedding (a lookup)."""
    expert = {id(p) for block in adapter.blocks for p in block.experts.parameters()}
    model = adapter.model
    params = {id(p): p for p in model.parameters() if id(p) not in expert}  # tied weights once
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inp is not None and (out is None or out.weight is not inp.weight):
        params.pop(id(inp.weight), None)
    n = sum(p.numel() for p in params.values())
    itemsize = adapter.expert_bytes()[0, 0] / max(adapter.expert_params()[0, 0], 1)  # storage bytes per parameter
    return DenseCost(flops_per_token=2.0 * n, bytes=float(n * itemsize), source="model")


def dense_cost_estimate(profile) -> DenseCost:
    """A backbone estimate from the profile alone (no model at hand: synthetic profiles, traces): per MoE
    layer 4 H^2 attention parameters (q, k, v, o) and H x E for the router, at the experts' bytes per
    parameter; no LM head (the vocabulary is not in the profile)."""
    H, L, E = profile.meta.hidden_size, profile.L, profile.E
    n = L * (4 * H * H + H * E)
    itemsize = float(profile.expert_bytes[0, 0]) / max(float(profile.expert_flops[0, 0]) / 2.0, 1.0)
    return DenseCost(flops_per_token=2.0 * n, bytes=n * itemsize, source="estimate")
