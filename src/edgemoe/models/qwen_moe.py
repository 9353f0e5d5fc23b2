"""Qwen2-MoE, Qwen3-MoE and OLMoE: softmax, top-K, renormalised only when `norm_topk_prob`.

Qwen2-MoE adds an always-on shared expert with a sigmoid gate; it lives outside the routed experts
module, so it always runs where the token is and is counted as part of the dense backbone. Its dense
layers (`mlp_only_layers`, `decoder_sparse_step`) have no `.experts` and are skipped.
"""

from .base import MoEAdapter


class _SoftmaxTopK(MoEAdapter):
    @property
    def num_experts(self) -> int:
        return int(self.config.num_experts)

    @property
    def top_k(self) -> int:
        return int(self.config.num_experts_per_tok)

    @property
    def normalizes_topk(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.config, "norm_topk_prob", False))


class Qwen2MoeAdapter(_SoftmaxTopK):
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)


class Qwen3MoeAdapter(_SoftmaxTopK):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)


class OlmoeAdapter(_SoftmaxTopK):
    family = "olmoe"
    model_types = ("olmoe",)
