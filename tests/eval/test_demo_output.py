"""`edgemoe demo` writes its folder all or nothing (issue 22): results and report are made in a private
folder beside --out and moved in only when every comparison and the report are done."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

import edgemoe.eval.experiment as experiment
from edgemoe.cli import app
from edgemoe.errors import EdgeMoEError
from edgemoe.results import load_results, write_document

SHIPPED = Path(__file__).resolve().parents[2] / "bench" / "results" / "demo" / "slimcaching-device-edge-cloud.json"


def one_comparison_then(fail: bool):
    """A stand-in for run_demo (the real one runs minutes): writes one real results file where it is told,
    as the first comparison does, then fails (a later comparison breaking) or returns."""

    def run_demo(cfg, out, backend="simulate", **_kw):
        path = write_document(Path(out) / SHIPPED.name, load_results(SHIPPED))
        if fail:
            raise EdgeMoEError("the second comparison failed")
        return [path]

    return run_demo


def test_a_failed_demo_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(experiment, "run_demo", one_comparison_then(fail=True))
    result = CliRunner().invoke(app, ["demo", "--quick", "--out", str(tmp_path / "demo")])
    assert result.exit_code == 2 and "second comparison failed" in result.stderr, result.output
    assert list(tmp_path.iterdir()) == []  # neither the folder nor the staging folder beside it


def test_a_failed_demo_keeps_the_previous_run(tmp_path, monkeypatch):
    out = tmp_path / "demo"
    monkeypatch.setattr(experiment, "run_demo", one_comparison_then(fail=False))
    assert CliRunner().invoke(app, ["demo", "--quick", "--out", str(out)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(experiment, "run_demo", one_comparison_then(fail=True))
    assert CliRunner().invoke(app, ["demo", "--quick", "--out", str(out)]).exit_code == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


def test_a_finished_demo_names_its_files_where_they_are(tmp_path, monkeypatch):
    out = tmp_path / "demo"
    monkeypatch.setattr(experiment, "run_demo", one_comparison_then(fail=False))
    result = CliRunner().invoke(app, ["demo", "--quick", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / SHIPPED.name).is_file() and (out / "report.html").is_file()
    assert f"Results file: `{out / SHIPPED.name}`" in (out / "report.md").read_text()
    assert str(out / SHIPPED.name) in result.stdout
