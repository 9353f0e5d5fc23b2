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


def test_ray_demo_summary_adds_the_ray_processes_cpu(tmp_path):
    import json

    paths = []
    for name, ray_s in (("a.json", 12.5), ("b.json", 30.0)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps({"environment": {"cpu_s": 1.0, "ray_cpu_s": ray_s}}))
    t = experiment.demo_summary(paths, 100.0, [1.0, 1.0, 1.0], 1, "ray")["timing"]
    assert t["ray_cpu_s"] == 42.5 and t["cpu_s"] == round(t["driver_cpu_s"] + 42.5, 1)
    plain = experiment.demo_summary(paths, 100.0, [1.0, 1.0, 1.0], 2, "simulate")["timing"]
    assert "ray_cpu_s" not in plain and plain["cpu_s"] < t["cpu_s"]


def test_ray_cpu_s_counts_the_ray_processes_not_the_driver(monkeypatch):
    import os
    import subprocess
    import sys

    from edgemoe.distributed.loadrun import ray_cpu_s

    # no Ray session's daemons: an earlier test in this worker may have left one running, whose CPU would count
    monkeypatch.setitem(sys.modules, "ray", None)

    # a stand-in actor: burns 0.3 s of CPU, says so, then waits to be read
    child = subprocess.Popen([sys.executable, "-c", "import time, sys\nwhile time.process_time() < 0.3: pass\n"
                              "print('ready', flush=True)\nsys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"

        class Dep:
            def __init__(self, pids):
                self._pids = pids

            def pids(self):
                return self._pids

        assert ray_cpu_s(Dep([os.getpid()])) == 0.0  # the driver is not a Ray process
        assert ray_cpu_s(Dep([os.getpid(), child.pid])) >= 0.25  # /proc counts whole clock ticks
    finally:
        child.communicate("")
