"""The package's imports run one way: down the layers, never up (ast, every import, function-level too).

Layers, lowest first (a module may import its own layer and any layer below it):

 0. utilities: the `edgemoe` package itself (`__version__`), `errors`, `io`, `progress`, `params`, `jit`,
    `results` (the results-file schema and its table, which eval, report and the CLI all read and write)
 1. `data`      text sources and splits
 2. `models`    HF adapters, expert execution, the default model (trains on `data`), scoring (nll, ppl)
 3. `profile`   routing statistics from a model or a trace, and the substitution groups built from them
 4. `cluster`   nodes, links, users and the cost model (plain arrays; knows no profile or planner)
 5. `plan`      builds its `PlanProblem` from a profile and a cluster (`plan.problem`); planners
 6. `runtime`   policies, the metrics record every backend fills, and the simulator / local backends
 7. `distributed` the Ray backend (hosts runtime policies on actors)
 8. `eval`      experiments that run every backend side by side; `serve` the HTTP service (beside eval: both
                run the backends, eval for experiments, serve for clients; neither imports the other)
 9. `report`    plots and reports from results files
10. `cli`       `edgemoe.cli`, the typer app over everything

ARCHITECTURE.md lists the packages in pipeline order (models, data, ...); the code decides the order of
`data` and `models` (models.train and models.tiny read text from `data`; `data` imports no model).
Sub-package `cli` modules (`cluster.cli`, `plan.cli`, `distributed.cli`) belong to their package's layer.
Every import counts, including ones inside functions: a lazy import still makes the lower layer depend
on the higher one, it only hides it from import time.

No exception: a module that needs something from a higher layer means that thing lives too high.
No import circle anywhere in the package (every module, every import, lazy ones too).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "edgemoe"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("", "errors", "io", "progress", "params", "jit", "results"),
    ("data",),
    ("models",),
    ("profile",),
    ("cluster",),
    ("plan",),
    ("runtime",),
    ("distributed",),
    ("eval", "serve"),
    ("report",),
    ("cli",),
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(module: str) -> set[str]:
    """Every edgemoe module `module` imports, at any depth of its code (names resolved to modules)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found.update(subs or [target])
    return {m for m in found if m == "edgemoe" or m.startswith("edgemoe.")}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return LAYER_OF[top]


def upward_imports() -> dict[tuple[str, str], None]:
    return {(m, t): None for m in MODULES for t in sorted(imports_of(m)) if layer(t) > layer(m)}


def test_every_package_has_a_layer():
    tops = {m.split(".")[1] if "." in m else "" for m in MODULES}
    assert tops <= set(LAYER_OF), f"place these in LAYERS: {sorted(tops - set(LAYER_OF))}"


def test_the_scan_sees_imports_inside_functions():
    # cluster.cli imports profile inside a function; plan.base imports plan._load_all inside one
    assert "edgemoe.profile" in imports_of("edgemoe.cluster.cli")
    assert "edgemoe.plan._load_all" in imports_of("edgemoe.plan.base")
    assert "edgemoe.cluster.schema" in imports_of("edgemoe.cluster.presets")


def test_no_module_imports_a_higher_layer():
    found = upward_imports()
    assert not found, "imports up the layers (move the code down, or the import up):\n" + "\n".join(
        f"  {m} (layer {layer(m)}) imports {t} (layer {layer(t)})" for m, t in sorted(found))


def test_data_flows_profile_cluster_plan():
    # the edges this layering was introduced for (issue 10): no way back from cluster to plan or profile
    cluster = [m for m in MODULES if m.startswith("edgemoe.cluster") and m != "edgemoe.cluster.cli"]
    for m in cluster:
        assert not {t for t in imports_of(m) if t.startswith(("edgemoe.plan", "edgemoe.profile"))}, m


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle in `graph` (node -> nodes it points to): its nodes in order, the first repeated last; or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t, path + [t])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m, [m])):
            return cycle
    return None


def import_cycle(modules: set[str]) -> list[str] | None:
    """One import circle among `modules`, or None."""
    return find_cycle({m: {t for t in imports_of(m) if t in modules} - {m} for m in modules})


def test_the_cycle_check_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    # the simulator's engines share runtime.sim.run instead of importing each other (des <-> simulate once)
    assert "edgemoe.runtime.sim.run" in imports_of("edgemoe.runtime.sim.des")
    assert "edgemoe.runtime.sim.simulate" not in imports_of("edgemoe.runtime.sim.des")


def test_no_import_cycle_in_any_package():
    packages = sorted({m for m in MODULES if MODULES[m].name == "__init__.py"})
    for package in packages:
        inside = {m for m in MODULES if m == package or m.startswith(package + ".")}
        cycle = import_cycle(inside)
        assert cycle is None, f"import cycle in {package}: " + " -> ".join(cycle)
