"""Recipes are step budgets: the same recipe and seed give byte-identical weights; the clock only guards."""

from dataclasses import replace

import numpy as np
import pytest

from edgemoe.data.blocks import TokenBlocks
from edgemoe.models import load_tokenizer
from edgemoe.models.derive import DeriveConfig, train_derived_model
from edgemoe.models.train import TrainConfig, TrainingGuardError, build_model, train_default_model

TINY = TrainConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   num_experts=8, top_k=2, block_len=16, batch_size=4, steps=6, schedule_steps=10, warmup=2,
                   eval_tokens_per_domain=64)


def _data(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    domains = ("a", "b", "c", "d")

    def blocks(n):
        return TokenBlocks(rng.integers(0, TINY.vocab_size, (n, TINY.block_len)), np.arange(n) % 4, domains)

    return {"train": blocks(24), "heldout": blocks(8), "wiki_test": blocks(2), "domains": domains,
            "description": {"train": "random tokens (test)"}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def _train(tmp_path, name, cfg, tokenizer):
    out = tmp_path / name
    recipe = train_default_model(tmp_path / "no-data", out, cfg, log=lambda m: None, tokenizer=tokenizer, data=_data())
    return recipe, (out / "model.safetensors").read_bytes()


def test_same_recipe_and_seed_give_byte_identical_safetensors(tmp_path, tokenizer):
    r1, a = _train(tmp_path, "a", TINY, tokenizer)
    r2, b = _train(tmp_path, "b", TINY, tokenizer)
    assert a == b
    assert r1["steps_done"] == r2["steps_done"] == TINY.steps  # the step count, never the clock, ends the run
    assert r1["config"]["schedule_steps"] == 10 and r1["train_cpu_seconds"] >= 0
    _, c = _train(tmp_path, "c", replace(TINY, seed=1), tokenizer)
    assert c != a  # the seed matters: the equality above is not vacuous


def test_the_clock_guard_errors_out_and_saves_nothing(tmp_path, tokenizer):
    with pytest.raises(TrainingGuardError, match="--max-minutes guard at step 1 of 6"):
        _train(tmp_path, "m", replace(TINY, max_minutes=1e-9), tokenizer)
    assert not (tmp_path / "m").exists()


def test_bad_step_counts_are_refused(tmp_path, tokenizer):
    from edgemoe.errors import EdgeMoEError

    with pytest.raises(EdgeMoEError, match="schedule_steps"):
        _train(tmp_path, "m", replace(TINY, steps=6, schedule_steps=5), tokenizer)


def test_a_derived_recipe_is_byte_identical_twice(tmp_path):
    cfg = DeriveConfig(kind="finegrain", what="test", model=TINY, steps=4, warmup=1, shared_fraction=0.5, slices=2,
                       copies=4, top_k=4)  # 12-channel slices: grouped matmuls want 16-byte strides
    out = []
    for name in ("a", "b"):
        recipe = train_derived_model(tmp_path, tmp_path / name, "finegrained-shared", cfg, log=lambda m: None,
                                     source_model=build_model(TINY), data=_data())
        out.append((tmp_path / name / "model.safetensors").read_bytes())
        assert recipe["steps_done"] == 4
    assert out[0] == out[1]
