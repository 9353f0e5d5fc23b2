"""The paper-scale scenario runs end to end (small settings) and reports beside the paper's 187 ms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.eval.paper_scale import PAPER_MIXTRAL_MEAN_MS, PaperScaleConfig, run_paper_scale

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
needs_counts = pytest.mark.skipif(not (SHARED / "routing" / "real_expert_counts.json").is_file(),
                                  reason=f"real routing counts absent under {SHARED}")


@needs_counts
def test_small_paper_scale_run(tmp_path):
    cfg = PaperScaleConfig(shared_data=str(SHARED), tokens_per_domain=40, num_requests=4, prompt_tokens=2,
                           gen_tokens=3, planners=("lfu", "ordermoe", "slimcaching"), models=("mixtral-8x7b",))
    (path,) = run_paper_scale(cfg, tmp_path, log=lambda _: None)
    doc = json.loads(path.read_text())
    m = doc["methods"]
    assert {"exact@lfu", "exact@ordermoe", "exact@slimcaching", "all-local", "ordermoe-H2",
            "ordermoe-H2@slimcaching", "slimcaching-policy@slimcaching", "drop@ordermoe"} <= set(m)
    assert all(v["ppl"] is None for v in m.values())
    assert doc["config"]["cluster"] == "testbed8" and doc["config"]["planned_on"]["tokens"] == 200
    assert doc["config"]["profile"]["tokens"] == 200  # the other draw, replayed
    assert doc["paper_comparison"]["paper_mean_ms"] == PAPER_MIXTRAL_MEAN_MS
    assert doc["paper_comparison"]["ordermoe_mean_ms"] > 0
    assert m["drop@ordermoe"]["remote_ratio"] == 0.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["models"][0]["model"] == "mixtral-8x7b" and "187 ms" in (tmp_path / "summary.md").read_text()


def test_missing_counts_is_a_clear_error(tmp_path):
    cfg = PaperScaleConfig(shared_data=str(tmp_path / "nowhere"), models=("mixtral-8x7b",))
    with pytest.raises(EdgeMoEError, match="real_expert_counts.json not found"):
        run_paper_scale(cfg, tmp_path, log=lambda _: None)
    with pytest.raises(EdgeMoEError, match="unknown"):
        run_paper_scale(PaperScaleConfig(models=("gpt-moe",)), tmp_path, log=lambda _: None)
