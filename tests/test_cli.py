"""End-to-end CLI runs on tiny inputs."""

import json

from typer.testing import CliRunner

from edgemoe.cli import app
from edgemoe.models.tiny import save_tiny
from edgemoe.profile import load_profile

runner = CliRunner()


def test_profile_tiny_model_end_to_end(tmp_path):
    model = save_tiny("mixtral", tmp_path / "model")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 300)
    out = tmp_path / "prof"
    result = runner.invoke(app, ["profile", "--model", str(model), "--data", str(tmp_path / "text.txt"),
                                 "--tokens", "640", "--block-len", "32", "--subst-tokens", "64",
                                 "--out", str(out), "--report", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert "L=3 MoE layers, E=8, K=2" in result.output
    prof = load_profile(out)
    assert prof.num_tokens == 640 and prof.meta.model == str(model)
    rep = json.loads((tmp_path / "rep" / "specialisation.json").read_text())
    assert len(rep["domain_expert_mutual_information_bits"]) == 3
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
