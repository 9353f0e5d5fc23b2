"""What `edgemoe demo --backend ray` sends to Ray, without starting Ray: the experiment's Ray measurement is
replaced by a recorder. The oracle and the budget sweep stay simulated (marked), other models are simulated."""

from __future__ import annotations

from dataclasses import replace

import edgemoe.eval.experiment as experiment
from edgemoe.eval.experiment import Comparison, ExperimentConfig, MethodSpec
from edgemoe.models.tiny import save_tiny


def test_ray_measures_methods_but_not_the_oracle_nor_the_sweep(tmp_path, monkeypatch):
    calls = []

    def fake(state, ctx, spec, ids, cfg, log, simulated):
        calls.append((spec.name, cfg.ray_dilation, ctx.dense_source))
        return replace(simulated, extra={**simulated.extra, "backend": "ray", "ray": {"dilation": cfg.ray_dilation}})

    monkeypatch.setattr(experiment, "_ray_measured", fake)
    model = save_tiny("mixtral", tmp_path / "model")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 400)
    cfg = ExperimentConfig(model=str(model), eval_data=str(tmp_path / "text.txt"), calib_data=str(tmp_path / "text.txt"),
                           eval_tokens=512, calib_tokens=1024, num_requests=4, prompt_tokens=4, gen_tokens=3,
                           cache_dir=str(tmp_path / "cache"), ray_dilation=7.0)
    comp = Comparison(name="c", cluster="edge8", mode="migrate", methods=(
        MethodSpec("exact", "uniform", "exact"), MethodSpec("om", "ordermoe", "ordermoe", {"budget": 0.05, "horizon": 1}),
        MethodSpec("oracle", "ordermoe", "oracle", {"budget": 0.05})), budget_sweep_methods=("om",), budgets=(0.02,))
    (path,) = experiment.run_experiment(cfg, [comp], tmp_path / "out", log=lambda _m: None, backend="ray")
    assert calls == [("exact", 7.0, "model"), ("om", 7.0, "model")]  # the forced k; the dense part counted on the model
    import json

    doc = json.loads(path.read_text())
    assert "future routing" in doc["methods"]["oracle"]["ray_skipped"] and "ray" not in doc["methods"]["oracle"]
    assert doc["config"]["dense_cost"]["source"] == "model" and doc["config"]["ray_dilation"] == 7.0
    assert len(doc["budget_sweep"]["om"]) == 1


def test_ray_measures_the_first_model_only(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(experiment, "model_available", lambda _m: True)
    monkeypatch.setattr(experiment, "run_experiment",
                        lambda cfg, comps, out, log, backend, suffix="": seen.append((cfg.model, backend, len(comps))) or [])
    experiment.run_demo(ExperimentConfig(models=("a", "b")), tmp_path, log=lambda _m: None, backend="ray")
    assert seen == [("a", "ray", 2)]  # the other models are the plain demo's (simulated) work
