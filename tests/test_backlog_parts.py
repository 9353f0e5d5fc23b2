"""bench.common.write_backlog_part: backlog_scenarios.json is made in parts, one per script and model; a new run
of a script and model replaces that pair's earlier part (whatever its other arguments), and leaves the others."""
import json

import bench.common as common


def _write(path, monkeypatch, argv, method):
    monkeypatch.setattr(common, "BACKLOG_FILE", path)
    return common.write_backlog_part([{"model": argv[1], "method": method, "mean_ms": 1.0}], argv=argv)


def test_a_run_replaces_its_script_and_models_part_only(tmp_path, monkeypatch):
    path = tmp_path / "backlog_scenarios.json"
    script = str(common.RESULTS.parent / "studies" / "backlog_paper.py")
    _write(path, monkeypatch, [script, "qwen", "olmoe", "H0,H2"], "H2")
    _write(path, monkeypatch, [script, "mixtral", "mixtral", "H0,H2"], "H2")
    _write(path, monkeypatch, [script, "qwen", "olmoe", "H0,H2,H2-priced"], "H2-priced")
    doc = json.loads(path.read_text())
    assert sorted(doc["parts"]) == ["studies.backlog_paper mixtral mixtral H0,H2",
                                    "studies.backlog_paper qwen olmoe H0,H2,H2-priced"]
    # the flat rows follow the parts: the replaced part's rows are gone, each row names its command
    assert [(r["model"], r["method"]) for r in doc["rows"]] == [("mixtral", "H2"), ("qwen", "H2-priced")]
    assert doc["rows"][1]["command"] == "python -m bench.studies.backlog_paper qwen olmoe H0,H2,H2-priced"


def test_a_model_whose_name_extends_another_keeps_its_part(tmp_path, monkeypatch):
    path = tmp_path / "backlog_scenarios.json"
    script = str(common.RESULTS.parent / "studies" / "backlog_demo.py")
    _write(path, monkeypatch, [script, "default-upcycled", "migrate"], "H2")
    _write(path, monkeypatch, [script, "default", "migrate,home"], "H2")
    assert sorted(json.loads(path.read_text())["parts"]) == ["studies.backlog_demo default migrate,home",
                                                             "studies.backlog_demo default-upcycled migrate"]
