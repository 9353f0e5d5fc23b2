"""End-to-end CLI runs on tiny inputs."""

import json

import pytest
from typer.testing import CliRunner

from edgemoe.cli import app
from edgemoe.models.tiny import FAMILIES, save_tiny
from edgemoe.profile import load_profile

runner = CliRunner()


@pytest.mark.parametrize("family", FAMILIES)
def test_profile_tiny_model_end_to_end(tmp_path, family):
    model = save_tiny(family, tmp_path / "model")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 300)
    out = tmp_path / "prof"
    result = runner.invoke(app, ["profile", "--model", str(model), "--data", str(tmp_path / "text.txt"),
                                 "--tokens", "640", "--block-len", "32", "--subst-tokens", "64",
                                 "--out", str(out), "--report", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    prof = load_profile(out)
    K = 1 if family == "switch_transformers" else 2
    assert f"L={prof.L} MoE layers, E=8, K={K}" in result.output
    assert prof.num_tokens == 640 and prof.meta.model == str(model) and prof.meta.family == family
    rep = json.loads((tmp_path / "rep" / "specialisation.json").read_text())
    assert len(rep["domain_expert_mutual_information_bits"]) == prof.L
    assert (tmp_path / "rep" / "usage_heatmaps.png").stat().st_size > 1000


def test_profile_bad_model_path_is_one_clear_error(tmp_path):
    result = runner.invoke(app, ["profile", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "p")])
    assert result.exit_code == 2
    assert "does not exist" in result.output
    assert not (tmp_path / "p").exists()


def test_profile_empty_data_is_one_clear_error(tmp_path):
    model = save_tiny("olmoe", tmp_path / "model")
    (tmp_path / "empty.txt").write_text("")
    result = runner.invoke(app, ["profile", "--model", str(model), "--data", str(tmp_path / "empty.txt"),
                                 "--out", str(tmp_path / "p")])
    assert result.exit_code == 2 and "empty" in result.output


def test_evaluate_and_report_end_to_end(tmp_path):
    """Profile (cached), plan, local backend, simulator, results file, report: all from the CLI."""
    model = save_tiny("mixtral", tmp_path / "model")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 400)
    out = tmp_path / "res.md"  # an odd suffix: the experiment's own res.json name must not touch the sibling
    (tmp_path / "res.json").write_text("the user's own file")
    result = runner.invoke(app, [
        "evaluate", "--model", str(model), "--out", str(out), "--cluster", "edge8",
        "--eval-data", str(tmp_path / "text.txt"), "--calib-data", str(tmp_path / "text.txt"),
        "--eval-tokens", "512", "--calib-tokens", "1024", "--cache-dir", str(tmp_path / "cache"),
        "--method", "exact=uniform:exact", "--method", "om=ordermoe:ordermoe:budget=0.0,horizon=1"])
    assert result.exit_code == 0, result.output
    res = json.loads(out.read_text())
    assert (tmp_path / "res.json").read_text() == "the user's own file"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work folder left behind
    assert res["schema"] == "edgemoe.results/1" and set(res["methods"]) == {"exact", "om"}
    # budget 0: OrderMoE makes exact decisions, so the model's quality is untouched
    assert res["methods"]["om"]["ppl"] == res["methods"]["exact"]["ppl"] == res["ppl_exact"]
    for _ in range(2):  # the second run writes into the folder the first one made (ours)
        rep = runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "rep")])
        assert rep.exit_code == 0, rep.output
    assert "| exact |" in (tmp_path / "rep" / "report.md").read_text()


def test_evaluate_bad_method_spec(tmp_path):
    result = runner.invoke(app, ["evaluate", "--out", str(tmp_path / "r.json"), "--method", "nonsense"])
    assert result.exit_code == 2 and "NAME=PLACEMENT:POLICY" in result.stderr and not result.stdout


def test_console_entry_is_the_catcher(capsys):
    """pyproject's `edgemoe` script is cli.main, which exits 2 with one stderr line on bad input."""
    import tomllib
    from pathlib import Path

    from edgemoe.cli import main

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["edgemoe"] == "edgemoe.cli:main"
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--profile", "nope", "--cluster", "edge8", "--method", "exact", "--param", "time_limit=-1"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    assert captured.err.startswith("error: --param time_limit=-1") and captured.err.count("\n") == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "plan" in capsys.readouterr().out


def test_profile_replaces_its_own_output_and_keeps_the_report_folder_ours(tmp_path):
    """A second run over the same --out and --report folders is allowed (they are edgemoe's)."""
    model = save_tiny("mixtral", tmp_path / "model")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 100)
    args = ["profile", "--model", str(model), "--data", str(tmp_path / "text.txt"), "--tokens", "64",
            "--block-len", "32", "--subst-tokens", "16", "--out", str(tmp_path / "p"), "--report", str(tmp_path / "r")]
    for _ in range(2):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.stderr
    assert load_profile(tmp_path / "p").num_tokens == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "p", "r", "text.txt"]
