"""evaluate --profile: replay without a model; placement files; plan on one half of a trace, score on the other."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from edgemoe.cli import app
from edgemoe.errors import EdgeMoEError
from edgemoe.eval.experiment import MethodSpec
from edgemoe.eval.replay import replay_profile
from edgemoe.profile import synthetic_profile
from edgemoe.runtime.sim.workload import Workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "traces"
SMALL = Workload(num_requests=6, prompt_tokens=4, gen_tokens=4, rate_per_s=20.0)


def _split_by_request(src: Path, out: Path) -> tuple[Path, Path]:
    """Even-numbered requests to one file, odd to the other (meta lines to both)."""
    halves = ([], [])
    order: dict[str, int] = {}
    with gzip.open(src, "rt") as f:
        for line in f:
            obj = json.loads(line)
            if obj.get("type", "route") != "route":
                halves[0].append(line)
                halves[1].append(line)
                continue
            halves[order.setdefault(obj["req_id"], len(order)) % 2].append(line)
    paths = (out / "monday.jsonl", out / "tuesday.jsonl")
    for p, lines in zip(paths, halves, strict=True):
        p.write_text("".join(lines))
    return paths


def test_plan_on_one_half_evaluate_on_the_other(tmp_path):
    """The two-command workflow of docs/traces.md on the shipped Mixtral example trace, end to end."""
    mon, tue = _split_by_request(EXAMPLES / "mixtral-calibrated.jsonl.gz", tmp_path)
    run = CliRunner().invoke
    for day in (mon, tue):
        r = run(app, ["profile", "--trace", str(day), "--model-spec", "mixtral-8x7b", "--out", str(tmp_path / day.stem)])
        assert r.exit_code == 0, r.output
        assert "120 tokens kept, 0 dropped" in r.output
    r = run(app, ["plan", "--profile", str(tmp_path / "monday"), "--cluster", "testbed8", "--method", "lfu",
                  "--out", str(tmp_path / "monday-lfu.json")])
    assert r.exit_code == 0, r.output
    out = tmp_path / "tuesday-results.json"
    r = run(app, ["evaluate", "--profile", str(tmp_path / "tuesday"), "--cluster", "testbed8", "--requests", "6",
                  "--method", f"monday={tmp_path / 'monday-lfu.json'}:exact",
                  "--method", "floor=all-local:exact", "--out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    m = doc["methods"]
    assert m["monday"]["ppl"] is None and m["monday"]["quality_retention"] is None  # no model: no quality
    assert doc["placements"][str(tmp_path / "monday-lfu.json")]["from_file"] is True
    assert m["floor"]["remote_ratio"] == 0.0 and m["monday"]["remote_ratio"] > 0.0
    assert m["floor"]["latency_ms"]["mean"] <= m["monday"]["latency_ms"]["mean"]
    assert doc["config"]["profile"]["tokens"] == 120
    # the same in one command: plan on Monday's profile inside evaluate
    r = run(app, ["evaluate", "--profile", str(tmp_path / "tuesday"), "--plan-profile", str(tmp_path / "monday"),
                  "--cluster", "testbed8", "--requests", "6", "--method", "lfu=lfu:exact", "--out", str(out)])
    assert r.exit_code == 0, r.output
    again = json.loads(out.read_text())
    assert again["config"]["planned_on"]["tokens"] == 120
    assert again["methods"]["lfu"]["latency_ms"] == m["monday"]["latency_ms"]  # same placement, same replay


def test_placement_file_gives_the_same_run_as_planning_by_name(tmp_path):
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan

    prof = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=400, num_domains=1, seed=2)
    plan(plan_problem(prof, "edge8"), "lfu").save(tmp_path / "lfu.json")
    methods = [MethodSpec("by-name", "lfu", "exact"), MethodSpec("by-file", str(tmp_path / "lfu.json"), "exact")]
    doc = replay_profile(prof, "edge8", methods, workload=SMALL, log=lambda _: None)
    a, b = doc["methods"]["by-name"], doc["methods"]["by-file"]
    for key in ("latency_ms", "ttft_ms", "traffic_bytes_per_1k_tokens", "remote_ratio"):
        assert a[key] == b[key]


def test_out_of_sample_uses_the_planning_profile_for_planning(tmp_path):
    mon = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=400, num_domains=1, seed=2)
    tue = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=400, num_domains=1, seed=5)
    methods = [MethodSpec("lfu", "lfu", "exact")]
    inside = replay_profile(tue, "edge8", methods, workload=SMALL, log=lambda _: None)
    outside = replay_profile(tue, "edge8", methods, workload=SMALL, log=lambda _: None, plan_profile=mon)
    assert outside["config"]["planned_on"]["tokens"] == 400 and inside["config"]["planned_on"] is None
    # same replayed tokens, different knowledge: each run's placement is exactly the one LFU makes from the
    # profile it planned on, and those two differ
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan

    for doc, planned_on in ((inside, tue), (outside, mon)):
        want = plan(plan_problem(planned_on, "edge8"), "lfu").replicas().tolist()
        assert doc["placements"]["lfu"]["copies"] == want
    assert inside["placements"]["lfu"]["copies"] != outside["placements"]["lfu"]["copies"]
    with pytest.raises(EdgeMoEError, match="must match"):
        replay_profile(tue, "edge8", methods, workload=SMALL, log=lambda _: None,
                       plan_profile=synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=100, seed=0))


def test_bad_placement_files_are_clear_errors(tmp_path):
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan

    prof = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=200, num_domains=1, seed=2)
    other = synthetic_profile(num_layers=3, num_experts=8, top_k=2, num_tokens=200, num_domains=1, seed=2)
    plan(plan_problem(other, "edge8"), "lfu").save(tmp_path / "other.json")
    plan(plan_problem(prof, "testbed8"), "lfu").save(tmp_path / "testbed8.json")
    cases = [(tmp_path / "missing.json", "not found"), (tmp_path / "other.json", r"\(L, E\) = \(3, 8\)"),
             (tmp_path / "testbed8.json", "testbed8.json: nodes .* do not match the cluster")]
    for path, match in cases:
        with pytest.raises(EdgeMoEError, match=match):
            replay_profile(prof, "edge8", [MethodSpec("x", str(path), "exact")], workload=SMALL, log=lambda _: None)
    with pytest.raises(EdgeMoEError, match="do not apply to a file"):
        replay_profile(prof, "edge8", [MethodSpec("x", str(tmp_path / "testbed8.json"), "exact", placement_params={"a": 1})],
                       workload=SMALL, log=lambda _: None)
    assert np.isfinite(replay_profile(prof, "edge8", [MethodSpec("u", "uniform", "exact")], workload=SMALL,
                                      log=lambda _: None)["methods"]["u"]["latency_ms"]["mean"])
