"""Loading from folders, and one clear error for every bad model input."""

import pytest
import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.models import load_moe
from edgemoe.models.tiny import save_tiny, tiny_model


def test_load_saved_folder_roundtrip(tmp_path):
    path = save_tiny("qwen2_moe", tmp_path / "q")
    adapter = load_moe(str(path))
    assert adapter.family == "qwen2_moe" and adapter.moe_layer_ids == [0, 2, 3]
    x = torch.randint(1, 300, (1, 9))
    ref = tiny_model("qwen2_moe")(input_ids=x).logits
    assert (adapter.forward_logits(x) - ref).abs().max() <= 1e-5


def test_missing_path(tmp_path):
    with pytest.raises(EdgeMoEError, match="does not exist"):
        load_moe(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(EdgeMoEError, match="no config.json"):
        load_moe(str(tmp_path))


def test_dense_checkpoint_is_rejected(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with pytest.raises(EdgeMoEError, match="not a supported MoE family"):
        load_moe(str(tmp_path / "llama"))


def test_moe_family_without_experts_is_rejected(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, num_experts=4, mlp_only_layers=[0, 1])
    Qwen2MoeForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    with pytest.raises(EdgeMoEError, match="no MoE layers"):
        load_moe(str(tmp_path / "dense"))
