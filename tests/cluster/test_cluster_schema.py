"""Cluster files: every named validation error, units, links (asymmetric, wireless, multi-hop), loading."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgemoe.cluster import radio, units
from edgemoe.cluster.load import load_cluster
from edgemoe.cluster.schema import build_cluster, shortest_paths, validate_for_model
from edgemoe.errors import EdgeMoEError


def err(data: dict) -> str:
    with pytest.raises(EdgeMoEError) as info:
        build_cluster(data, source="test.yaml")
    return str(info.value)


# -- units -------------------------------------------------------------------------------------------------


def test_units_known_answers():
    assert units.parse_bytes("6GiB") == 6 * 2**30
    assert units.parse_bytes("500MB") == 500e6
    assert units.parse_bytes(123) == 123
    assert units.parse_seconds("5ms") == pytest.approx(5e-3)
    assert units.parse_seconds("80us") == pytest.approx(80e-6)
    assert units.parse_rate("100Mbit/s") == pytest.approx(12.5e6)
    assert units.parse_rate("100Mbps") == pytest.approx(12.5e6)
    assert units.parse_rate("1GB/s") == 1e9
    assert units.parse_flops("989TFLOPS") == pytest.approx(989e12)
    assert units.parse_hz("10MHz") == 10e6
    with pytest.raises(units.UnitError, match="cannot read"):
        units.parse_bytes("6 parsecs")


# -- the happy path ----------------------------------------------------------------------------------------


def test_triangle_builds_with_units_resolved(triangle):
    c = build_cluster(triangle)
    a, b, cloud = (c.node_index(n) for n in ("a", "b", "cloud"))
    assert c.node_names == ("a", "b", "cloud") and c.user_names == ("alice", "bob")
    assert c.nodes[b].compute.peak_flops == 2e12 and c.nodes[b].compute.overhead_s == pytest.approx(1e-4)
    assert c.lat_s[a, b] == pytest.approx(0.010) and c.bw_Bps[a, b] == 1e6
    assert c.bw_Bps[b, cloud] == pytest.approx(10e6)  # 80 Mbit/s
    assert c.lat_s[b, a] == c.lat_s[a, b]  # symmetric by default
    np.testing.assert_array_equal(c.user_home, [a, b])
    np.testing.assert_allclose(c.user_weight, [0.75, 0.25])
    # memory: bytes as given, fractions of the model's expert bytes, cloud holds everything
    np.testing.assert_array_equal(c.capacity_bytes(10_000_000), [3_000_000, 5_000_000, 10_000_000])
    assert c.has_cloud and c.is_cloud.tolist() == [False, False, True]
    assert not c.lat_s.flags.writeable


def test_arrival_rates_become_weights(triangle):
    for user, rate in zip(triangle["users"], (30.0, 10.0), strict=True):
        del user["weight"]
        user["arrival_rate"] = rate
    np.testing.assert_allclose(build_cluster(triangle).user_weight, [0.75, 0.25])


def test_toml_and_yaml_files_load_the_same(tmp_path, triangle):
    import yaml

    (tmp_path / "t.yaml").write_text(yaml.safe_dump(triangle))
    toml = """
name = "t"
[[nodes]]
name = "a"
kind = "edge"
memory = "1MB"
compute = "rtx4090"
[[nodes]]
name = "b"
kind = "edge"
memory = "1MB"
compute = "rtx3090"
[[links]]
src = "a"
dst = "b"
latency = "3ms"
bandwidth = "100Mbit/s"
[[users]]
name = "u"
home = "a"
domain = "wiki"
"""
    (tmp_path / "t.toml").write_text(toml)
    assert load_cluster(tmp_path / "t.yaml").node_names == ("a", "b", "cloud")
    t = load_cluster(tmp_path / "t.toml")
    assert t.lat_s[0, 1] == pytest.approx(3e-3) and t.bw_Bps[0, 1] == pytest.approx(12.5e6)


# -- named errors ------------------------------------------------------------------------------------------


def test_negative_memory_names_field_and_range(triangle):
    triangle["nodes"][0]["memory"] = -5
    msg = err(triangle)
    assert "nodes[0].memory" in msg and ">= 0" in msg


def test_memory_with_units_must_parse(triangle):
    triangle["nodes"][0]["memory"] = "6 parsecs"
    assert "nodes[0].memory" in err(triangle)


def test_memory_fraction_outside_unit_interval(triangle):
    triangle["nodes"][1]["memory_fraction"] = 1.5
    msg = err(triangle)
    assert "nodes[1].memory_fraction" in msg and "less than or equal to 1" in msg


def test_memory_and_fraction_together(triangle):
    triangle["nodes"][1]["memory"] = "1MB"
    assert "not both" in err(triangle)


def test_edge_node_needs_memory(triangle):
    del triangle["nodes"][0]["memory"]
    assert "nodes[0]" in (msg := err(triangle)) and "needs memory" in msg


def test_unknown_compute_spec(triangle):
    triangle["nodes"][0]["compute"] = "tpu-v9"
    assert "unknown compute spec 'tpu-v9'" in err(triangle)


def test_unknown_kind(triangle):
    triangle["nodes"][0]["kind"] = "fog"
    assert "nodes[0].kind" in err(triangle)


def test_misspelt_field_is_rejected(triangle):
    triangle["links"][0]["latnecy"] = "3ms"
    assert "links[0].latnecy" in err(triangle)


def test_unknown_node_in_link(triangle):
    triangle["links"][1]["dst"] = "mars"
    msg = err(triangle)
    assert "links[1].dst: unknown node 'mars'" in msg and "'cloud'" in msg


def test_unknown_user_home(triangle):
    triangle["users"][1]["home"] = "c"
    assert "users[1].home: unknown node 'c'" in err(triangle)


def test_duplicate_node_names(triangle):
    triangle["nodes"][1]["name"] = "a"
    assert "nodes[1].name: duplicate name 'a'" in err(triangle)


def test_duplicate_user_names(triangle):
    triangle["users"][1]["name"] = "alice"
    assert "users[1].name: duplicate name 'alice'" in err(triangle)


def test_link_declared_twice(triangle):
    triangle["links"].append({"src": "b", "dst": "a", "latency": "1ms", "bandwidth": "1MB/s"})
    assert "b -> a is declared twice" in err(triangle)


def test_self_link(triangle):
    triangle["links"][0]["dst"] = "a"
    assert "links[0]: src and dst are both 'a'" in err(triangle)


def test_disconnected_nodes(triangle):
    triangle["links"] = triangle["links"][:1]  # cloud has no link left
    msg = err(triangle)
    assert "disconnected" in msg and "a -> cloud" in msg


def test_one_way_link_leaves_reverse_unreachable(triangle):
    triangle["links"] = [{"src": "a", "dst": "b", "latency": "1ms", "bandwidth": "1MB/s", "symmetric": False},
                         {"src": "a", "dst": "cloud", "latency": "1ms", "bandwidth": "1MB/s", "symmetric": False}]
    assert "b -> a" in err(triangle)


def test_negative_latency_and_zero_bandwidth(triangle):
    triangle["links"][0]["latency"] = "-1ms"
    assert "links[0].latency" in (msg := err(triangle)) and ">= 0" in msg
    triangle["links"][0]["latency"] = "1ms"
    triangle["links"][0]["bandwidth"] = 0
    assert "links[0].bandwidth" in (msg := err(triangle)) and "> 0" in msg


def test_link_needs_exactly_one_of_bandwidth_or_wireless(triangle):
    del triangle["links"][0]["bandwidth"]
    assert "exactly one of bandwidth" in err(triangle)


def test_reverse_values_need_symmetric(triangle):
    triangle["links"][0] |= {"symmetric": False, "reverse_bandwidth": "2MB/s"}
    assert "need symmetric: true" in err(triangle)


def test_utilisation_range(triangle):
    triangle["nodes"][0]["utilisation"] = 1.0
    msg = err(triangle)
    assert "nodes[0].utilisation" in msg and "less than 1" in msg


def test_arrival_rate_for_all_or_none(triangle):
    triangle["users"][0]["arrival_rate"] = 5.0
    del triangle["users"][0]["weight"]
    assert "arrival_rate for every user or for none" in err(triangle)


def test_no_users(triangle):
    triangle["users"] = []
    assert "users" in err(triangle)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(EdgeMoEError, match="no such cluster file or preset"):
        load_cluster(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("nodes: [\n")
    with pytest.raises(EdgeMoEError, match="cannot parse"):
        load_cluster(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(EdgeMoEError, match="a mapping"):
        load_cluster(tmp_path / "list.yaml")


# -- memory against a model --------------------------------------------------------------------------------


def _no_cloud(triangle: dict) -> dict:
    triangle["nodes"] = triangle["nodes"][:2]
    triangle["links"] = triangle["links"][:1]
    return triangle


def test_no_cloud_and_too_little_memory(triangle):
    c = build_cluster(_no_cloud(triangle))
    # 8 experts of 1 MB: a holds 3 slots, b half of 8 MB = 4 slots -> 7 < 8
    with pytest.raises(EdgeMoEError, match="no cloud.*7 expert slots"):
        validate_for_model(c, np.full((2, 4), 1_000_000))
    # 6 experts fit (a: 3, b: 3)
    np.testing.assert_array_equal(validate_for_model(c, np.full((2, 3), 1_000_000)), [3_000_000, 3_000_000])


def test_no_cloud_unequal_sizes_compares_bytes(triangle):
    c = build_cluster(_no_cloud(triangle))
    with pytest.raises(EdgeMoEError, match="cannot hold"):
        validate_for_model(c, np.array([[4_000_000, 3_000_000]]))  # 7 MB > 3 + 3.5 MB
    validate_for_model(c, np.array([[2_000_000, 1_000_000]]))


def test_cloud_makes_any_memory_enough(triangle):
    triangle["nodes"][0]["memory"] = 0
    c = build_cluster(triangle)
    assert validate_for_model(c, np.full((4, 16), 10**9))[2] == 64 * 10**9


def test_bad_expert_bytes(triangle):
    with pytest.raises(EdgeMoEError, match=r"\[L, E\]"):
        validate_for_model(build_cluster(triangle), np.zeros(3))


# -- links -------------------------------------------------------------------------------------------------


def test_asymmetric_link(triangle):
    triangle["links"][0] |= {"reverse_bandwidth": "4MB/s", "reverse_latency": "20ms"}
    c = build_cluster(triangle)
    assert c.bw_Bps[0, 1] == 1e6 and c.bw_Bps[1, 0] == 4e6
    assert c.lat_s[0, 1] == pytest.approx(0.010) and c.lat_s[1, 0] == pytest.approx(0.020)


def test_shannon_rate_known_answer():
    # 0 dBm through -100 dB over 1 MHz: received -100 dBm, noise -174 + 60 = -114 dBm -> SNR 14 dB
    expected = 1e6 * math.log2(1 + 10**1.4) / 8
    assert radio.shannon_rate_Bps(1e6, 0.0, -100.0) == pytest.approx(expected)
    # path loss at 1 km is the model's constant
    assert radio.path_loss_db(1000.0) == pytest.approx(128.1)


def test_wireless_link_rates_each_way(triangle):
    triangle["links"][0] = {"src": "a", "dst": "b", "latency": "4ms",
                            "wireless": {"bandwidth_hz": "1MHz", "tx_power_dbm": 0, "reverse_tx_power_dbm": 20,
                                         "gain_db": -100}}
    c = build_cluster(triangle)
    assert c.bw_Bps[0, 1] == pytest.approx(1e6 * math.log2(1 + 10**1.4) / 8)
    assert c.bw_Bps[1, 0] == pytest.approx(1e6 * math.log2(1 + 10**3.4) / 8)
    assert {link.medium for link in c.links if {link.src, link.dst} == {"a", "b"}} == {"wireless"}


def test_wireless_gain_from_positions(triangle):
    triangle["nodes"][0]["position_m"] = [0, 0]
    triangle["nodes"][1]["position_m"] = [300, 400]  # 500 m apart
    triangle["links"][0] = {"src": "a", "dst": "b", "latency": 0, "wireless": {"bandwidth_hz": 1e6, "tx_power_dbm": 23}}
    gain = -(128.1 + 37.6 * math.log10(0.5))
    assert build_cluster(triangle).bw_Bps[0, 1] == pytest.approx(float(radio.shannon_rate_Bps(1e6, 23, gain)))
    del triangle["nodes"][1]["position_m"]
    assert "position_m on both nodes" in err(triangle)


def test_wireless_access_links_devices_within_range():
    data = {
        "nodes": [
            {"name": "e0", "kind": "edge", "memory": 0, "compute": "l4", "position_m": [0, 0]},
            {"name": "e1", "kind": "edge", "memory": 0, "compute": "l4", "position_m": [1000, 0]},
            {"name": "d0", "kind": "device", "memory": 0, "compute": "phone-soc", "position_m": [100, 0]},
            {"name": "d1", "kind": "device", "memory": 0, "compute": "phone-soc", "position_m": [500, 0]},
            {"name": "cloud", "kind": "cloud", "compute": "h200"},
        ],
        "links": [{"src": "e0", "dst": "cloud", "latency": "20ms", "bandwidth": "1Gbit/s"},
                  {"src": "e1", "dst": "cloud", "latency": "20ms", "bandwidth": "1Gbit/s"}],
        "wireless_access": {"range_m": 600, "latency": "4ms", "bandwidth_hz": "10MHz"},
        "users": [{"name": "u", "home": "d0", "domain": "wiki"}],
    }
    c = build_cluster(data)
    pairs = {(link.src, link.dst) for link in c.links if link.medium == "wireless"}
    assert pairs == {("d0", "e0"), ("e0", "d0"), ("d1", "e0"), ("e0", "d1"), ("d1", "e1"), ("e1", "d1")}
    # d0 reaches e1 only through e0 and the cloud (d1 is a device: devices never relay)
    assert c.path("d0", "e1") == ["d0", "e0", "cloud", "e1"]
    assert c.lat_s[c.node_index("d0"), c.node_index("e1")] == pytest.approx(0.044)
    # downlink (43 dBm) beats uplink (23 dBm) on the same distance
    assert c.bw_Bps[c.node_index("e0"), c.node_index("d0")] > c.bw_Bps[c.node_index("d0"), c.node_index("e0")]


def test_multi_hop_uses_shortest_latency_path_and_its_bottleneck(triangle):
    # a -> cloud directly 50 ms; through b: 10 + 5 = 15 ms with bottleneck min(1 MB/s, 10 MB/s)
    triangle["links"][2]["latency"] = "5ms"
    c = build_cluster(triangle)
    a, cloud = c.node_index("a"), c.node_index("cloud")
    assert c.path("a", "cloud") == ["a", "b", "cloud"]
    assert c.lat_s[a, cloud] == pytest.approx(0.015)
    assert c.bw_Bps[a, cloud] == pytest.approx(1e6)
    direct_lat, _ = c.direct_matrices()
    assert direct_lat[a, cloud] == pytest.approx(0.05)


def test_shortest_paths_known_answer_on_a_line():
    inf = np.inf
    lat = np.array([[0, 1, inf], [1, 0, 2], [inf, 2, 0]], float)
    bw = np.array([[inf, 5, 0], [5, inf, 3], [0, 3, inf]], float)
    closed, closed_bw, nxt = shortest_paths(lat, bw)
    assert closed[0, 2] == 3 and closed_bw[0, 2] == 3 and nxt[0, 2] == 1
    blocked, _, _ = shortest_paths(lat, bw, transit=np.array([True, False, True]))
    assert blocked[0, 2] == inf


def test_the_docs_example_is_a_valid_cluster():
    import re
    from pathlib import Path

    import yaml

    doc = Path(__file__).resolve().parents[2] / "docs" / "cluster.md"
    block = re.search(r"```yaml\n(.*?)```", doc.read_text(), re.S).group(1)
    c = build_cluster(yaml.safe_load(block), source=str(doc))
    a, b, cloud, phone = (c.node_index(n) for n in ("a", "b", "cloud", "phone"))
    assert c.bw_Bps[a, cloud] == pytest.approx(125e6) and c.bw_Bps[cloud, a] == pytest.approx(62.5e6)
    assert c.lat_s[cloud, b] == pytest.approx(0.025) and c.lat_s[b, cloud] == pytest.approx(0.020)
    assert c.path("phone", "cloud") == ["phone", "a", "cloud"]
    assert c.bw_Bps[a, phone] > c.bw_Bps[phone, a]  # 43 dBm down vs 23 dBm up


def test_yaml_bare_exponents_read_as_numbers(tmp_path, three_edge_cluster_yaml):
    """PyYAML (YAML 1.1) reads `4e6` and `4.0e6` as strings; they are numbers in the base unit."""
    from edgemoe.cluster import load_cluster

    path = tmp_path / "c.yaml"
    path.write_text(three_edge_cluster_yaml.replace("memory: 8MB", "memory: 4e6").replace("latency: 5ms", "latency: 5.0e-3"))
    c = load_cluster(path)
    assert c.nodes[2].memory_bytes == 4_000_000 and c.lat_s[0, 1] == pytest.approx(5e-3)


def test_every_number_of_a_cluster_is_finite_and_bounded(triangle):
    import copy

    for path, value, message in (
        (("nodes", 0, "memory"), float("inf"), "finite"), (("nodes", 0, "memory"), 2**60, "<="),
        (("nodes", 0, "utilisation"), float("nan"), "finite"), (("links", 0, "latency"), 1e9, "<="),
        (("users", 0, "weight"), 1e300, "less than or equal"),
        (("nodes", 1, "compute", "peak_flops"), float("inf"), "finite"),
    ):
        bad = copy.deepcopy(triangle)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(EdgeMoEError, match=message):
            build_cluster(bad, "t")
