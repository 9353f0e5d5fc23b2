"""Faults on the Ray deployment that a user can see and choose (issue 20, section 5): an exact request with no
reachable replica is a 503 unless it allows degradation, the ingress skips a failed home until a probe
readmits it, and each exclusion, failover and readmission is a log line naming the node."""

import logging
import os
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _wait_all_alive(dep, node: int, timeout_s: float = 180.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if dep.health(node)["alive"] == [True] * dep.cfg.ctx.num_nodes:
            return True
        time.sleep(0.3)
    return False


def test_exact_request_without_a_replica_is_a_503_unless_it_allows_degradation(lab3_deployment, tiny_path):
    from edgemoe.models import load_tokenizer
    from edgemoe.serve.api import create_app
    from edgemoe.serve.ray_engine import RayEngine
    from edgemoe.serve.service import ServerThread

    dep = lab3_deployment
    assert dep.cfg.policy == "exact"
    engine = RayEngine(dep, load_tokenizer(str(tiny_path)))
    # a and c lose every message (fault injection): b, u1's home, then has no replica of the experts e % 3 == 1
    ray.get([dep.handles[n].set_faults.remote(1.0) for n in (0, 2)])
    try:
        with ServerThread(create_app(engine, "tiny")) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
            with pytest.raises(openai.APIStatusError) as err:
                c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                     extra_body={"edgemoe": {"user": "u1"}})
            assert err.value.status_code == 503
            body = err.value.body if isinstance(err.value.body, dict) else {}
            message = body.get("message", "") or str(err.value)
            assert "no reachable replica" in message and "allow_degraded" in message
            r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                     extra_body={"edgemoe": {"user": "u1", "allow_degraded": True}})
            stats = r.model_extra["edgemoe"]
            slots = stats["expert_slots"]
            assert stats["allow_degraded"] is True and stats["home"] == "b"
            assert slots["degraded"] > 0 and slots["substituted"] + slots["dropped"] >= slots["degraded"]
    finally:
        ray.get([dep.handles[n].set_faults.remote(0.0) for n in (0, 2)])
        engine.close()
    assert _wait_all_alive(dep, 1)  # b's probes readmit a and c once they answer again


def test_ingress_skips_a_failed_home_until_a_probe_readmits_it(lab3_deployment, caplog):
    from edgemoe.distributed.health import Backoff
    from edgemoe.distributed.serve import Client

    dep = lab3_deployment
    # probes only on demand here (probe_homes), so that "skipped until readmitted" does not race a timer
    client = Client(dep, home_backoff=Backoff(1e4, 1e4), probe=False)
    try:
        with caplog.at_level(logging.INFO, logger="edgemoe.distributed"):
            dep.kill(1)  # u1's home b crashes (Ray restarts it)
            first = client.generate(1, np.array(PROMPT), 2)
            assert first.served_by != 1 and client.failovers == 1
            second = client.generate(1, np.array(PROMPT), 2)
            assert second.served_by != 1 and client.failovers == 1  # b was not tried again
            assert dep.wait_alive(1, timeout_s=180)
            assert client.probe_homes(force=True) == [1]
            third = client.generate(1, np.array(PROMPT), 2)
        assert third.served_by == 1 and client.failovers == 1
        lines = [r.getMessage() for r in caplog.records if r.name == "edgemoe.distributed"]
        assert sum(m.startswith("ingress: excluded b") for m in lines) == 1
        assert sum("fails over to home" in m for m in lines) == 1
        assert sum(m.startswith("ingress: readmitted b") for m in lines) == 1
    finally:
        client.close()
    assert _wait_all_alive(dep, 0) and _wait_all_alive(dep, 2)


def test_a_server_no_ray_node_declares_is_an_error_at_once_naming_its_resource(ray_session, tiny_path, lab3):
    """Issue 22 item 4: the actor of a node without a Ray machine would wait forever; launch refuses first."""
    from dataclasses import replace

    from edgemoe.distributed.serve import Deployment
    from edgemoe.distributed.server import ServerConfig
    from edgemoe.errors import EdgeMoEError

    ctx = replace(lab3(), node_names=("a", "b", "lab-9"))
    with pytest.raises(EdgeMoEError, match=r"edgemoe_node_lab_9 \(declared: edgemoe_node_a, edgemoe_node_b, "
                                           r"edgemoe_node_c\)"):
        Deployment.launch(ServerConfig(ctx, str(tiny_path), wire="fp32"))


def test_servers_that_do_not_start_in_time_are_named_and_stopped(ray_session, tiny_path, lab3):
    from edgemoe.distributed.serve import Deployment
    from edgemoe.distributed.server import ServerConfig
    from edgemoe.errors import EdgeMoEError

    namespace = "edgemoe-slow-start"
    with pytest.raises(EdgeMoEError, match=r"servers a, b, c did not start \(load their experts\) within 0\.001 s "
                                           r"\(Ray namespace edgemoe-slow-start\)"):
        Deployment.launch(ServerConfig(lab3(), str(tiny_path), wire="fp32"), ready_timeout_s=0.001, namespace=namespace)
    end = time.monotonic() + 60  # the half-started actors were killed: their names are free again
    while time.monotonic() < end and _named(namespace):
        time.sleep(0.2)
    assert _named(namespace) == []


def _named(namespace: str) -> list[str]:
    """The lab3 server names still held by a live actor in `namespace`."""
    held = []
    for name in ("a", "b", "c"):
        try:
            ray.get_actor(f"edgemoe-{name}", namespace=namespace)
        except ValueError:  # no such (live) actor
            continue
        held.append(name)
    return held


def test_serve_says_where_ray_is_and_how_machines_join(ray_session):
    from edgemoe.distributed.serve import _local_ip_towards, join_instructions

    lines = join_instructions(ray_session, "edgemoe-1234abcd", ("a", "b", "c"))
    assert lines[0].startswith("ray: a private local instance at 127.0.0.1:") and "'edgemoe-1234abcd'" in lines[0]
    assert "127.0.0.1 only" in lines[1] and "ray start --head --node-ip-address" in lines[1]
    assert "edgemoe_node_a" in lines[1] and "--ray-address" in lines[1]
    assert _local_ip_towards("127.0.0.1:6379") is None and _local_ip_towards("localhost:6379") is None


def test_the_local_instance_listens_on_loopback_only(ray_session):
    """Nothing of the session's local Ray listens beyond 127.0.0.1, although this module imported Ray before
    edgemoe.distributed (Ray's own switch was read then; start_ray keeps the instance on loopback anyway)."""
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    listening = _listening_addresses(_descendants(os.getpid()))
    assert listening and all(host == "127.0.0.1" for host, _ in listening), listening


def _descendants(root: int) -> set[int]:
    """root's child processes, recursively (Linux /proc): the GCS, the raylet, the workers."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _listening_addresses(pids: set[int]) -> list[tuple[str, int]]:
    """(host, port) of every TCP socket in LISTEN state that one of `pids` holds (/proc/net/tcp, tcp6)."""
    import ipaddress

    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexip, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexip)
                # /proc prints the address as 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(raw)
                out.append((str(getattr(ip, "ipv4_mapped", None) or ip), int(hexport, 16)))
    return out


def test_two_deployments_on_one_ray_cluster_do_not_collide(lab3_deployment, tiny_path):
    """Same server names, same cluster: each deployment's actors live in its own namespace, and each answers."""
    from edgemoe.distributed.serve import Client, Deployment

    first = lab3_deployment
    second = Deployment.launch(first.cfg)
    try:
        assert second.cfg.namespace != first.cfg.namespace
        a = Client(first).generate(2, np.array(PROMPT), 3)
        b = Client(second).generate(2, np.array(PROMPT), 3)
        assert a.tokens.tolist() == b.tokens.tolist() and a.served_by == b.served_by == 2
        pids = set(first.pids())
        assert pids.isdisjoint(second.pids())  # the second deployment's calls went to its own processes
    finally:
        second.shutdown()
    assert _wait_gone(second.cfg.namespace)  # shutdown freed its names
    assert Client(first).generate(0, np.array(PROMPT), 2).served_by == 0  # the first one is untouched


def _wait_gone(namespace: str, timeout_s: float = 60.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if not _named(namespace):
            return True
        time.sleep(0.2)
    return False
