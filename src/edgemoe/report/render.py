"""Plots and reports rendered from results files only (never from live state).

`render_report([results.json, ...], out_dir)` writes PNG plots, `report.md` and a standalone
`report.html` (plots embedded as base64) into `out_dir`.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np

from edgemoe.io import atomic_write_figure, atomic_write_text
from edgemoe.results import load_results, markdown_table, methods_table

from .tradeoff import plot_latency_vs_ppl_increase


def plot_latency_cdf(results: dict, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    drew = False
    for name, m in results["methods"].items():
        q = m.get("latency_quantiles_ms")
        if q:
            ax.plot(q, np.linspace(0, 1, len(q)), label=name)
            drew = True
    if not drew:
        plt.close(fig)
        return None
    ax.set_xlabel("latency per generated token (ms)")
    ax.set_ylabel("CDF")
    ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return atomic_write_figure(fig, path, bbox_inches="tight")


def plot_traffic(results: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt

    names = list(results["methods"])
    pre = [(results["methods"][n].get("traffic_prefill_bytes_per_1k_tokens") or 0) / 1e6 for n in names]
    dec = [(results["methods"][n].get("traffic_decode_bytes_per_1k_tokens")
            or results["methods"][n].get("traffic_bytes_per_1k_tokens") or 0) / 1e6 for n in names]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    y = np.arange(len(names))
    ax.barh(y, dec, label="decode")
    if any(pre):
        ax.barh(y, pre, left=dec, label="prefill")
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xlabel("cross-server traffic (MB per 1000 tokens)")
    ax.legend(fontsize=8)
    return atomic_write_figure(fig, path, bbox_inches="tight")


def plot_group_sizes(results: dict, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    g = results.get("groups")
    if not g:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, sizes in g.items():
        ax.plot(range(len(sizes)), sizes, marker="o", label=name)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("mean group size (experts)")
    ax.set_title("similarity groups by depth")
    ax.legend(fontsize=8)
    return atomic_write_figure(fig, path, bbox_inches="tight")


def plot_placements(results: dict, path: Path) -> Path | None:
    """Write `placements_figure(results)` as a PNG at `path` (None when the results hold no placements)."""
    fig = placements_figure(results)
    return None if fig is None else atomic_write_figure(fig, path)


def placements_figure(results: dict):
    """Where each placement put the experts, readable at any number of placements, layers, experts, nodes.

    Top: one [L, E] heatmap of non-cloud copies per placement, on a shared colour scale (one colour bar,
    discrete steps while the counts are small), in a grid of up to 3 columns; titles say the mean copies
    and how many experts have none. Bottom: one row per placement, one column per node, MB of experts
    held (node ticks thinned when there are many). Constrained layout keeps titles, ticks and bars apart.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, PowerNorm
    from matplotlib.ticker import MaxNLocator

    # placements that record their [L, E] copies (a replay of `evaluate --profile` written before it kept
    # them records only their mean): the others have nothing to draw
    pl = {n: v for n, v in (results.get("placements") or {}).items() if isinstance(v, dict) and "copies" in v}
    if not pl:
        return None
    names = list(pl)
    copies = {n: np.asarray(pl[n]["copies"], dtype=float) for n in names}  # [L, E] each
    L, E = next(iter(copies.values())).shape
    top = max(1, int(max(c.max() for c in copies.values())))
    ncols = min(3, len(names))
    nrows = -(-len(names) // ncols)
    panel_h = float(np.clip(0.28 * L, 1.1, 3.0))
    used = [pl[n].get("bytes_used") for n in names]
    has_nodes = all(u is not None and len(u) for u in used) and len({len(u) for u in used}) == 1
    mem_h = 0.32 * len(names) + 1.2 if has_nodes else 0.0
    fig = plt.figure(figsize=(3.6 * ncols + 1.4, nrows * (panel_h + 0.7) + mem_h + 0.4), layout="constrained")
    grid_fig, mem_fig = fig.subfigures(2, 1, height_ratios=[nrows * (panel_h + 0.7), max(mem_h, 1e-3)]) \
        if has_nodes else (fig, None)
    axes = np.atleast_2d(grid_fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False))
    cmap = plt.get_cmap("viridis", top + 1) if top <= 12 else plt.get_cmap("viridis")
    norm = BoundaryNorm(np.arange(-0.5, top + 1.5), cmap.N) if top <= 12 else plt.Normalize(0, top)
    im = None
    for i, ax in enumerate(axes.ravel()):
        if i >= len(names):
            ax.set_visible(False)
            continue
        c = copies[names[i]]
        im = ax.imshow(c, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(f"{names[i]}\nmean {c.mean():.2f} copies, {int((c == 0).sum())} uncovered", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
        ax.tick_params(labelsize=7)
        if i % ncols == 0:
            ax.set_ylabel("MoE layer", fontsize=8)
        if i // ncols == nrows - 1 or i + ncols >= len(names):
            ax.set_xlabel("expert", fontsize=8)
            ax.tick_params(labelbottom=True)
    bar = grid_fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.9, aspect=30)
    bar.set_label("copies off the cloud", fontsize=8)
    if top <= 12:
        bar.set_ticks(range(0, top + 1, max(1, (top + 1) // 7)))
    bar.ax.tick_params(labelsize=7)
    grid_fig.suptitle(f"copies of each expert ({L} layers x {E} experts)", fontsize=9)
    if has_nodes:
        mb = np.asarray(used, dtype=float) / 1e6  # [P, N]
        ax = mem_fig.subplots()
        # square-root colours: a cloud node holding every expert does not wash out the small servers
        mim = ax.imshow(mb, aspect="auto", cmap="Blues", interpolation="nearest",
                        norm=PowerNorm(0.5, vmin=0, vmax=max(float(mb.max()), 1e-9)))
        ax.set_yticks(range(len(names)), names, fontsize=7)
        N = mb.shape[1]
        step = max(1, -(-N // 40))
        node_labels = results.get("config", {}).get("nodes") or [str(n) for n in range(N)]
        ax.set_xticks(range(0, N, step), [str(node_labels[n]) for n in range(0, N, step)], fontsize=6,
                      rotation=90 if N > 12 else 0)
        ax.set_xlabel("node", fontsize=8)
        mbar = mem_fig.colorbar(mim, ax=ax, shrink=0.9, aspect=15)
        mbar.set_label("MB of experts held", fontsize=8)
        mbar.ax.tick_params(labelsize=7)
    return fig


def render_report(paths: list[str | Path], out_dir: str | Path, shown_dir: str | Path | None = None) -> Path:
    """Render every results file in `paths` into `out_dir`; returns the report.md path.

    shown_dir: the folder the report names the results files in (default: the paths as given); a report
    rendered in a staging folder that is moved into place names the files where they will be."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir = Path(out_dir)
    sections_md, sections_html = [], []
    for i, p in enumerate(paths):
        res = load_results(p)
        tag = res.get("config", {}).get("name") or Path(p).stem
        prefix = f"{i}-" if len(paths) > 1 else ""
        plots = [
            plot_latency_cdf(res, out_dir / f"{prefix}latency_cdf.png"),
            plot_traffic(res, out_dir / f"{prefix}traffic.png"),
            plot_latency_vs_ppl_increase(res, out_dir / f"{prefix}latency_quality.png"),
            plot_group_sizes(res, out_dir / f"{prefix}group_sizes.png"),
            plot_placements(res, out_dir / f"{prefix}placements.png"),
        ]
        plots = [q for q in plots if q is not None]
        table = methods_table(res)
        notes = res.get("summary", [])
        shown = p if shown_dir is None else Path(shown_dir) / Path(p).name
        md = [f"## {tag}", "", f"Results file: `{shown}`", ""]
        md += [f"- {n}" for n in notes] + ([""] if notes else [])
        md += [markdown_table(table), ""] + [f"![{q.stem}]({q.name})" for q in plots] + [""]
        sections_md.append("\n".join(md))
        rows_html = "".join(
            "<tr>" + "".join(f"<{'th' if j == 0 else 'td'}>{html.escape(c)}</{'th' if j == 0 else 'td'}>" for c in r) + "</tr>"
            for j, r in enumerate(table))
        imgs = "".join(
            f'<figure><img alt="{q.stem}" src="data:image/png;base64,{base64.b64encode(q.read_bytes()).decode()}"/></figure>'
            for q in plots)
        notes_html = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
        sections_html.append(f"<h2>{html.escape(tag)}</h2><ul>{notes_html}</ul><table>{rows_html}</table>{imgs}")
    md_text = "# edgemoe report\n\nRendered by `edgemoe report` from results files only.\n\n" + "\n".join(sections_md)
    md_path = atomic_write_text(out_dir / "report.md", md_text)
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}img{max-width:100%}")
    atomic_write_text(out_dir / "report.html",
                      f"<!doctype html><html><head><meta charset='utf-8'><title>edgemoe report</title><style>{style}</style>"
                      f"</head><body><h1>edgemoe report</h1>{''.join(sections_html)}</body></html>\n")
    return md_path
