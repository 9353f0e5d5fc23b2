"""Latency against perplexity increase: every method of a results file on one figure (from the file only)."""

from __future__ import annotations

from pathlib import Path

from edgemoe.io import atomic_write_figure

MARKERS = {"exact": "s", "slimcaching": "s", "drop": "x", "ordermoe": "o", "oracle": "*"}


def plot_latency_vs_ppl_increase(results: dict, path: Path) -> Path | None:
    """Mean latency per token (y) against perplexity increase over exact execution in % (x, symlog) for every
    method (one marker per policy kind, named), with the budget sweep of a policy as a line and the named
    operating points marked. None when no method carries `ppl_rel_increase`."""
    import matplotlib.pyplot as plt

    methods = {k: v for k, v in results["methods"].items() if v.get("ppl_rel_increase") is not None}
    if not methods:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.6))
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
    for i, (name, pts) in enumerate((results.get("budget_sweep") or {}).items()):
        pts = sorted((p for p in pts if p.get("ppl_rel_increase") is not None), key=lambda p: p["budget"])
        if pts:
            c = colours[i % len(colours)]
            ax.plot([100 * p["ppl_rel_increase"] for p in pts], [p["latency_ms_mean"] for p in pts], "-", color=c,
                    alpha=0.6, label=f"{name}: budget sweep")
            for p in pts:
                ax.annotate(f"b={p['budget']:.3g}", (100 * p["ppl_rel_increase"], p["latency_ms_mean"]), fontsize=6,
                            color=c)
    for name, m in methods.items():
        x, y = 100 * m["ppl_rel_increase"], m["latency_ms"]["mean"]
        stands_in = m["policy"] in ("ordermoe", "oracle")  # clustered near each other: named in the legend
        ax.scatter([x], [y], marker=MARKERS.get(m["policy"], "D"), s=60 if m["policy"] == "oracle" else 30,
                   label=name if stands_in else None)
        if not stands_in:
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for name, pt in ((results.get("operating_points") or {}).get("points") or {}).items():
        ax.axvline(100 * pt["target_ppl_rel_increase"], ls=":", color="grey")
        ax.annotate(f"{name} target", (100 * pt["target_ppl_rel_increase"], ax.get_ylim()[1]), fontsize=7,
                    rotation=90, va="top", ha="right", color="grey")
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlim(left=0.0)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right")
    ax.set_xlabel("perplexity increase over exact execution (%)")
    ax.set_ylabel("mean latency per token (ms)")
    ax.set_title("latency vs quality: every method (squares exact, circles ordermoe, star oracle)", fontsize=9)
    return atomic_write_figure(fig, path, bbox_inches="tight")
