"""`edgemoe cluster ...` commands (mounted by edgemoe.cli): thin wrappers over the library."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from edgemoe.errors import EdgeMoEError, fail

app = typer.Typer(help="Describe and inspect clusters (nodes, links, users).", no_args_is_help=True)


@app.command()
def show(
    cluster: Annotated[str, typer.Argument(help="cluster file (.yaml/.toml) or preset name (edge8, device-edge-cloud)")],
    out: Annotated[Path | None, typer.Option("--out", help="write a topology picture (PNG) here")] = None,
    profile: Annotated[Path | None, typer.Option("--profile", help="profile folder: show memory fractions in bytes")] = None,
) -> None:
    """Print a table of the cluster's nodes and links, and optionally draw its topology."""
    from edgemoe.io import Output, check_outputs

    from .load import load_cluster
    from .schema import validate_for_model
    from .show import draw_topology, link_summary, node_table

    console = Console()
    try:
        check_outputs({"--out": Output(out)}, {"CLUSTER": cluster, "--profile": profile})
        c = load_cluster(cluster)
        total = None
        if profile is not None:
            from edgemoe.profile import load_profile

            expert_bytes = load_profile(profile).expert_bytes
            validate_for_model(c, expert_bytes)
            total = int(expert_bytes.sum())
        console.print(node_table(c, total))
        console.print(link_summary(c))
        if out is not None:
            console.print(f"topology written to {draw_topology(c, out)}")
    except EdgeMoEError as exc:
        fail(exc)


@app.command("presets")
def list_presets() -> None:
    """List the preset cluster names."""
    from .presets import PRESETS, preset_path

    for name in sorted(PRESETS):
        typer.echo(f"{name}\t{preset_path(name)}")
