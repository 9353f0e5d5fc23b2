"""The ladder's derived models: the fine-grained split's known answer on a tiny model, the registry, the CLI."""

import json

import pytest
import torch
from typer.testing import CliRunner

from edgemoe.cli import app
from edgemoe.errors import EdgeMoEError
from edgemoe.models import adapter_for, load_moe
from edgemoe.models.derive import RECIPE_FOLDERS, RECIPES, DeriveConfig, dense_ffn, finegrain
from edgemoe.models.loader import PACKAGED_MODELS, default_model_path
from edgemoe.models.train import TrainConfig, build_model

TINY = TrainConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   num_experts=8, top_k=2, block_len=16, batch_size=4, steps=1, schedule_steps=None)
SPLIT = DeriveConfig(kind="finegrain", what="test", model=TINY, shared_fraction=0.5, slices=2, copies=4, top_k=4,
                     noise=0.0)
LADDER = ("upcycled-diverged", "finegrained-shared")


def test_finegrained_split_sums_back_to_the_dense_ffn():
    """shared(x) at its starting gate 1/2 plus one copy of each slice at gate 1/slices is the dense FFN."""
    src = build_model(TINY).eval()
    fg = finegrain(src, SPLIT).eval()
    assert (fg.config.num_experts, fg.config.num_experts_per_tok, fg.config.moe_intermediate_size) == (8, 4, 12)
    adapter = adapter_for(fg)
    h = torch.randn(5, TINY.hidden_size)
    for layer in range(TINY.num_layers):
        gate_up, down = dense_ffn(src, layer)
        g, u = (h @ gate_up.T).chunk(2, dim=-1)
        dense = (torch.nn.functional.silu(g) * u) @ down.T
        mlp = fg.model.layers[layer].mlp
        shared = torch.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h)
        routed = sum(adapter.expert_output(layer, s * SPLIT.copies, h) for s in range(SPLIT.slices)) / SPLIT.slices
        torch.testing.assert_close(shared + routed, dense, atol=1e-5, rtol=1e-4)
        # copies of one slice are equal without noise; slices differ
        ex = mlp.experts.gate_up_proj.detach()
        assert torch.equal(ex[0], ex[SPLIT.copies - 1]) and not torch.equal(ex[0], ex[SPLIT.copies])
    sd_src, sd_fg = src.state_dict(), fg.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight", "model.norm.weight"):
        assert torch.equal(sd_src[name], sd_fg[name])
    assert float(sd_fg["model.layers.0.self_attn.q_proj.bias"].abs().max()) == 0.0


def test_a_split_that_does_not_divide_is_refused():
    with pytest.raises(EdgeMoEError, match="slices"):
        finegrain(build_model(TINY), DeriveConfig(kind="finegrain", what="t", model=TINY, slices=5))
    with pytest.raises(EdgeMoEError, match="top_k"):
        finegrain(build_model(TINY), DeriveConfig(kind="finegrain", what="t", model=TINY, slices=2, copies=1, top_k=3))


@pytest.mark.parametrize("name", LADDER)
def test_ladder_models_are_shipped_loadable_small_and_reproducible_by_their_recipe(name):
    assert name in PACKAGED_MODELS and PACKAGED_MODELS[name][0] == RECIPE_FOLDERS[name]
    path = default_model_path(name)
    assert (path / "model.safetensors").stat().st_size <= 25_000_000
    recipe = json.loads((path / "recipe.json").read_text())
    assert recipe["command"].startswith(f"edgemoe train --recipe {name} ")
    assert recipe["steps_done"] == RECIPES[name].steps == recipe["config"]["steps"]
    assert recipe["config"] == json.loads(json.dumps(__import__("dataclasses").asdict(RECIPES[name])))
    adapter = load_moe(name)
    assert adapter.checkpoint_dtype == torch.bfloat16
    assert adapter.num_experts == 16 and adapter.num_layers == 4
    x = torch.randint(0, adapter.config.vocab_size, (1, 12))
    logits = adapter.forward_logits(x)
    assert logits.shape == (1, 12, adapter.config.vocab_size) and torch.isfinite(logits).all()


def test_cli_recipe_option_runs_that_recipe(monkeypatch, tmp_path):
    import edgemoe.models.derive as derive

    seen = {}

    def fake(data, out, name, cfg, log=print):
        seen.update(out=out, name=name, cfg=cfg)
        return {"steps_done": cfg.steps, "train_minutes": 0.0, "heldout_perplexity": {}}

    monkeypatch.setattr(derive, "train_derived_model", fake)
    res = CliRunner().invoke(app, ["train", "--recipe", "finegrained-shared", "--data", str(tmp_path), "--seed", "2"])
    assert res.exit_code == 0, res.output
    assert str(seen["out"]).endswith("finegrained_shared_model") and seen["name"] == "finegrained-shared"
    assert seen["cfg"].seed == 2 and seen["cfg"].steps == RECIPES["finegrained-shared"].steps


@pytest.mark.parametrize("args, message", [
    (["--recipe", "nope"], "--recipe 'nope': expected one of"),
    (["--recipe", "upcycled-diverged", "--upcycle"], "give one of them"),
    (["--recipe", "upcycled-diverged", "--steps", "5"], "not with --upcycle or --recipe"),
    (["--stop-after", "5"], "--stop-after: only with --upcycle"),
])
def test_cli_refuses_conflicting_train_options(tmp_path, args, message):
    res = CliRunner().invoke(app, ["train", "--data", str(tmp_path), "--out", str(tmp_path / "m"), *args])
    assert res.exit_code == 2 and message in res.output, res.output


def test_cli_default_recipe_is_the_shipped_run(monkeypatch, tmp_path):
    import edgemoe.models.train as train

    seen = {}

    def fake(data, out, cfg, log=print):
        seen["cfg"] = cfg
        return {"steps_done": cfg.steps, "train_minutes": 0.0, "heldout_perplexity": {}}

    monkeypatch.setattr(train, "train_default_model", fake)
    assert CliRunner().invoke(app, ["train", "--data", str(tmp_path), "--out", str(tmp_path / "m")]).exit_code == 0
    shipped = json.loads((default_model_path("default") / "recipe.json").read_text())
    cfg = seen["cfg"]
    assert (cfg.steps, cfg.schedule_steps, cfg.max_minutes) == (shipped["steps_done"], 3000, 0.0)
    assert shipped["config"]["steps"] == shipped["steps_done"] == 1039
    assert CliRunner().invoke(app, ["train", "--data", str(tmp_path), "--out", str(tmp_path / "m"),
                                    "--steps", "7"]).exit_code == 0
    assert (seen["cfg"].steps, seen["cfg"].schedule_steps) == (7, 7)
