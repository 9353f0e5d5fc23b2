"""`edgemoe plan`: run a planner on a profile and a cluster, print a summary, write placement.json.

`plan_command` is a plain typer command function; edgemoe.cli registers it as `plan`. The heavy imports
(profile, cluster, planners) happen inside it so `edgemoe --help` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from edgemoe.errors import EdgeMoEError, fail
from edgemoe.params import parse_params

from .base import Placement, PlanProblem

EXPERT_MAP_SCHEMA = "edgemoe.expert_map/1"


def check_params(method: str, params: dict) -> dict:
    """`params` typed and range-checked for planner `method` (edgemoe.params.validate_params); raises
    EdgeMoEError if the method is unknown, a name is not one it takes (listing those), or a value is bad."""
    from edgemoe.params import validate_params

    from .base import planners

    table = planners()
    if method not in table:
        raise EdgeMoEError(f"unknown planner method {method!r}; expected one of {sorted(table)}")
    settings = getattr(table[method], "settings_class", None)  # a planner whose knobs are a settings dataclass
    if settings is not None:
        return validate_params(settings, params, f"planner {method!r}", skip=0)
    return validate_params(table[method], params, f"planner {method!r}")


def placement_summary(problem: PlanProblem, placement: Placement) -> dict:
    """Numbers the summary table shows: bytes per node, replica statistics, coverage and home hits.

    coverage: share of experts with at least one non-cloud copy. home_hit_share: share of the users'
    expert activations (token-weighted) whose expert sits on the user's home node.
    """
    used = placement.bytes_used()
    replicas = placement.replicas()
    freq = problem.user_freq()  # [U, L, E]
    at_home = placement.hosts[problem.user_home]  # [U, L, E]
    weighted = problem.user_weight[:, None, None] * freq
    total = weighted.sum()
    return {
        "nodes": [
            {"name": name, "kind": kind, "capacity_bytes": int(cap), "bytes_used": int(u),
             "experts": int(placement.hosts[n].sum())}
            for n, (name, kind, cap, u) in enumerate(zip(problem.node_names, problem.node_kind,
                                                          problem.capacity_bytes, used, strict=True))
        ],
        "replicas_mean": float(replicas.mean()),
        "replicas_max": int(replicas.max()),
        "coverage": float((replicas > 0).mean()),
        "home_hit_share": float((weighted * at_home).sum() / total) if total > 0 else 0.0,
    }


def _summary_table(summary: dict, method: str, seconds: float):
    from rich.table import Table

    table = Table(title=f"placement by {method} ({seconds:.2f} s)")
    for col in ("node", "kind", "capacity MB", "used MB", "used %", "experts"):
        table.add_column(col, justify="left" if col in ("node", "kind") else "right")
    for row in summary["nodes"]:
        cap = row["capacity_bytes"]
        pct = "-" if row["kind"] == "cloud" or cap == 0 else f"{100 * row['bytes_used'] / cap:.0f}"
        table.add_row(row["name"], row["kind"], f"{cap / 1e6:.1f}", f"{row['bytes_used'] / 1e6:.1f}", pct,
                      str(row["experts"]))
    return table


def _summary_lines(summary: dict) -> str:
    return (f"replicas per expert: mean {summary['replicas_mean']:.2f}, max {summary['replicas_max']}\n"
            f"coverage {100 * summary['coverage']:.1f}% (experts with a copy off the cloud)\n"
            f"home hits {100 * summary['home_hit_share']:.1f}% (activations whose expert is on the user's home node)")


def write_expert_map(placement: Placement, path: Path) -> Path:
    """Write the vLLM/SGLang-style per-layer map {layer: {expert: [nodes]}} as JSON, atomically."""
    from edgemoe.io import atomic_write_json

    return atomic_write_json(path, {
        "schema": EXPERT_MAP_SCHEMA, "method": placement.method, "nodes": list(placement.node_names),
        "layers": placement.expert_map(),
    })


def plan_command(
    profile: Annotated[Path, typer.Option("--profile", help="profile folder (edgemoe profile --out ...)")],
    cluster: Annotated[str, typer.Option("--cluster", help="cluster file (.yaml/.toml) or preset name")],
    method: Annotated[str, typer.Option("--method", help="planner name, e.g. ordermoe, slimcaching, lfu")],
    param: Annotated[list[str] | None, typer.Option("--param", help="planner parameter key=value (repeatable)")] = None,
    out: Annotated[Path, typer.Option("--out", help="placement JSON to write")] = Path("placement.json"),
    expert_map: Annotated[Path | None, typer.Option("--expert-map", help="also write a per-layer expert map JSON")] = None,
    domain_fallback: Annotated[bool, typer.Option(
        "--domain-fallback", help="map cluster user domains the profile lacks round-robin onto its domains")] = False,
) -> None:
    """Decide which node holds which experts, print a summary, and write the placement."""
    from rich.console import Console

    from edgemoe.cluster.load import load_cluster
    from edgemoe.io import Output, check_outputs
    from edgemoe.plan.base import plan
    from edgemoe.plan.exact import TIME_LIMIT_S
    from edgemoe.plan.problem import plan_problem
    from edgemoe.profile import load_profile
    from edgemoe.progress import ticker

    console = Console()
    try:
        params = check_params(method, parse_params(param))
        check_outputs({"--out": Output(out), "--expert-map": Output(expert_map)},
                      {"--profile": profile, "--cluster": cluster})
        prof = load_profile(profile)
        problem = plan_problem(prof, load_cluster(cluster), domain_fallback=domain_fallback)
        start = time.perf_counter()
        # exact: a bar towards HiGHS's wall-clock safety cap (it usually stops earlier, at its node limit or optimum)
        limit = params.get("time_limit", TIME_LIMIT_S) if method == "exact" else None
        with ticker(f"planning with {method} ({prof.L} layers x {prof.E} experts, {problem.num_nodes} nodes, "
                    f"{len(problem.user_names)} users)", total_s=limit):
            placement = plan(problem, method, **params)
        seconds = time.perf_counter() - start
        written = placement.save(out)
        summary = placement_summary(problem, placement)
        console.print(_summary_table(summary, method, seconds))
        console.print(_summary_lines(summary))
        console.print(f"wrote {written}")
        if expert_map is not None:
            console.print(f"wrote {write_expert_map(placement, expert_map)}")
    except EdgeMoEError as exc:
        fail(exc)


__all__ = ["EXPERT_MAP_SCHEMA", "check_params", "parse_params", "placement_summary", "plan_command", "write_expert_map"]
