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


def test_checkpoint_digest_names_the_weight_files_and_dtype_only(tmp_path):
    """The digest a served dial checks (edgemoe.serve.dial): the same for a copy of the folder, changed by one
    byte of a weight file or of config.json, or by the dtype; not by the tokenizer's files."""
    import shutil

    from edgemoe.models import checkpoint_digest

    a = save_tiny("mixtral", tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    base = checkpoint_digest(str(a), torch.float32)
    assert checkpoint_digest(str(b), torch.float32) == base and len(base) == 64
    assert checkpoint_digest(str(a), torch.bfloat16) != base
    (b / "tokenizer_config.json").write_text("{}")
    assert checkpoint_digest(str(b), torch.float32) == base
    weights = bytearray((b / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # the last byte of the last tensor's data
    (b / "model.safetensors").write_bytes(bytes(weights))
    assert checkpoint_digest(str(b), torch.float32) != base
    shutil.copy(a / "model.safetensors", b / "model.safetensors")
    assert checkpoint_digest(str(b), torch.float32) == base
    (b / "config.json").write_text((a / "config.json").read_text() + " ")
    assert checkpoint_digest(str(b), torch.float32) != base


def test_checkpoint_digest_without_weight_files_or_a_local_copy_is_a_clear_error(tmp_path):
    from edgemoe.models import checkpoint_digest

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(EdgeMoEError, match=r"no weight files \(\*\.safetensors, \*\.bin\)"):
        checkpoint_digest(str(folder), torch.float32)
    with pytest.raises(EdgeMoEError, match="'nobody/no-such-model': no local copy"):
        checkpoint_digest("nobody/no-such-model", torch.float32)
