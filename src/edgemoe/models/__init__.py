"""HF MoE models behind one adapter: facts, routing, and expert-level interventions."""

from .base import Intervention, LayerCall, MoEAdapter, apply_intervention
from .loader import ADAPTERS, adapter_for, checkpoint_digest, default_model_path, load_moe, load_tokenizer

__all__ = [
    "ADAPTERS", "Intervention", "LayerCall", "MoEAdapter", "adapter_for", "apply_intervention",
    "checkpoint_digest", "default_model_path", "load_moe", "load_tokenizer",
]
