"""`edgemoe plan` end to end: synthetic profile on disk + a small cluster file -> placement.json."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from edgemoe.errors import EdgeMoEError
from edgemoe.plan.base import load_placement
from edgemoe.plan.cli import parse_params, plan_command
from edgemoe.profile import synthetic_profile


@pytest.fixture(scope="module")
def files(tmp_path_factory, three_edge_cluster_yaml):
    root = tmp_path_factory.mktemp("plan_cli")
    profile = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=400, expert_bytes=1_000_000, seed=0)
    profile.save(root / "profile")
    (root / "cluster.yaml").write_text(three_edge_cluster_yaml)
    return root


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("plan")(plan_command)

    @app.callback()
    def _root() -> None:  # a group, so the command is invoked by name as in `edgemoe plan`
        pass

    return app


def _run(files, *args):
    return CliRunner().invoke(_app(), ["plan", "--profile", str(files / "profile"),
                                       "--cluster", str(files / "cluster.yaml"), *args])


@pytest.mark.parametrize("method", ["ordermoe", "uniform", "lfu", "eplb"])
def test_plan_writes_placement_and_expert_map(files, method):
    out, emap = files / f"{method}.json", files / f"{method}-map.json"
    result = _run(files, "--method", method, "--out", str(out), "--expert-map", str(emap))
    assert result.exit_code == 0, result.output
    assert "placement by" in result.output and "coverage 100.0%" in result.output
    placement = load_placement(out)
    assert placement.method == method
    assert placement.node_names == ("a", "b", "c")
    assert (placement.bytes_used() <= np.array([12, 12, 8]) * 1_000_000).all()
    assert placement.hosts.any(axis=0).all()  # no cloud: every expert somewhere
    layers = json.loads(emap.read_text())["layers"]
    assert len(layers) == 4 and all(len(layers[0][str(e)]) >= 1 for e in range(8))
    assert set(layers[0]["0"]) <= {"a", "b", "c"}


def test_plan_passes_params(files):
    out = files / "no-redundancy.json"
    result = _run(files, "--method", "ordermoe", "--param", "algorithm=two-stage", "--param", "redundancy=false",
                  "--param", "gamma=0.25", "--param", "grouping=uniform", "--out", str(out))
    assert result.exit_code == 0, result.output
    params = json.loads(out.read_text())["params"]
    assert params["redundancy"] is False and params["gamma"] == 0.25 and params["grouping"] == "uniform"
    assert (load_placement(out).replicas() == 1).all()


def test_plan_errors_name_the_problem(files):
    bad_param = _run(files, "--method", "ordermoe", "--param", "colour=red", "--out", str(files / "x.json"))
    assert bad_param.exit_code == 2 and "colour" in bad_param.output and "theta_hi" in bad_param.output
    bad_method = _run(files, "--method", "nonsense", "--out", str(files / "x.json"))
    assert bad_method.exit_code == 2 and "nonsense" in bad_method.output
    assert not (files / "x.json").exists()


def test_parse_params():
    assert parse_params(["a=1", "b=0.5", "c=true", "d=No", "e=none", "f=edge,device", "g=1e-3"]) == {
        "a": 1, "b": 0.5, "c": True, "d": False, "e": None, "f": "edge,device", "g": 1e-3}
    with pytest.raises(EdgeMoEError, match="key=value"):
        parse_params(["novalue"])
    with pytest.raises(EdgeMoEError, match="twice"):
        parse_params(["a=1", "a=2"])


def test_plan_with_the_lp_start_records_its_bound(files):
    out = files / "slim-lp.json"
    result = _run(files, "--method", "slimcaching", "--param", "warm_start=lp", "--out", str(out))
    assert result.exit_code == 0, result.output
    params = load_placement(out).params
    assert 0 < params["lp_bound_s"] <= params["objective_s"] * (1 + 1e-7)
    refused = _run(files, "--method", "slimcaching", "--param", "warm_start=lp", "--param", "lp_max_nonzeros=10",
                   "--out", str(files / "never.json"))
    assert refused.exit_code != 0 and not (files / "never.json").exists()
    assert "lp_max_nonzeros" in refused.output
