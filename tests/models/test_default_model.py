"""The packaged models (`default`, `default-upcycled`): load with plain transformers, promised shape and size."""

import json

import pytest
import torch

from edgemoe.models import default_model_path, load_moe, load_tokenizer

PACKAGED = ("default", "default-upcycled")


@pytest.mark.parametrize("name", PACKAGED)
def test_plain_transformers_loads_it(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("def main():\n    return 0\n", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] == model.config.vocab_size


@pytest.mark.parametrize("name", PACKAGED)
def test_shape_and_size(name):
    path = default_model_path(name)
    adapter = load_moe(name)
    assert adapter.family == "mixtral"
    assert adapter.num_layers >= 4 and adapter.num_experts >= 16 and adapter.top_k == 2
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert size <= 25 * 2**20
    # stored in bf16: 2 bytes per parameter
    assert (adapter.expert_bytes() == 2 * adapter.expert_params()).all()


@pytest.mark.parametrize("name", PACKAGED)
def test_recipe_records_training(name):
    recipe = json.loads((default_model_path(name) / "recipe.json").read_text())
    for key in ("command", "config", "train_minutes", "heldout_perplexity", "data"):
        assert key in recipe
    assert recipe["data"]["never_trained_on"] == "WikiText-2 test"
    assert set(recipe["heldout_perplexity"]) >= {"wiki", "gutenberg", "shakespeare", "code", "wikitext2_test"}


def test_upcycled_model_matches_the_default_shape_and_tokenizer():
    a, b = load_moe("default"), load_moe("default-upcycled")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_local_experts",
                "num_experts_per_tok"):
        assert getattr(a.config, key) == getattr(b.config, key), key
    text = "The quick brown fox\n    return x\n"
    assert load_tokenizer("default")(text).input_ids == load_tokenizer("default-upcycled")(text).input_ids
    recipe = json.loads((default_model_path("default-upcycled") / "recipe.json").read_text())
    assert recipe["command"].startswith("edgemoe train --upcycle")
    assert recipe["dense_steps_done"] == recipe["config"]["dense_steps"]
