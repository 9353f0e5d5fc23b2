"""Mixtral: softmax over E experts, top-K, gates renormalised over the chosen K."""

from .base import MoEAdapter


class MixtralAdapter(MoEAdapter):
    family = "mixtral"
    model_types = ("mixtral",)

    @property
    def num_experts(self) -> int:
        return int(self.config.num_local_experts)

    @property
    def top_k(self) -> int:
        return int(self.config.num_experts_per_tok)
