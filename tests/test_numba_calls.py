"""Calls between compiled functions pass no compile-time constants (a source check, nothing compiled).

numba compiles a function once per distinct argument signature, and a constant (`True`, `0`, a module-level
`RULE_EXACT`) passed from one compiled function to another is typed as a literal: the callee then compiles a
second copy for it beside the one its other callers use. `engine._wave_step` (~18 CPU s cold) and
`rules._decide_rows` were each compiled twice or more that way, until the callers passed `np.bool_(True)` and
`np.int64(...)`. Inlined callees (`inline="always"`) are copied into their caller and are not affected.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "edgemoe"


def _njit_kind(func: ast.FunctionDef) -> str | None:
    """"inline" or "call" for a function decorated with njit(...), else None."""
    for dec in func.decorator_list:
        call = dec if isinstance(dec, ast.Call) else None
        name = (call.func if call else dec)
        if isinstance(name, ast.Name) and name.id == "njit":
            inline = any(k.arg == "inline" and isinstance(k.value, ast.Constant) and k.value.value == "always"
                         for k in (call.keywords if call else []))
            return "inline" if inline else "call"
    return None


def _compiled_functions() -> dict[str, list[tuple[Path, ast.FunctionDef, str]]]:
    out: dict[str, list] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and (kind := _njit_kind(node)):
                out.setdefault(node.name, []).append((path, node, kind))
    return out


def _constant_arguments(call: ast.Call) -> list[str]:
    """The arguments of `call` that numba types as literals: constants and module-level UPPER_CASE names."""
    bad = []
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        if isinstance(arg, ast.Constant) or (isinstance(arg, ast.Name) and arg.id.isupper()):
            bad.append(ast.unparse(arg))
    return bad


def test_the_source_has_compiled_calls_to_check():
    compiled = _compiled_functions()
    called = {name for name, defs in compiled.items() if any(kind == "call" for _, _, kind in defs)}
    assert {"_wave_step", "_decide_rows", "_decide_ordermoe"} <= called


def test_compiled_callers_pass_no_constants_to_compiled_callees():
    compiled = _compiled_functions()
    callees = {name for name, defs in compiled.items() if all(kind == "call" for _, _, kind in defs)}
    found = []
    for defs in compiled.values():
        for path, func, _ in defs:
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in callees:
                    bad = _constant_arguments(node)
                    if bad:
                        found.append(f"{path.relative_to(SRC)}:{node.lineno} {func.name} -> {node.func.id}({', '.join(bad)})")
    assert not found, "constants typed as literals (wrap them: np.int64(...), np.bool_(...)):\n" + "\n".join(found)


def test_the_check_sees_a_literal_argument():
    tree = ast.parse("f(True, x, RULE_EXACT, np.int64(0), b=0)")
    assert _constant_arguments(tree.body[0].value) == ["True", "RULE_EXACT", "0"]
