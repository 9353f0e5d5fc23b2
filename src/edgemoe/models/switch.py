"""Switch Transformers: encoder-decoder, top-1 softmax routing, one module per expert.

The router's output is a one-hot dispatch mask [.., E] and the max probability; tokens over an
expert's capacity get an all-zero row. edgemoe raises the capacity so that no token is dropped at
inference (capacity dropping is a training-time device), see `disable_capacity`.
MoE layers are counted encoder first, then decoder.
"""

import torch

from .base import MoEAdapter


class SwitchAdapter(MoEAdapter):
    family = "switch_transformers"
    model_types = ("switch_transformers",)
    router_attr = "router"
    normalizes_topk = False

    def _sparse_mlps(self):
        out = []
        for stack_name in ("encoder", "decoder"):
            stack = getattr(self.model, stack_name)
            for i, block in enumerate(stack.block):
                mlp = block.layer[-1].mlp
                if hasattr(mlp, "experts"):
                    out.append((f"{stack_name}.{i}", mlp))
        return out

    def _moe_blocks(self):
        return [mlp for _, mlp in self._sparse_mlps()]

    def _moe_layer_ids(self):
        n_enc = len(self.model.encoder.block)
        return [int(name.split(".")[1]) + (n_enc if name.startswith("decoder") else 0) for name, _ in self._sparse_mlps()]

    def disable_capacity(self, max_tokens: int = 1 << 30) -> None:
        """No token dropping at inference: capacity larger than any batch."""
        for block in self.blocks:
            block.router.expert_capacity = max_tokens

    @property
    def num_experts(self) -> int:
        return int(self.config.num_experts)

    @property
    def top_k(self) -> int:
        return 1

    def route(self, layer, router_logits):
        probs = self.scores(layer, router_logits)
        gates, topk = probs.max(dim=-1, keepdim=True)
        return topk, gates.to(router_logits.dtype)

    def _router_logits_from_output(self, output):
        return output[2].reshape(-1, self.num_experts)

    def _to_canonical(self, index, weights):
        mask = index.reshape(-1, self.num_experts)  # one-hot rows; all-zero where dropped by capacity
        topk = torch.where(mask.sum(-1) > 0, mask.argmax(-1), torch.full_like(mask[:, 0], -1))
        return topk[:, None].long(), weights.reshape(-1, 1)

    def _from_canonical(self, topk, gates, index, weights):
        onehot = torch.nn.functional.one_hot(topk[:, 0], self.num_experts).to(index.dtype)
        return onehot.view_as(index), gates.reshape(weights.shape).to(weights.dtype)

    def _experts_call_args(self, topk, gates):
        onehot = torch.nn.functional.one_hot(topk[:, 0], self.num_experts)
        return onehot[:, None, :], gates[:, :1]

    @torch.no_grad()
    def forward_logits(self, input_ids):
        """Decoder logits with the text fed to both encoder and (shifted) decoder."""
        return self.model(input_ids=input_ids, decoder_input_ids=self.model._shift_right(input_ids)).logits
