"""The embedded default model: loads with plain transformers, has the promised shape and size."""

import json

import torch

from edgemoe.models import default_model_path, load_moe


def test_plain_transformers_loads_it():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("def main():\n    return 0\n", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size


def test_shape_and_size():
    path = default_model_path()
    adapter = load_moe("default")
    assert adapter.family == "mixtral"
    assert adapter.num_layers >= 4 and adapter.num_experts >= 16 and adapter.top_k == 2
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert size <= 25 * 2**20
    # stored in bf16: 2 bytes per parameter
    assert (adapter.expert_bytes() == 2 * adapter.expert_params()).all()


def test_recipe_records_training():
    recipe = json.loads((default_model_path() / "recipe.json").read_text())
    for key in ("command", "config", "train_minutes", "heldout_perplexity", "data"):
        assert key in recipe
    assert recipe["data"]["never_trained_on"] == "WikiText-2 test"
    assert set(recipe["heldout_perplexity"]) >= {"wiki", "gutenberg", "shakespeare", "code", "wikitext2_test"}
