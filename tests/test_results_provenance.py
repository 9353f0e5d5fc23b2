"""Every committed results file can be made again by `make results`: it records (`environment.argv`) one of the
recipe's commands, word for word, and a clean tree (`environment.git_dirty` false). A file made with other
arguments (fewer tokens, a part of a run merged by hand) or from uncommitted code is one the README's
provenance table would name but no one could regenerate."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def recipe_commands(makefile: str) -> list[tuple[str, ...]]:
    """The `results` target's commands, variables expanded, each as the words its program sees after the
    program itself: ("edgemoe", args...) or ("-m", "bench.x.y", args...); the `for m in $(BENCH)` loop gives
    one ("-m", "bench." + m) per module."""
    variables = {name: value.replace("\\\n", " ")
                 for name, value in re.findall(r"^(\w+) :?= ((?:.*\\\n)*.*)$", makefile, re.M)}
    recipe = re.search(r"^results:.*\n((?:\t.*\n?)+)", makefile, re.M)
    assert recipe, "the Makefile has no `results` target"
    text = recipe.group(1).replace("\\\n", " ")
    for name, value in variables.items():
        text = text.replace(f"$({name})", value)
    commands = []
    for line in (raw.strip() for raw in text.splitlines()):
        if not line or line.startswith("#"):
            continue
        loop = re.match(r"for m in (.*?); do", line)
        if loop:
            commands += [("-m", "bench." + m) for m in loop.group(1).split()]
            continue
        words = shlex.split(line)
        if words[0].endswith("/edgemoe"):
            commands.append(("edgemoe", *words[1:]))
        elif "-m" in words:
            commands.append(tuple(words[words.index("-m"):]))
    return commands


def as_command(argv: list[str]) -> tuple[str, ...]:
    """A results file's recorded argv in `recipe_commands`' form (`python -m pkg.mod` records the module's
    path as argv[0])."""
    if argv[0].endswith("/edgemoe"):
        return ("edgemoe", *argv[1:])
    # the last `bench/` folder of the path: a checkout may sit in a folder whose name ends in "bench" (wt-bench/)
    module = re.match(r".*(?:^|/)(bench/[\w/]+)\.py$", argv[0])
    return ("-m", module.group(1).replace("/", "."), *argv[1:]) if module else tuple(argv)


def test_a_recorded_script_path_names_its_module_from_the_last_bench_folder():
    assert as_command(["/work/wt-bench/bench/studies/x.py", "--k", "1"]) == ("-m", "bench.studies.x", "--k", "1")
    assert as_command(["/a/bench/bench/speed/y.py"]) == ("-m", "bench.speed.y")
    assert as_command(["bench/tools/z.py"]) == ("-m", "bench.tools.z")
    assert as_command(["/x/.venv/bin/edgemoe", "demo"]) == ("edgemoe", "demo")


def test_the_recipe_parser_reads_loops_variables_and_quotes():
    makefile = ('BIN := .venv/bin\nB := x.y \\\n\tz.w\nresults: stamp\n\t$(BIN)/edgemoe demo --out a\n'
                '\t# a comment\n\tfor m in $(B); do $(BIN)/python -m bench.$$m || exit 1; done\n'
                '\t$(BIN)/python -m bench.q --note "two words" \\\n\t\t--k 1\n\nother:\n\techo no\n')
    assert recipe_commands(makefile) == [("edgemoe", "demo", "--out", "a"), ("-m", "bench.x.y"), ("-m", "bench.z.w"),
                                         ("-m", "bench.q", "--note", "two words", "--k", "1")]
    assert as_command(["/r/bench/studies/q.py", "--k", "1"]) == ("-m", "bench.studies.q", "--k", "1")
    assert as_command(["/r/.venv/bin/edgemoe", "demo"]) == ("edgemoe", "demo")


RECIPE = recipe_commands((ROOT / "Makefile").read_text())


def _results_files() -> list[Path]:
    """Every results document (a JSON object), without the dot-files that mark an output folder as edgemoe's."""
    return sorted(p for p in RESULTS.rglob("*.json")
                  if not p.name.startswith(".") and isinstance(json.loads(p.read_text()), dict))


@pytest.mark.parametrize("path", _results_files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_every_results_file_comes_from_a_committed_tree_and_a_recipe_command(path):
    env = json.loads(path.read_text()).get("environment")
    assert env and env.get("argv"), f"{path}: records no environment.argv"
    assert env.get("git_dirty") is False, f"{path}: made from a tree with uncommitted changes ({env.get('git_commit')})"
    assert as_command(env["argv"]) in RECIPE, (
        f"{path}: made by `{shlex.join(as_command(env['argv']))}`, which is not a command of `make results`")
