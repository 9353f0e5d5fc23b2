"""Plots and reports rendered from results files only (never from live state).

`render_report([results.json, ...], out_dir)` writes PNG plots, `report.md` and a standalone
`report.html` (plots embedded as base64) into `out_dir`.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np

from edgemoe.eval.results import load_results
from edgemoe.io import atomic_write_figure, atomic_write_text

from .tradeoff import plot_latency_vs_ppl_increase

TABLE_COLUMNS = (
    ("placement", "placement", "{}"),
    ("policy", "policy", "{}"),
    ("mean ms", ("latency_ms", "mean"), "{:.1f}"),
    ("p50 ms", ("latency_ms", "p50"), "{:.1f}"),
    ("p99 ms", ("latency_ms", "p99"), "{:.1f}"),
    ("TTFT ms", ("ttft_ms", "mean"), "{:.1f}"),
    ("traffic MB/1k tok", "traffic_bytes_per_1k_tokens", "{:.2f}"),
    ("remote", "remote_ratio", "{:.3f}"),
    ("subst.", "substitution_ratio", "{:.3f}"),
    ("ppl", "ppl", "{:.3f}"),
    ("ppl +%", "ppl_rel_increase", "{:+.2%}"),
    ("top-1 agr.", "top1_agreement", "{:.4f}"),
    ("tok/s", "throughput_tokens_per_s", "{:.1f}"),
)


def _get(m: dict, key):
    if isinstance(key, tuple):
        v = m
        for k in key:
            v = v.get(k) if isinstance(v, dict) else None
        return v
    return m.get(key)


def methods_table(results: dict) -> list[list[str]]:
    """Rows of the comparison table: header first."""
    rows = [["method"] + [c[0] for c in TABLE_COLUMNS]]
    for name, m in results["methods"].items():
        row = [name]
        for _, key, fmt in TABLE_COLUMNS:
            v = _get(m, key)
            if key == "traffic_bytes_per_1k_tokens" and v is not None:
                v = v / 1e6
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


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


def plot_budget_sweep(results: dict, path: Path) -> Path | None:
    import matplotlib.pyplot as plt

    sweeps = results.get("budget_sweep") or {}
    if not sweeps:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in sweeps.items():
        lat = [p["latency_ms_mean"] for p in pts]
        ppl = [p["ppl"] for p in pts]
        ax.plot(lat, ppl, marker="o", label=name)
        for p in pts:
            ax.annotate(f"{p['budget']:g}", (p["latency_ms_mean"], p["ppl"]), fontsize=6)
    exact = results.get("ppl_exact")
    if exact:
        ax.axhline(exact, ls="--", color="grey", label="exact perplexity")
    ax.set_xlabel("mean latency per token (ms)")
    ax.set_ylabel("perplexity")
    ax.set_title("latency-quality trade-off (labels: budget)")
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
    import matplotlib.pyplot as plt

    pl = results.get("placements") or {}
    if not pl:
        return None
    names = list(pl)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.6 * len(names) + 0.6), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        copies = np.asarray(pl[name]["copies"])  # [L, E]
        im = ax.imshow(copies, aspect="auto", cmap="magma", vmin=0)
        ax.set_title(f"{name}: copies of each expert", fontsize=9)
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, fraction=0.03)
    axes[-1, 0].set_xlabel("expert")
    return atomic_write_figure(fig, path, bbox_inches="tight")


def render_report(paths: list[str | Path], out_dir: str | Path) -> Path:
    """Render every results file in `paths` into `out_dir`; returns the report.md path."""
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
        md = [f"## {tag}", "", f"Results file: `{p}`", ""]
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
