"""Sparse upcycling on a tiny config: copies up to the noise, a fresh router, the dense function kept, save/load."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from edgemoe.data.blocks import TokenBlocks
from edgemoe.errors import EdgeMoEError
from edgemoe.models import load_moe
from edgemoe.models.loader import PACKAGED_MODELS, resolve_model_path
from edgemoe.models.train import TrainConfig, build_model
from edgemoe.models.upcycle import UpcycleConfig, expert_spread, train_dense, train_moe, upcycle

TINY = TrainConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   num_experts=8, top_k=2, block_len=16, batch_size=4, steps=0, max_minutes=0.0)
E, K = TINY.num_experts, TINY.top_k


def dense_model(seed: int = 0):
    return build_model(replace(TINY, num_experts=1, top_k=1, seed=seed))


def test_experts_are_copies_up_to_the_noise():
    dense = dense_model()
    moe = upcycle(dense, E, K, noise=0.01, seed=3)
    for ld, lm in zip(dense.model.layers, moe.model.layers, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(ld.mlp.experts, name)[0].detach()  # the dense FFN's matrix
            copies = getattr(lm.mlp.experts, name).detach()  # [E, ...]
            assert copies.shape == (E, *w.shape)
            rel = (copies - w).flatten(1).norm(dim=1) / w.norm()
            # noise of 1% of the matrix' std per entry: about 1% of its norm (the matrix is near zero-mean)
            assert (rel > 0.005).all() and (rel < 0.02).all()
    assert max(expert_spread(moe)) < 0.02


def test_router_is_fresh_and_seeded():
    dense = dense_model()
    a, b, c = upcycle(dense, E, K, seed=1), upcycle(dense, E, K, seed=1), upcycle(dense, E, K, seed=2)
    for la, lb, lc in zip(a.model.layers, b.model.layers, c.model.layers, strict=True):
        ra = la.mlp.gate.weight.detach()
        assert ra.shape == (E, TINY.hidden_size)
        assert torch.equal(ra, lb.mlp.gate.weight)  # same seed, same router
        assert not torch.equal(ra, lc.mlp.gate.weight)
        assert abs(float(ra.std()) - a.config.initializer_range) < 0.3 * a.config.initializer_range


def test_everything_but_the_ffn_is_copied_and_the_function_kept():
    dense = dense_model().eval()
    moe = upcycle(dense, E, K, noise=0.0).eval()
    sd_dense, sd_moe = dense.state_dict(), moe.state_dict()
    for name, w in sd_dense.items():
        if ".mlp." not in name:
            assert torch.equal(w, sd_moe[name]), name
    # Gates are renormalised over the K picks, so K identical copies give the dense FFN's output.
    x = torch.randint(0, TINY.vocab_size, (3, 12))
    with torch.no_grad():
        torch.testing.assert_close(moe(input_ids=x).logits, dense(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def test_upcycle_rejects_a_model_that_is_already_moe():
    with pytest.raises(EdgeMoEError, match="dense Mixtral"):
        upcycle(build_model(TINY), E, K)
    with pytest.raises(EdgeMoEError, match="top_k"):
        upcycle(dense_model(), 4, 5)


def test_saved_model_loads_with_edgemoe_and_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    moe = upcycle(dense_model(), E, K).to(torch.bfloat16)
    moe.save_pretrained(tmp_path)
    adapter = load_moe(str(tmp_path))
    assert (adapter.family, adapter.num_layers, adapter.num_experts, adapter.top_k) == ("mixtral", TINY.num_layers, E, K)
    assert adapter.checkpoint_dtype == torch.bfloat16
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    x = torch.randint(0, TINY.vocab_size, (1, 8))
    assert plain(input_ids=x).logits.shape == (1, 8, TINY.vocab_size)


def _blocks(n: int = 24) -> TokenBlocks:
    rng = np.random.default_rng(0)
    return TokenBlocks(rng.integers(0, TINY.vocab_size, (n, TINY.block_len)), np.arange(n) % 4,
                       ("a", "b", "c", "d"))


def test_both_phases_train_deterministically_and_the_experts_drift_apart():
    cfg = UpcycleConfig(model=TINY, dense_steps=3, dense_warmup=1, moe_steps=50, moe_warmup=2, moe_expert_lr=3e-3)
    runs = []
    for _ in range(2):
        dense, dense_losses = train_dense(_blocks(), cfg, log=lambda m: None)
        moe = upcycle(dense, E, K, cfg.noise, seed=0, router_aux_loss_coef=0.02)
        moe_losses, spread = train_moe(moe, _blocks(), cfg, log=lambda m: None)
        runs.append((dense_losses, moe_losses, spread))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]  # same seed, same run
    dense_losses, moe_losses, spread = runs[0]
    assert len(dense_losses) == 3 and len(moe_losses) == 50 and np.isfinite(moe_losses).all()
    assert [s for s, _ in spread] == [0, 50]
    assert max(spread[0][1]) < 0.02 < min(spread[1][1])  # copies diverge under MoE training


def test_stop_after_cuts_the_moe_phase():
    cfg = UpcycleConfig(model=TINY, dense_steps=2, dense_warmup=1, moe_steps=6, moe_warmup=1)
    dense, _ = train_dense(_blocks(), cfg, log=lambda m: None)
    moe = upcycle(dense, E, K)
    losses, _ = train_moe(moe, _blocks(), cfg, log=lambda m: None, stop_after=4)
    assert len(losses) == 4


def test_packaged_name_is_registered():
    assert set(PACKAGED_MODELS) >= {"default", "default-upcycled"}
    try:
        path = resolve_model_path("default-upcycled")
    except EdgeMoEError as exc:  # not trained yet: the error says how to rebuild it
        assert "edgemoe train --upcycle" in str(exc)
    else:
        assert path.endswith("default_upcycled_model")


def test_cli_upcycle_option_runs_the_upcycle_recipe(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import edgemoe.models.upcycle as up
    from edgemoe.cli import app

    seen = {}

    def fake(data, out, cfg, log=print):
        seen.update(data=data, out=out, cfg=cfg)
        return {"steps_done": 1, "train_minutes": 0.0, "heldout_perplexity": {}}

    monkeypatch.setattr(up, "train_upcycled_model", fake)
    res = CliRunner().invoke(app, ["train", "--upcycle", "--data", str(tmp_path), "--stop-after", "950", "--seed", "3"])
    assert res.exit_code == 0, res.output
    cfg = seen["cfg"]
    assert str(seen["out"]).endswith("default_upcycled_model")
    # No wall-clock budget unless asked for: the recipe's steps decide.
    assert (cfg.max_minutes, cfg.stop_after, cfg.model.seed) == (0.0, 950, 3)
    assert (cfg.dense_steps, cfg.moe_steps) == (UpcycleConfig().dense_steps, UpcycleConfig().moe_steps)
