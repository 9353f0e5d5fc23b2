"""The placements figure stays readable at any number of placements, layers, experts and nodes:
no title or label overlaps another panel's text or image (checked on the drawn figure)."""

from __future__ import annotations

import itertools

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from edgemoe.report.render import placements_figure, plot_placements  # noqa: E402


def _results(placements: int, L: int, E: int, N: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"placements": {f"method-{i}-with-a-long-name": {
        "copies": rng.integers(0, N + 1, (L, E)).tolist(), "bytes_used": rng.integers(0, 10**9, N).tolist()}
        for i in range(placements)}}


def _drawn_ticklabels(axis):
    """Tick labels matplotlib actually draws (those of ticks inside the view; the rest are only listed)."""
    lo, hi = sorted(axis.get_view_interval())
    return [t.label1 for t in axis.get_major_ticks() if lo <= t.get_loc() <= hi]


def _texts(fig):
    """[(owner, bbox)] of every visible, non-empty text: titles, axis labels, tick labels, suptitles."""
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.get_axes():
        if not ax.get_visible():
            continue
        items = [ax.title, ax.xaxis.label, ax.yaxis.label, *_drawn_ticklabels(ax.xaxis), *_drawn_ticklabels(ax.yaxis)]
        out += [(id(ax), t.get_window_extent(renderer)) for t in items if t.get_visible() and t.get_text()]
    return out


@pytest.mark.parametrize(("placements", "L", "E", "N"), [(1, 1, 2, 1), (5, 4, 16, 26), (7, 24, 64, 200), (12, 2, 8, 3)])
def test_no_text_overlaps_another_panel(placements, L, E, N):
    fig = placements_figure(_results(placements, L, E, N))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = _texts(fig)
    for (a, box_a), (b, box_b) in itertools.combinations(texts, 2):
        if a != b:
            assert not box_a.overlaps(box_b), "text of one panel overlaps another panel's text"
    panels = [(id(ax), ax.get_window_extent(renderer)) for ax in fig.get_axes() if ax.get_visible()]
    for ax in fig.get_axes():
        if ax.get_visible() and ax.get_title():
            title = ax.title.get_window_extent(renderer)
            assert not any(title.overlaps(box) for owner, box in panels if owner != id(ax)), "a title covers a panel"
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_plot_writes_a_png_and_skips_results_without_placements(tmp_path):
    assert plot_placements({"placements": {}}, tmp_path / "none.png") is None
    path = plot_placements(_results(3, 4, 8, 5), tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
