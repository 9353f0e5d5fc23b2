"""Presets load and validate against a default-sized model; the generator is deterministic and valid."""

from __future__ import annotations

import numpy as np
import pytest

from edgemoe.cluster import cost
from edgemoe.cluster.load import load_cluster
from edgemoe.cluster.presets import DEFAULT_DOMAINS, PRESETS, generate, generate_dict
from edgemoe.cluster.schema import validate_for_model
from edgemoe.errors import EdgeMoEError
from edgemoe.profile import synthetic_profile

# The default model's shape: 4 layers x 16 experts of ~200 KB.
DEFAULT_EXPERT_BYTES = np.full((4, 16), 200_000, dtype=np.int64)


# testbed8 is sized in absolute bytes for paper-scale models (tests/cluster/test_testbed8.py)
@pytest.mark.parametrize("name", sorted(set(PRESETS) - {"testbed8"}))
def test_presets_load_and_validate(name):
    c = load_cluster(name)
    capacity = validate_for_model(c, DEFAULT_EXPERT_BYTES)
    total = int(DEFAULT_EXPERT_BYTES.sum())
    assert capacity.shape == (c.num_nodes,)
    assert all(u.domain in DEFAULT_DOMAINS for u in c.users)
    # no edge server or device can hold the whole model: placement matters
    assert (capacity[~c.is_cloud] < total).all()
    assert np.isfinite(c.lat_s).all() and (c.bw_Bps > 0).all()


def test_edge8_matches_its_description():
    c = load_cluster("edge8")
    assert c.num_nodes == 8 and set(c.node_kind) == {"edge"} and not c.has_cloud
    assert len({n.compute_name for n in c.nodes}) == 4  # four GPU classes
    capacity = c.capacity_bytes(int(DEFAULT_EXPERT_BYTES.sum()))
    copies = capacity.sum() / DEFAULT_EXPERT_BYTES.sum()
    assert 1.5 <= copies <= 2.0
    off = ~np.eye(8, dtype=bool)
    assert 2e-3 <= c.lat_s[off].min() and c.lat_s[off].max() <= 30e-3  # several to tens of ms one way
    assert 10e6 / 8 <= c.bw_Bps[off].min() and c.bw_Bps[off].max() <= 1e9 / 8  # tens to hundreds of Mbit/s
    assert set(np.bincount(c.user_home, minlength=8)) == {2}


def test_device_edge_cloud_matches_its_description():
    c = load_cluster("device-edge-cloud")
    kinds = np.array(c.node_kind)
    assert (kinds == "cloud").sum() == 1 and (kinds == "edge").sum() == 5 and (kinds == "device").sum() == 20
    assert all(c.nodes[h].kind == "device" for h in c.user_home)
    # each device reaches 2-4 edge servers over the air
    for dev in (n.name for n in c.nodes if n.kind == "device"):
        reach = {link.dst for link in c.links if link.src == dev and link.medium == "wireless"}
        assert 2 <= len(reach) <= 4, dev
    # an edge hit is a short round trip; the cloud costs the 40 ms backhaul round trip on top
    prof = synthetic_profile(4, 16, 2, 400, num_domains=4, expert_bytes=200_000, hidden_size=128)
    p = cost.cost_tables(c, prof.expert_bytes, prof.expert_flops, prof.meta.hidden_bytes, freq=prof.freq)
    cloud = c.node_index("cloud")
    assert (p.comm_s[:, cloud] > 0.040).all() and (p.comm_s[:, cloud] < 0.060).all()
    reachable_edge = p.comm_s[:, kinds == "edge"].min(axis=1)
    assert (reachable_edge < 0.010).all()


def test_generate_internet_is_deterministic_and_valid():
    a, b = generate(12, 40, seed=5), generate(12, 40, seed=5)
    np.testing.assert_array_equal(a.lat_s, b.lat_s)
    assert a.num_nodes == 12 and a.num_users == 40 and not a.has_cloud
    assert not np.array_equal(a.lat_s, generate(12, 40, seed=6).lat_s)
    validate_for_model(a, DEFAULT_EXPERT_BYTES)
    off = ~np.eye(12, dtype=bool)
    assert 1e-3 < a.lat_s[off].min() and a.lat_s[off].max() < 0.05


def test_generate_device_edge_cloud():
    c = generate(6, 30, seed=1, topology="device-edge-cloud")
    assert c.has_cloud and c.num_nodes == 6 + 30 + 1
    assert all(c.nodes[h].kind == "device" for h in c.user_home)
    no_cloud = generate(6, 30, seed=1, topology="device-edge-cloud", with_cloud=False)
    assert not no_cloud.has_cloud and np.isfinite(no_cloud.lat_s).all()


def test_generate_scales_to_bench_sizes():
    c = generate(64, 500, seed=0)
    assert c.num_nodes == 64 and c.num_users == 500
    assert len(generate_dict(64, 500)["links"]) == 64 * 63 // 2


def test_generate_rejects_bad_arguments():
    with pytest.raises(EdgeMoEError, match="num_servers"):
        generate(0, 3)
    with pytest.raises(EdgeMoEError, match="topology"):
        generate(3, 3, topology="ring")


def test_unknown_preset():
    with pytest.raises(EdgeMoEError, match="presets"):
        load_cluster("edge9")
