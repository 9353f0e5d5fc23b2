"""The README's results block is what `bench/tools/tables.py` prints from the committed results files.

Nothing is re-measured: the script only reads bench/results/*.json (and the shipped models' recipes), so this
test is a diff of text. When it fails, run `python -m bench.tools.tables --write` and commit the README with the
results files that changed it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tables(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is run from the repository root as a package
    return importlib.import_module("bench.tools.tables")


def test_readme_block_is_what_tables_prints(tables):
    _, block, _ = tables.split_readme((ROOT / "README.md").read_text())
    assert block == tables.render(), "README.md is stale: run `python -m bench.tools.tables --write`"


def test_check_flags_a_stale_block_and_write_repairs_it(tables, tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{tables.BEGIN}\nan old figure: 42 ms\n{tables.END}\nafter\n")
    monkeypatch.setattr(tables, "README", readme)
    assert tables.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert tables.main(["--write"]) == 0
    text = readme.read_text()
    assert text.startswith(f"intro\n{tables.BEGIN}\n") and text.endswith(f"{tables.END}\nafter\n")
    assert "42 ms" not in text and tables.main(["--check"]) == 0


def test_missing_markers_are_a_clear_error(tables, tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    monkeypatch.setattr(tables, "README", readme)
    with pytest.raises(SystemExit, match="expected one line"):
        tables.main(["--check"])


def test_every_results_file_is_in_the_provenance_table(tables):
    """Each committed results file gets a row; what it does not record reads 'not recorded', never a guess."""
    text = "\n".join(tables.provenance())
    for path in tables._files():
        assert f"`{path.relative_to(tables.RESULTS).as_posix()}`" in text


def test_backlog_table_divides_by_h0_and_bolds_the_defaults_misses(tables, tmp_path, monkeypatch):
    """Known answer on two small files: each cell is the method's mean over H=0's on the same scenario, four
    digits within 0.5% of 1, bold only in the default's column and only above 1."""
    def row(method, mean, **labels):
        return {**labels, "method": method, "mean_ms": mean}

    scen = {"rows": [row("H0", 10.0, model="m", mode="migrate", point="paper"),
                     row("H2", 10.2, model="m", mode="migrate", point="paper"),
                     row("H2-now", 9.0, model="m", mode="migrate", point="paper"),
                     row("H2-off", 10.3, model="m", mode="migrate", point="paper"),
                     row("H2-priced", 9.99, model="m", mode="migrate", point="paper"),
                     row("ordermoe-H0", 20.0, model="big"), row("ordermoe-H2", 18.0, model="big"),
                     row("oracle", 16.0, model="big")]}
    deep = {"rows": [{"cluster": "edge8", "budget": b, "method": m, "mean_vs_H0": v}
                     for b in (0.0, 0.05) for m, v in (("ordermoe-H0", 1.0), ("ordermoe-H2", 1.001 + b),
                                                       ("ordermoe-H2-now", 0.9), ("ordermoe-H2-off", 0.95),
                                                       ("oracle", 0.8))]}
    (tmp_path / "backlog_scenarios.json").write_text(json.dumps(scen))
    (tmp_path / "lookahead_backlog.json").write_text(json.dumps(deep))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    text = "\n".join(tables.backlog_table())
    assert "| lookahead, edge8, budget 0 / 0.05 | 0.800 / 0.800 | **1.0010** / 1.051 | 0.900 / 0.900 | 0.950 / 0.950 | - |" \
        in text.replace("**1.051**", "1.051")
    assert "**1.051**" in text  # (1.051 is above 1 in the default's column: bold too)
    assert "| paper scale, big, testbed8 | 0.800 | 0.900 | - | - | - |" in text
    assert "| demo edge8 migrate, m, paper | - | **1.020** | 0.900 | 1.030 | 0.9990 |" in text
