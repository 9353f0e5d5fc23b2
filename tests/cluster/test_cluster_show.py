"""Table, topology picture and the `cluster show` command."""

from __future__ import annotations

from typer.testing import CliRunner

from edgemoe.cluster.cli import app
from edgemoe.cluster.load import load_cluster
from edgemoe.cluster.schema import build_cluster
from edgemoe.cluster.show import cluster_table, draw_topology

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cluster_table_lists_every_node(triangle):
    text = cluster_table(build_cluster(triangle), total_expert_bytes=8_000_000)
    for name in ("a", "b", "cloud"):
        assert f" {name} " in text
    assert "50% of experts (4 MB)" in text and "all experts" in text
    assert "one-way latency 10-50 ms" in text


def test_draw_topology_writes_a_png_atomically(tmp_path):
    out = draw_topology(load_cluster("device-edge-cloud"), tmp_path / "sub" / "topo.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in out.parent.iterdir()] == ["topo.png"]  # no temporary left behind


def test_cli_show_prints_table_and_draws(tmp_path):
    result = CliRunner().invoke(app, ["show", "edge8", "--out", str(tmp_path / "t.png")])
    assert result.exit_code == 0, result.output
    assert "a100-b" in result.output and "56 directed links" in result.output
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_show_bad_cluster_exits_with_message(tmp_path):
    (tmp_path / "c.yaml").write_text("nodes: []\nusers: []\n")
    result = CliRunner().invoke(app, ["show", str(tmp_path / "c.yaml")])
    assert result.exit_code == 2 and "nodes" in result.output


def test_cli_lists_presets():
    result = CliRunner().invoke(app, ["presets"])
    assert result.exit_code == 0 and "edge8" in result.output and "device-edge-cloud" in result.output
