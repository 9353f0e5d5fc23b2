"""Metrics definitions and the results file: hand-checked traffic, schema round trip, named errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgemoe.errors import EdgeMoEError
from edgemoe.results import SCHEMA, load_results, write_results
from edgemoe.runtime import make_policy
from edgemoe.runtime.metrics import DecisionTally, decision_bytes, latency_summary_ms, method_entry
from edgemoe.runtime.policy import Decision
from edgemoe.runtime.sim.simulate import simulate
from edgemoe.runtime.sim.workload import Trace, Workload

from .conftest import tiny_cluster, tiny_context, tiny_profile


def test_decision_bytes_counts_each_leg():
    # Token at node 0 (home 0). Slot 0 runs at 1, slot 1 at 2, slot 2 local, slot 3 dropped; meet at 1, last layer.
    dec = Decision(experts=np.array([[5, 6, 7, -1]]), node=np.array([[1, 2, 0, -1]]), location=np.array([0]),
                   next_location=np.array([1]), quality_cost=np.zeros(1), latency_s=np.zeros(1))
    # out legs 0->1, 0->2; back legs 2->1, 0->1; trip home 1->0: 5 legs.
    assert decision_bytes(dec, 3, 4, np.array([0]), 100).tolist() == [500]
    assert decision_bytes(dec, 2, 4, np.array([0]), 100).tolist() == [400]
    tally = DecisionTally(num_layers=4, wire_bytes=100)
    tally.add(dec, np.array([[5, 9, 7, 8]]), 3, np.array([0]), prefill=False)
    assert tally.ratios() == {"remote_ratio": 2 / 3, "substitution_ratio": 1 / 4, "drop_ratio": 1 / 4, "zero_ratio": 0.0}
    assert tally.decode_tokens == 1 and tally.traffic_per_1k()["traffic_decode_bytes_per_1k_tokens"] == 500_000


def test_latency_summary():
    s = latency_summary_ms([0.001, 0.002, 0.003, 0.004])
    assert s["mean"] == pytest.approx(2.5) and s["p50"] == pytest.approx(2.5)
    assert np.isnan(latency_summary_ms([])["p99"])


def make_methods():
    profile = tiny_profile([[1]])
    ctx = tiny_context(profile, tiny_cluster(), {"a": [(0, 0)], "b": [(0, 1)]})
    m = simulate(ctx, make_policy("exact", ctx), Trace.from_profile(profile), Workload(num_requests=3, gen_tokens=2))
    return {"exact@hand": method_entry(m, placement="hand", policy="exact", mode="home")}


def test_results_round_trip(tmp_path):
    path = write_results(tmp_path / "r" / "results.json", {"cluster": "tiny"}, make_methods())
    doc = load_results(path)
    assert doc["schema"] == SCHEMA
    entry = doc["methods"]["exact@hand"]
    assert entry["ppl"] is None and entry["quality_retention"] is None
    assert entry["latency_ms"]["mean"] == pytest.approx(24.0)
    assert entry["mode"] == "home" and set(entry["utilisation"]) == {"a", "b"}
    assert not list(tmp_path.glob("r/.*tmp"))


def test_environment_names_the_processor_and_its_cores(tmp_path, monkeypatch):
    """A timing is only comparable with one taken on the same processor: every record names it."""
    import os

    from edgemoe import results

    env = results.environment()
    assert 1 <= env["cpus"] <= (os.cpu_count() or env["cpus"])
    assert env["cpu_model"] == results.cpu_model()
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Example CPU 9000\n\n"
                    "processor\t: 1\nmodel name\t: Example CPU 9000\n")
    assert results.cpu_model(info) == "Example CPU 9000"
    # no model name (some ARM kernels), or no file: the platform's name for it, or None, never an error
    info.write_text("processor\t: 0\nmodel name\t:\n")
    monkeypatch.setattr(results.platform, "processor", lambda: "")
    assert results.cpu_model(info) is None
    assert results.cpu_model(tmp_path / "missing") is None
    monkeypatch.setattr(results.platform, "processor", lambda: "aarch64")
    assert results.cpu_model(tmp_path / "missing") == "aarch64"


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d.update(schema="edgemoe.results/0"), "schema"),
    (lambda d: d["methods"]["exact@hand"].pop("remote_ratio"), "remote_ratio"),
    (lambda d: d["methods"]["exact@hand"].update(remote_ratio=1.5), "remote_ratio"),
    (lambda d: d["methods"]["exact@hand"]["latency_ms"].pop("p95"), "p95"),
    (lambda d: d.pop("environment"), "environment"),
])
def test_invalid_results_name_the_field(tmp_path, mutate, field):
    path = write_results(tmp_path / "results.json", {}, make_methods())
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(EdgeMoEError, match=field):
        load_results(path)
