"""The dense part's cost: the backbone's FLOPs and weight bytes per pass, counted on a
model or estimated from a profile. `RuntimeContext.dense_s` turns them into nominal seconds on a node's
hardware (the roofline of `edgemoe.cluster.cost`); both backends charge them (docs/runtime.md, "Dense part").
"""

from __future__ import annotations

from edgemoe.profile.dense import DenseCost, dense_cost_estimate  # the record and the profile-only estimate

__all__ = ["DenseCost", "dense_cost_estimate", "dense_cost_of_model"]


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
