"""Tiny random-weight models of every supported family, built from configs (no download).

Used by the tests and by end-to-end CLI checks: each has a few MoE layers (and, where the family has
them, dense layers and shared experts) so every quirk of the adapter is exercised.
"""

from __future__ import annotations

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "switch_transformers")

TINY_VOCAB = 300  # 256 byte symbols + a few BPE merges, so a real byte-level tokenizer fits

_COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_config(family: str):
    """A small config of `family`: 3-4 layers, 8 experts, top-2 (Switch: top-1)."""
    import transformers as tf

    if family == "mixtral":
        return tf.MixtralConfig(**_COMMON, intermediate_size=48, num_hidden_layers=3, num_local_experts=8,
                                num_experts_per_tok=2)
    if family == "qwen2_moe":
        # Layer 1 is dense (mlp_only_layers), the others sparse with a gated shared expert.
        return tf.Qwen2MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=24,
                                 shared_expert_intermediate_size=40, num_hidden_layers=4, num_experts=8,
                                 num_experts_per_tok=2, mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=False)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(**_COMMON, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=8)
    if family == "olmoe":
        return tf.OlmoeConfig(**{**_COMMON, "num_key_value_heads": 4}, intermediate_size=24, num_hidden_layers=3,
                              num_experts=8, num_experts_per_tok=2)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4,
            topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, max_position_embeddings=128,
        )
    if family == "switch_transformers":
        return tf.SwitchTransformersConfig(
            vocab_size=TINY_VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=4, num_decoder_layers=4, num_heads=4,
            num_experts=8, encoder_sparse_step=2, decoder_sparse_step=2, expert_capacity=4,
            relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random-weight HF model of `family` in eval mode. Biases of DeepSeek's router are randomised so
    that the selection-only bias matters."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(family)
    cls = tf.SwitchTransformersForConditionalGeneration if family == "switch_transformers" else tf.AutoModelForCausalLM
    model = cls(config) if cls is not tf.AutoModelForCausalLM else cls.from_config(config)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
        for name, p in model.named_parameters():
            if "gate" in name or "router" in name:  # sharper routing than the default init gives
                p.mul_(4.0) if p.abs().sum() > 0 else p.normal_(0, 0.5)
    return model.to(dtype).eval()


def tiny_tokenizer():
    """A byte-level BPE tokenizer with TINY_VOCAB entries, trained on a few stdlib docstrings."""
    from edgemoe.data import stdlib_docs

    from .train import train_tokenizer

    return train_tokenizer([stdlib_docs()], TINY_VOCAB, chars_per_domain=50_000)


def save_tiny(family: str, path, seed: int = 0):
    """Write a tiny model of `family` and its tokenizer as an HF folder at `path`; return the path."""
    from pathlib import Path

    path = Path(path)
    tiny_model(family, seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path
