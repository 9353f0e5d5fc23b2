"""Fixtures of the distributed tests: the tiny Mixtral checkpoint, the lab3 deployment context, and one
local Ray instance for the whole session (started and stopped here)."""

import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "token")  # before any test module imports Ray

HERE = Path(__file__).resolve().parent
LAB3 = HERE / "lab3.yaml"


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> Path:
    from edgemoe.models.tiny import save_tiny

    return save_tiny("mixtral", tmp_path_factory.mktemp("tiny") / "mixtral")


def lab3_context(mode: str = "home"):
    """lab3 with a placement where every expert sits on exactly two of the three servers
    (node n lacks the experts e with e % 3 == n), so any one server can fail without losing an expert."""
    from edgemoe.cluster import load_cluster
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import empty_hosts, make_placement
    from edgemoe.profile.store import synthetic_profile
    from edgemoe.runtime import make_context

    profile = synthetic_profile(3, 8, 2, 400, 2, expert_bytes=18432, hidden_size=32, seed=1)
    cluster = load_cluster(LAB3)
    problem = plan_problem(profile, cluster)
    hosts = empty_hosts(problem)
    for n in range(3):
        hosts[n, :, np.arange(8) % 3 != n] = True
    return make_context(profile, cluster, make_placement(problem, "two-copies", hosts), mode=mode)


@pytest.fixture(scope="session")
def lab3():
    """The `lab3_context(mode)` builder."""
    return lab3_context


def lab3_home_engine(tiny_path, transport_cls=None):
    """An in-process HomeEngine at node 0 of lab3 (home mode, fp32 wire, links off) whose servers are
    `ServerCore`s reached through `transport_cls` (a `LocalTransport` subclass; LocalTransport itself by default)."""
    from edgemoe.distributed.server import HomeEngine, LocalTransport, ServerConfig, ServerCore

    ctx = lab3_context("home")
    cfg = ServerConfig(ctx, str(tiny_path), wire="fp32", links_enabled=False, call_timeout_s=5.0)
    servers = {n: ServerCore(n, cfg.model_path, ctx, cfg.links(32), cfg.make_clock()) for n in range(ctx.num_nodes)}
    return HomeEngine(cfg, 0, (transport_cls or LocalTransport)(servers))


@pytest.fixture(scope="session")
def lab3_home():
    """The `lab3_home_engine(tiny_path, transport_cls=None)` builder."""
    return lab3_home_engine


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance (127.0.0.1, token auth) declaring lab3's server resources."""
    pytest.importorskip("ray")
    from edgemoe.distributed.serve import start_ray, stop_ray

    # A dead RAY_ADDRESS stands for a stale /tmp/ray/ray_current_cluster (another program's): start_ray must
    # start its own instance anyway (address="local"), not try to join it (issue 22).
    saved = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = "127.0.0.1:9"
    try:
        info = start_ray(("a", "b", "c"))
    finally:
        if saved is None:
            os.environ.pop("RAY_ADDRESS")
        else:
            os.environ["RAY_ADDRESS"] = saved
    assert info["started"] and info["address"] == "local"
    yield info
    stop_ray()


@pytest.fixture(scope="session")
def lab3_deployment(ray_session, tiny_path):
    from edgemoe.distributed.serve import Deployment
    from edgemoe.distributed.server import ServerConfig

    dep = Deployment.launch(ServerConfig(lab3_context(), str(tiny_path), wire="fp32", call_timeout_s=3.0,
                                         backoff_base_s=0.2, backoff_max_s=1.0))
    yield dep
    dep.shutdown()
