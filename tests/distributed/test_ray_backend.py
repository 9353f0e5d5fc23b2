"""The Ray backend on a local instance: the link legs each call holds, process memory per experts hosted, the same
tokens as the model, a server killed mid-run (every request answered once), closed-loop load and the
simulator's prediction of the same run, and the security settings."""

import os
import threading
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

PROMPT = np.array([5, 6, 7, 8, 9, 10, 11])


def test_local_instance_is_token_authenticated_without_dashboard(ray_session):
    assert ray_session["started"] and ray_session["auth"] == "token" and ray_session["dashboard"] is False
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert len([n for n in ray.nodes() if n["Alive"]]) == 1  # one local node, nothing joined


def test_each_call_holds_exactly_the_configured_link_legs(lab3_deployment):
    """The legs a server emulates are the cluster file's figures, one hidden state per row as the simulator
    charges them (no wall-clock assertion: how closely the waits land on them is measured side by side in
    bench/ray/runtime.py)."""
    from edgemoe.distributed.wire import ExpertCall

    dep = lab3_deployment
    ctx = dep.cfg.ctx
    rows = 64
    hidden = np.zeros((rows, 32), np.float32)  # 128 bytes a row, 8 KiB a message
    for n in (1, 2):
        e = int(np.flatnonzero(ctx.hosts[n, 0])[0])
        call = ExpertCall(0, hidden, np.full(rows, e), np.zeros(rows, np.int64), np.zeros(rows, np.int64), "fp32")
        reply = ray.get(dep.handles[n].run_experts.remote(call))
        assert reply.node == n
        assert reply.inbound_s == pytest.approx(ctx.lat_s[0, n] + 128 / ctx.bw_Bps[0, n], rel=1e-12)
        assert reply.outbound_s == pytest.approx(ctx.lat_s[n, 0] + 128 / ctx.bw_Bps[n, 0], rel=1e-12)
        assert reply.bytes_in == reply.bytes_out == rows * 128
        # the node's FIFO accelerator: one batched roofline call of the 64 rows, queued back to back
        service = ctx.call_s(n, 0, e, rows) / rows
        # the stamps are absolute monotonic-clock seconds (hours into a CI host's uptime), so each FIFO step
        # rounds at the clock's spacing: compare within that rounding, not at a relative 1e-12 of a microsecond
        ulp = float(np.spacing(reply.end[-1]))
        assert np.allclose(np.diff(reply.start), service, rtol=0, atol=4 * ulp)
        assert reply.end[-1] - reply.start[0] == pytest.approx(rows * service, rel=0, abs=2 * rows * ulp)
        assert (reply.arrival == reply.arrival[0]).all() and reply.start[0] >= reply.arrival[0]


def test_each_process_holds_only_its_experts(lab3_deployment):
    mem = lab3_deployment.memory()
    hosts = lab3_deployment.cfg.ctx.hosts
    per_expert = 3 * 48 * 32 * 4  # gate+up [2I, H] and down [H, I], fp32
    for m in mem:
        assert m["experts"] == int(hosts[m["node"]].sum())
        assert m["expert_bytes"] == m["experts"] * per_expert
        assert m["backbone_bytes"] > 0 and m["rss_bytes"] > 0


def test_ray_generation_matches_the_in_process_home(lab3_deployment, tiny_path, lab3):
    from edgemoe.distributed.serve import Client
    from edgemoe.distributed.server import HomeEngine, LocalTransport, ServerConfig, ServerCore
    from edgemoe.distributed.wire import GenerateRequest

    res = Client(lab3_deployment).generate(1, PROMPT, 4)
    ctx = lab3()
    cfg = ServerConfig(ctx, str(tiny_path), wire="fp32", links_enabled=False)
    servers = {n: ServerCore(n, cfg.model_path, ctx, cfg.links(32)) for n in range(3)}
    local = HomeEngine(cfg, 1, LocalTransport(servers)).generate(GenerateRequest("x", 1, PROMPT, 4))
    assert res.tokens.tolist() == local.tokens.tolist()
    assert res.served_by == 1 and res.counts["link_bytes"] == local.counts["link_bytes"] > 0


def test_virtual_clock_on_actors_equals_the_simulators_event_times(lab3_deployment):
    """Item 8 of issue 12 across processes: with the virtual clock, the times every actor computed for every
    expert job, and every pass's begin and end, equal the reference simulator's events for the same requests
    exactly. Requests one after another (none overlaps another), so thread timing cannot reorder a queue."""
    from dataclasses import replace

    from edgemoe.distributed.measure import emulated_events, reference_events, sorted_jobs
    from edgemoe.distributed.serve import Client, LoadRecord

    dep = lab3_deployment
    original = dep.cfg
    dep.configure(replace(original, clock="virtual"))
    try:
        client = Client(dep)
        records, t = [], 0.0
        for i, user in enumerate((0, 1, 2, 1)):
            res = client.generate(user, PROMPT[i % 3:], 3, submit_s=t)
            records.append(LoadRecord(user, t, float(res.pass_end_s[-1]), res))
            t = float(res.pass_end_s[-1]) + 1.0
    finally:
        dep.configure(original)
    sim_begin, sim_end, sim_jobs, sim_dense = reference_events(dep.cfg.ctx, "exact", {}, records, wire_bytes=128)
    begin, end, jobs, dense = emulated_events(records)
    assert np.array_equal(begin, sim_begin) and np.array_equal(end, sim_end)
    assert len(jobs) > 0 and np.array_equal(sorted_jobs(jobs), sorted_jobs(sim_jobs))
    # every layer's dense work on each home's backbone queue, too (issue 12, item 5)
    assert len(dense) == len(begin) * dep.cfg.ctx.num_layers and np.array_equal(sorted_jobs(dense), sorted_jobs(sim_dense))


def test_killed_server_mid_run_every_request_answered_once(lab3_deployment):
    from edgemoe.distributed.serve import Client

    dep = lab3_deployment
    client = Client(dep)
    n_req = 9
    results, errors = {}, []

    def one(i):
        try:
            results[i] = client.generate(i % 3, PROMPT[: 3 + i % 4], 6, request_id=f"fault-{i}")
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_req)]
    before = sum(dep.health(n)["started"] for n in (0, 1, 2))
    for t in threads:
        t.start()
    # Kill b as soon as every request has begun on its home, not after a fixed sleep (on a loaded machine they
    # may not have started by then); the last to begin is then in flight for about a second of emulated links,
    # and almost every request of this placement calls b.
    end = time.monotonic() + 120
    while sum(dep.health(n)["started"] for n in (0, 1, 2)) - before < n_req and time.monotonic() < end:
        time.sleep(0.02)
    dep.kill(1)  # server b crashes while requests are in flight (Ray restarts it)
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(results) == list(range(n_req)) and len(client.answers) == n_req and client.duplicates == 0
    assert all(len(r.tokens) == 6 and r.request_id == f"fault-{i}" for i, r in results.items())
    # requests of b's user failed over to another home; calls to b were re-routed to replicas
    assert client.failovers + sum(r.counts["failed_calls"] for r in results.values()) >= 1
    assert all(r.counts["dropped"] == 0 for r in results.values())  # every expert had a live replica
    # b comes back (Ray restarts it, homes probe with backoff) and is readmitted everywhere
    assert dep.wait_alive(1, timeout_s=180)
    end = time.monotonic() + 180
    while time.monotonic() < end:
        health = [dep.health(n) for n in (0, 2)]
        if all(h["alive"] == [True, True, True] for h in health):
            break
        time.sleep(0.3)
    assert all(h["alive"] == [True, True, True] for h in health)
    events = [e[1] for h in health for e in h["events"] if e[2] == 1]
    assert "excluded" in events and events[-1] == "readmitted"


def test_closed_loop_load_and_the_simulators_prediction(lab3_deployment):
    from edgemoe.distributed.measure import compare, measured_metrics, predicted_metrics
    from edgemoe.distributed.serve import Client, closed_loop

    dep = lab3_deployment
    client = Client(dep)
    prompts = [PROMPT[:5], PROMPT[2:]]
    # bounded by requests, not by time: exactly 2 per user however loaded the machine is
    records, makespan, errors = closed_loop(client, [0, 1, 2, 0, 1, 2], prompts, gen_tokens=4, duration_s=1e9,
                                            max_requests_per_user=2)
    assert errors == [] and len(records) == 12 and client.duplicates == 0 and len(client.answers) == 12
    measured = measured_metrics(records, makespan, dep.cfg.ctx)
    predicted = predicted_metrics(dep.cfg.ctx, "exact", {}, records, wire_bytes=128)
    err = compare(measured, predicted)
    assert measured["failed_calls"] == 0
    # traffic and the remote ratio are counted from the same decisions: equal up to the replay's own choices
    assert measured["traffic_bytes_per_1k_tokens"] == pytest.approx(measured["predicted_traffic_bytes_per_1k_tokens"])
    assert abs(err["remote_ratio"]) < 0.25 and abs(err["traffic"]) < 0.25
    assert np.isfinite(err["latency_mean"])
