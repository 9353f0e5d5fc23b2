"""DeepSeek-V3: sigmoid scores, a selection-only bias, group-limited top-K, scaling factor, shared
experts (always on, part of the backbone) and dense first layers (`first_k_dense_replace`)."""

import torch

from .base import MoEAdapter


class DeepseekV3Adapter(MoEAdapter):
    family = "deepseek_v3"
    model_types = ("deepseek_v3",)

    @property
    def num_experts(self) -> int:
        return int(self.config.n_routed_experts)

    @property
    def top_k(self) -> int:
        return int(self.config.num_experts_per_tok)

    @property
    def normalizes_topk(self) -> bool:  # type: ignore[override]
        return bool(self.config.norm_topk_prob)

    def scores(self, layer: int, router_logits: torch.Tensor) -> torch.Tensor:
        return router_logits.float().sigmoid()

    def route(self, layer: int, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bias-corrected scores choose groups (sum of each group's top-2) then experts within them;
        the gate is the uncorrected sigmoid score, renormalised (if configured) and scaled."""
        cfg, E = self.config, self.num_experts
        scores = self.scores(layer, router_logits)
        bias = self.blocks[layer].gate.e_score_correction_bias.float()
        choice = scores + bias
        groups = choice.view(-1, cfg.n_group, E // cfg.n_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg.topk_group, dim=-1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(-1, cfg.n_group, E // cfg.n_group).reshape(-1, E).bool()
        topk = choice.masked_fill(~mask, float("-inf")).topk(self.top_k, dim=-1)[1]
        gates = scores.gather(1, topk)
        if cfg.norm_topk_prob:
            gates = gates / (gates.sum(dim=-1, keepdim=True) + 1e-20)
        return topk, gates * cfg.routed_scaling_factor
