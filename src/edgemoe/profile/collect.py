"""Record a routing profile by running a real model on calibration text (torch side of profiling)."""

from __future__ import annotations

import platform
from collections.abc import Sequence

import numpy as np
import torch

from edgemoe.data import TokenBlocks
from edgemoe.models import MoEAdapter

from .store import Profile, ProfileMeta, build_profile


@torch.no_grad()
def substitution_error(adapter: MoEAdapter, layer: int, hidden: torch.Tensor, topk: torch.Tensor,
                       min_tokens: int = 8) -> np.ndarray:
    """Measured relative output error of running e' in place of e at one MoE layer.

    hidden: [T, H] calibration inputs of the layer's experts; topk: [T, K] their routed experts.
    err[e, e'] = ||Y_e' - Y_e|| / ||Y_e|| over the tokens routed to e (all T tokens when fewer than
    `min_tokens` were), Y_e being expert e's output. Returns [E, E] with a zero diagonal.
    """
    E = adapter.num_experts
    outs = torch.stack([adapter.expert_output(layer, e, hidden).double() for e in range(E)])  # [E, T, H]
    sq = (outs * outs).sum(-1)  # [E, T]
    gram = torch.einsum("eth,fth->tef", outs, outs)  # [T, E, E]
    dist2 = (sq.T[:, :, None] + sq.T[:, None, :] - 2 * gram).clamp_min(0)  # [T, E, E] ||Y_e - Y_f||^2
    routed = torch.zeros(E, hidden.shape[0], dtype=torch.float64)
    routed[topk.T.reshape(-1).long(), torch.arange(hidden.shape[0]).repeat(topk.shape[1])] = 1.0
    few = routed.sum(1) < min_tokens
    routed[few] = 1.0
    num = torch.einsum("et,tef->ef", routed, dist2)
    den = (routed * sq).sum(1, keepdim=True).clamp_min(1e-30)
    err = (num / den).sqrt().numpy()
    np.fill_diagonal(err, 0.0)
    return err


@torch.no_grad()
def collect_profile(
    adapter: MoEAdapter,
    blocks: TokenBlocks,
    model_name: str,
    data_name: str,
    batch_size: int = 16,
    subst_tokens: int = 1024,
    wire_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    progress: bool = True,
) -> Profile:
    """Run `adapter` over `blocks` (ids [B, S]) and build a Profile.

    Router logits, Top-K and gates are recorded for every token at every MoE layer; `subst_tokens`
    tokens per layer (a seeded random sample) keep their hidden states for the substitution error.
    """
    from edgemoe.progress import bar as progress_bar

    L, K = adapter.num_layers, adapter.top_k
    logits: list[list[torch.Tensor]] = [[] for _ in range(L)]
    topks: list[list[torch.Tensor]] = [[] for _ in range(L)]
    gates: list[list[torch.Tensor]] = [[] for _ in range(L)]
    rng = np.random.default_rng(seed)
    B, S = blocks.ids.shape
    sample = np.sort(rng.choice(B * S, size=min(subst_tokens, B * S), replace=False))
    kept_hidden: list[list[torch.Tensor]] = [[] for _ in range(L)]
    offset = [0]

    def rec(call):
        logits[call.layer].append(call.router_logits.float().cpu())
        topks[call.layer].append(call.topk.cpu())
        gates[call.layer].append(call.gates.float().cpu())
        n = call.hidden.shape[0]
        lo = np.searchsorted(sample, offset[0])
        hi = np.searchsorted(sample, offset[0] + n)
        if hi > lo:
            kept_hidden[call.layer].append(call.hidden[torch.from_numpy(sample[lo:hi] - offset[0])].float().cpu())

    bar = progress_bar(total=B * S, unit="tok", desc="profile")  # drawn on a terminal only
    bar.disable = bar.disable or not progress
    with adapter.record(rec):
        for i in range(0, B, batch_size):
            x = torch.from_numpy(blocks.ids[i:i + batch_size])
            offset[0] = i * S
            adapter.forward_logits(x)
            bar.update(x.numel())
    bar.close()

    router_logits = np.stack([torch.cat(v).numpy() for v in logits], axis=1)  # [T, L, E]
    topk = np.stack([torch.cat(v).numpy() for v in topks], axis=1)  # [T, L, K]
    gate = np.stack([torch.cat(v).numpy() for v in gates], axis=1)
    sample_topk = torch.from_numpy(topk[sample])
    subst = np.stack([
        substitution_error(adapter, layer, torch.cat(kept_hidden[layer]).to(adapter.compute_dtype), sample_topk[:, layer])
        for layer in range(L)
    ])
    domain = np.repeat(blocks.domain, S)
    meta = ProfileMeta(
        model=model_name, family=adapter.family, weights_hash=adapter.weights_hash(), num_layers=L,
        num_experts=adapter.num_experts, top_k=K, hidden_size=adapter.hidden_size,
        hidden_bytes=adapter.hidden_size * torch.empty((), dtype=wire_dtype).element_size(),
        wire_dtype=str(wire_dtype).replace("torch.", ""), moe_layer_ids=list(adapter.moe_layer_ids),
        domains=list(blocks.domains), data=data_name, num_tokens=int(B * S),
        versions=_versions(),
    )
    return build_profile(meta, router_logits, topk, gate, domain, subst, adapter.expert_bytes(), adapter.expert_flops())



def _versions() -> dict:
    import transformers

    import edgemoe

    return {"edgemoe": edgemoe.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__}


def profile_blocks_for(sources: Sequence, tokenizer, num_tokens: int, block_len: int = 256):
    """Tokenise `sources` into blocks giving about `num_tokens` tokens split evenly across sources."""
    from edgemoe.data import tokenize_blocks

    per_source = max(block_len, num_tokens // max(len(sources), 1))
    return tokenize_blocks(sources, tokenizer, block_len, max_tokens_per_source=per_source)
