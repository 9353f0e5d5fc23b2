"""The README's results block is what `bench/tools/tables.py` prints from the committed results files.

Nothing is re-measured: the script only reads bench/results/*.json (and the shipped models' recipes), so this
test is a diff of text. When it fails, run `python -m bench.tools.tables --write` and commit the README with the
results files that changed it.
"""

from __future__ import annotations

import importlib
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
