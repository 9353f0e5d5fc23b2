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
    """The recipe's values describe the model shipped beside it: its config is the checkpoint's, its
    parameter and token counts add up, and its losses are those of a model that learned something."""
    import math

    recipe = json.loads((default_model_path(name) / "recipe.json").read_text())
    for key in ("command", "config", "train_minutes", "heldout_perplexity", "data"):
        assert key in recipe
    assert recipe["data"]["never_trained_on"] == "WikiText-2 test"
    assert set(recipe["heldout_perplexity"]) >= {"wiki", "gutenberg", "shakespeare", "code", "wikitext2_test"}
    cfg = recipe["config"].get("model", recipe["config"])  # the upcycled recipe nests the model's config
    adapter = load_moe(name)
    c = adapter.config
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_layers"], cfg["num_experts"],
            cfg["top_k"]) == (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                              c.num_local_experts, c.num_experts_per_tok)
    assert recipe["parameters"] == sum(p.numel() for p in adapter.model.parameters())
    # every optimizer step sees one batch of full blocks
    assert recipe["tokens_seen"] == recipe["steps_done"] * cfg["batch_size"] * cfg["block_len"]
    if name == "default":
        assert 0 < recipe["steps_done"] <= cfg["steps"]
    else:
        assert recipe["steps_done"] == recipe["dense_steps_done"] + recipe["moe_steps_done"]
    assert recipe["train_minutes"] > 0
    # learned: well below the uniform guess ln(V); held-out perplexity between 1 and a tenth of the vocabulary
    assert 0 < recipe["final_train_loss"] < 0.6 * math.log(cfg["vocab_size"])
    for domain, ppl in recipe["heldout_perplexity"].items():
        assert 1.0 < ppl < cfg["vocab_size"] / 10, (domain, ppl)


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
