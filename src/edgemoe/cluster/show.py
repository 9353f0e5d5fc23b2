"""Human views of a cluster: a table of nodes and users, and a picture of the topology (matplotlib)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from rich.table import Table

from edgemoe.io import atomic_write_with

from .schema import Cluster
from .units import format_bytes, format_rate

KIND_COLOURS = {"device": "#8fbc8f", "edge": "#4682b4", "cloud": "#b0a0d0"}


def _memory_text(node, total_expert_bytes: int | None) -> str:
    if node.kind == "cloud":
        return "all experts"
    if node.memory_bytes is not None:
        return format_bytes(node.memory_bytes)
    text = f"{node.memory_fraction:.0%} of experts"
    if total_expert_bytes:
        text += f" ({format_bytes(node.capacity_bytes(total_expert_bytes))})"
    return text


def node_table(cluster: Cluster, total_expert_bytes: int | None = None) -> Table:
    """A rich Table: one row per node (kind, memory, compute, users homed there, fastest links)."""
    table = Table(title=f"cluster {cluster.name} ({cluster.num_nodes} nodes, {cluster.num_users} users)")
    for column in ("node", "kind", "memory", "compute", "peak", "mem bw", "users", "nearest peer"):
        table.add_column(column)
    homes = cluster.user_home
    for i, node in enumerate(cluster.nodes):
        c = node.compute
        others = np.flatnonzero(np.arange(cluster.num_nodes) != i)
        if len(others):
            j = others[np.argmin(cluster.lat_s[i, others])]
            peer = f"{cluster.nodes[j].name} {cluster.lat_s[i, j] * 1e3:.3g} ms, {format_rate(cluster.bw_Bps[i, j])}"
        else:
            peer = "-"
        table.add_row(
            node.name, node.kind, _memory_text(node, total_expert_bytes), node.compute_name or "custom",
            f"{c.peak_flops / 1e12:.3g} TFLOP/s", f"{format_bytes(c.mem_bw_Bps)}/s", str(int((homes == i).sum())), peer,
        )
    return table


def cluster_table(cluster: Cluster, total_expert_bytes: int | None = None) -> str:
    """The node table and a one-line link summary as plain text."""
    from rich.console import Console

    console = Console(width=140, record=True, file=io.StringIO())
    console.print(node_table(cluster, total_expert_bytes))
    console.print(link_summary(cluster))
    return console.export_text()


def link_summary(cluster: Cluster) -> str:
    """One line: number of links and the range of all-pairs latency and bandwidth."""
    off = ~np.eye(cluster.num_nodes, dtype=bool)
    if not off.any():
        return "single node, no links"
    lat, bw = cluster.lat_s[off], cluster.bw_Bps[off]
    return (f"{len(cluster.links)} directed links; all-pairs one-way latency {lat.min() * 1e3:.3g}-"
            f"{lat.max() * 1e3:.3g} ms, bandwidth {format_rate(bw.min())}-{format_rate(bw.max())} "
            "(shortest-latency paths, bottleneck bandwidth)")


def _layout(cluster: Cluster) -> np.ndarray:
    """[N, 2] positions: a circle (clouds in the middle), or the file's position_m when every node has one."""
    if all(n.position_m is not None for n in cluster.nodes if n.kind != "cloud"):
        xy = np.array([n.position_m if n.position_m is not None else (np.nan, np.nan) for n in cluster.nodes], float)
        centre = np.nanmean(xy, axis=0)
        span = np.nanmax(np.abs(xy - centre)) or 1.0
        xy = (xy - centre) / span
        xy[np.isnan(xy[:, 0])] = (0.0, 1.35)  # clouds above the area
        return xy
    ring = [i for i, n in enumerate(cluster.nodes) if n.kind != "cloud"]
    xy = np.zeros((cluster.num_nodes, 2))
    angle = 2 * np.pi * np.arange(len(ring)) / max(len(ring), 1)
    xy[ring] = np.stack([np.cos(angle), np.sin(angle)], axis=1)
    return xy


def draw_topology(cluster: Cluster, png_path: str | Path, label_latency: bool | None = None) -> Path:
    """Draw nodes and declared links to `png_path` (written atomically); width ~ log bandwidth.

    Link labels give one-way latency in ms (default: only when there are at most 40 undirected links).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xy = _layout(cluster)
    pairs: dict[tuple[int, int], tuple[float, float]] = {}
    for link in cluster.links:
        i, j = cluster.node_index(link.src), cluster.node_index(link.dst)
        key = (min(i, j), max(i, j))
        lat, bw = pairs.get(key, (np.inf, 0.0))
        pairs[key] = (min(lat, link.latency_s), max(bw, link.bandwidth_Bps))
    if label_latency is None:
        label_latency = len(pairs) <= 40
    bws = np.array([bw for _, bw in pairs.values()]) if pairs else np.ones(1)
    lo, hi = np.log10(bws.min()), np.log10(bws.max())
    fig, ax = plt.subplots(figsize=(8, 8))
    for (i, j), (lat, bw) in pairs.items():
        width = 0.5 + 3.5 * ((np.log10(bw) - lo) / (hi - lo) if hi > lo else 0.5)
        ax.plot(*xy[[i, j]].T, color="0.55", linewidth=width, zorder=1)
        if label_latency:
            mid = xy[[i, j]].mean(axis=0)
            ax.text(*mid, f"{lat * 1e3:.3g}", fontsize=7, ha="center", va="center", color="0.25",
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8}, zorder=2)
    for i, node in enumerate(cluster.nodes):
        size = 60 if node.kind == "device" else 500
        ax.scatter(*xy[i], s=size, color=KIND_COLOURS[node.kind], edgecolor="black", zorder=3)
        ax.annotate(node.name, xy[i], xytext=(0, 12 if node.kind == "device" else 16), textcoords="offset points",
                    ha="center", fontsize=7 if node.kind == "device" else 9, zorder=4)
    for kind, colour in KIND_COLOURS.items():
        ax.scatter([], [], color=colour, edgecolor="black", label=kind)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{cluster.name}: link width ~ log bandwidth" + (", labels one-way ms" if label_latency else ""))
    ax.set_aspect("equal")
    ax.axis("off")
    path = Path(png_path)

    def write(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")

    try:
        return atomic_write_with(path, write)
    finally:
        plt.close(fig)
