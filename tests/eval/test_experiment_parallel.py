"""`edgemoe demo` with worker processes (eval.experiment.run_parallel): the results files come back in the
order one process writes them, every worker's log lines reach the caller tagged with their model, and a failing
comparison fails the demo with its own message. The jobs here are stand-ins (the real ones run minutes); that
the figures are the same bit for bit is checked by regenerating bench/results/demo (docs/runtime.md, "The demo")."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.eval import experiment
from edgemoe.eval.experiment import (
    ExperimentConfig,
    demo_jobs,
    ordermoe_comparison,
    run_parallel,
    slimcaching_comparison,
)


def stand_in_job(cfg, comp, out_dir, suffix):
    """Runs in a spawned worker: one log line per comparison, then an empty results file (or a failure)."""
    experiment._WORKER["lines"].put((cfg.model, f"  {comp.name} mean 1.00 ms"))
    if cfg.model == "broken":
        raise EdgeMoEError(f"comparison {comp.name} on {cfg.model} failed")
    path = Path(out_dir) / f"{comp.name}{suffix}.json"
    path.write_text("{}")
    return [path]


def test_jobs_are_the_one_process_order():
    om, sc = ordermoe_comparison(), slimcaching_comparison()
    assert [(m, c.name, s) for m, c, s in demo_jobs(["a", "org/b"], om, sc)] == [
        ("a", "ordermoe-edge8", ""), ("a", "slimcaching-device-edge-cloud", ""), ("org/b", "ordermoe-edge8", "-b")]


def test_workers_return_results_in_order_and_forward_their_log(tmp_path):
    lines: list[str] = []
    jobs = demo_jobs(["a", "b"], ordermoe_comparison(), slimcaching_comparison())
    paths = run_parallel(ExperimentConfig(), jobs, tmp_path, lines.append, workers=2, job=stand_in_job)
    assert [p.name for p in paths] == ["ordermoe-edge8.json", "slimcaching-device-edge-cloud.json", "ordermoe-edge8-b.json"]
    assert all(p.is_file() for p in paths)
    assert sorted(lines) == sorted(["  [a] ordermoe-edge8 mean 1.00 ms", "  [a] slimcaching-device-edge-cloud mean 1.00 ms",
                                    "  [b] ordermoe-edge8 mean 1.00 ms"])


def test_a_failing_worker_fails_the_demo(tmp_path):
    jobs = demo_jobs(["broken", "b"], ordermoe_comparison(), slimcaching_comparison())
    with pytest.raises(EdgeMoEError, match="on broken failed"):
        run_parallel(ExperimentConfig(), jobs, tmp_path, lambda _line: None, workers=2, job=stand_in_job)
