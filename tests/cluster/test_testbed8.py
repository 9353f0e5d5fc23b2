"""testbed8: eight heterogeneous servers sized in absolute bytes for paper-scale models (docs/cluster.md)."""

from __future__ import annotations

import numpy as np

from edgemoe.cluster.load import load_cluster
from edgemoe.cluster.schema import validate_for_model
from edgemoe.profile.specs import model_spec

REAL_COUNT_DOMAINS = {"arxiv", "book", "c4", "github", "wikipedia"}


def test_testbed8_matches_its_description():
    c = load_cluster("testbed8")
    assert c.num_nodes == 8 and set(c.node_kind) == {"edge"} and not c.has_cloud
    assert sorted(n.compute_name for n in c.nodes).count("a100-40gb") == 2
    assert len({n.compute_name for n in c.nodes}) == 4  # Orin, 3090, 4090, A100
    assert {u.domain for u in c.users} == REAL_COUNT_DOMAINS
    assert set(np.bincount(c.user_home, minlength=8)) == {2}
    off = ~np.eye(8, dtype=bool)
    # one lab site and an edge DC: sub-ms inside a site, a few ms across, 300 Mbit/s .. 10 Gbit/s
    assert 0.1e-3 <= c.lat_s[off].min() and c.lat_s[off].max() <= 5e-3
    assert c.bw_Bps[off].min() == 300e6 / 8 and c.bw_Bps[off].max() == 10e9 / 8


def test_testbed8_holds_mixtral_about_two_and_a_half_times_but_no_server_alone():
    c = load_cluster("testbed8")
    mixtral = model_spec("mixtral-8x7b").expert_bytes()
    capacity = validate_for_model(c, mixtral)
    assert capacity.sum() == 236e9
    assert 2.5 <= capacity.sum() / mixtral.sum() <= 2.7
    assert (capacity < mixtral.sum()).all()
    # whole experts per server (352 MB each): what the planners actually get to place
    slots = capacity // mixtral[0, 0]
    assert slots.sum() >= mixtral.size  # at least one copy of each of the 256 experts fits
