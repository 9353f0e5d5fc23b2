"""The home engine with servers as in-process objects: same tokens as the model, bytes as predicted,
policies' substitutions applied like the local backend, and a server lost mid-request."""

import numpy as np
import pytest
import torch

from edgemoe.distributed.server import HomeEngine, LocalTransport, ServerConfig, ServerCore
from edgemoe.distributed.wire import GenerateRequest
from edgemoe.errors import EdgeMoEError

PROMPT = np.array([5, 6, 7, 8, 9, 10, 11])


def _engine(ctx, path, policy="exact", links=False, params=(), servers=None, clock="real", home=0,
            decision_cost=None):
    cfg = ServerConfig(ctx, str(path), policy=policy, policy_params=params, wire="fp32", links_enabled=links,
                       call_timeout_s=2.0, clock=clock, decision_cost=decision_cost)
    servers = servers or {n: ServerCore(n, cfg.model_path, ctx, cfg.links(32), cfg.make_clock())
                          for n in range(ctx.num_nodes)}
    return HomeEngine(cfg, home, LocalTransport(servers)), servers


def _greedy_local(path, steps, policy=None):
    """Greedy tokens of the in-process model (optionally with a runtime policy applied by the local backend)."""
    from edgemoe.models import load_moe
    from edgemoe.runtime.local import _PolicyBridge

    adapter = load_moe(str(path))
    ids = torch.as_tensor(PROMPT)[None]
    out = []
    for _ in range(steps):
        if policy is None:
            logits = adapter.forward_logits(ids)
        else:
            bridge = _PolicyBridge(policy, adapter.num_layers)
            bridge.begin(np.zeros(ids.shape[1], np.int64))
            with adapter.intervene(bridge):
                logits = adapter.forward_logits(ids)
        out.append(int(logits[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], 1)
    return out


@pytest.mark.parametrize("mode", ["home", "migrate"])
def test_exact_generation_matches_the_model_and_bytes_match_the_tally(tiny_path, lab3, mode):
    engine, _ = _engine(lab3(mode), tiny_path)
    res = engine.generate(GenerateRequest("r", 0, PROMPT, 5))
    assert res.tokens.tolist() == _greedy_local(tiny_path, 5)
    c = res.counts
    assert c["remote"] > 0 and c["substituted"] == 0 and c["dropped"] == 0 and c["failed_calls"] == 0
    assert c["link_bytes"] == c["predicted_bytes"] > 0  # bytes moved on links = the cost model's accounting
    assert res.topk.shape == (len(PROMPT) + 4, 3, 2) and res.decode_s.shape == (4,)
    assert engine.generate(GenerateRequest("r", 0, PROMPT, 5)).replayed  # same id: answered from the cache


def test_a_pass_in_flight_finishes_on_its_own_engine_after_a_reconfiguration(tiny_path, lab3):
    """A reconfigured server builds a new engine on the same loaded backbone (`ServerActor._configure`) while a
    pass of the old one may still run: both engines' passes go through the shared stubs, each on its own engine
    (it used to fail with "'_thread._local' object has no attribute 'current'" on a Ray test run)."""
    from edgemoe.distributed.server import RemoteExperts

    old, servers = _engine(lab3("home"), tiny_path)
    cfg = ServerConfig(old.ctx, str(tiny_path), policy="drop", wire="fp32", links_enabled=False, call_timeout_s=2.0)
    new = HomeEngine(cfg, 0, LocalTransport(servers), adapter=old.adapter)
    assert new.adapter is old.adapter and all(isinstance(b.experts, RemoteExperts) for b in old.adapter.blocks)
    before = old.generate(GenerateRequest("old", 0, PROMPT, 3))  # the old engine's pass, after the new one took over
    assert before.tokens.tolist() == _greedy_local(tiny_path, 3) and before.counts["dropped"] == 0  # exact's decisions
    assert new.generate(GenerateRequest("new", 0, PROMPT, 3)).counts["dropped"] > 0  # the new engine's policy
    with pytest.raises(EdgeMoEError, match="outside a pass"):
        old.adapter.forward_logits(torch.as_tensor(PROMPT)[None])


def test_drop_policy_combines_like_the_local_backend(tiny_path, lab3):
    from edgemoe.runtime import make_policy

    ctx = lab3("home")
    engine, _ = _engine(ctx, tiny_path, policy="drop")
    res = engine.generate(GenerateRequest("d", 0, PROMPT, 4))
    assert res.counts["dropped"] > 0 and res.counts["remote"] == 0
    assert res.tokens.tolist() == _greedy_local(tiny_path, 4, make_policy("drop", ctx))


def test_links_on_measure_no_earlier_than_the_emulated_deadlines(tiny_path, lab3):
    """Each pass ends no earlier than its emulated end (the latest ready time of its last layer): the waits
    are deadlines on the clock, so the measured time can only exceed the emulated one (host late), never
    undercut it. No assertion on how much later: that is the benchmark's business."""
    engine, _ = _engine(lab3("home"), tiny_path, links=True)
    res = engine.generate(GenerateRequest("l", 0, PROMPT, 2))
    assert res.counts["emulated_s"] > 0
    assert (res.pass_end_s >= res.pass_deadline_s).all() and (res.pass_deadline_s > res.pass_begin_s).all()
    assert res.decode_s[0] == res.pass_end_s[1] - res.pass_begin_s[1]


def _virtual_run(ctx, path, policy, params, requests, decision_cost=None):
    """Run `requests` (user, prompt, gen, submit) one after another on homes sharing three in-process servers
    with the virtual clock; returns LoadRecords (nominal times) for the simulator's replay."""
    from edgemoe.distributed.serve import LoadRecord

    engine0, servers = _engine(ctx, path, policy, links=True, params=params, clock="virtual",
                               decision_cost=decision_cost)
    engines = {0: engine0}
    records = []
    for i, (user, prompt, gen, submit) in enumerate(requests):
        home = int(ctx.user_home[user])
        if home not in engines:
            engines[home] = _engine(ctx, path, policy, True, params, servers, "virtual", home, decision_cost)[0]
        res = engines[home].generate(GenerateRequest(f"v{i}", user, prompt, gen, submit_s=submit))
        records.append(LoadRecord(user, submit, float(res.pass_end_s[-1]), res))
    return records


@pytest.mark.parametrize("mode", ["home", "migrate"])
@pytest.mark.parametrize("policy,params", [("exact", ()), ("ordermoe", (("budget", 0.3),)), ("drop", (("budget", 0.5),))])
def test_virtual_clock_times_equal_the_simulators_event_times(tiny_path, lab3, mode, policy, params):
    """Item 8 of issue 12, a test of logic, not of time: with the virtual clock, every expert job's arrival,
    FIFO start, end and ready time, and every pass's begin and end, equal the reference simulator's events
    for the same requests exactly (==, no tolerance). Requests overlap no other request, so the order in which
    threads reach a server cannot matter; queueing still happens within a prefill (several rows, one node)."""
    from edgemoe.distributed.measure import emulated_events, reference_events, sorted_jobs

    ctx = lab3(mode)
    requests = [(0, PROMPT, 3, 0.0), (1, PROMPT[:4], 3, 5.0), (2, PROMPT[2:], 2, 10.0), (0, PROMPT[1:6], 2, 15.0)]
    records = _virtual_run(ctx, tiny_path, policy, params, requests)
    assert all(r.finished_s < n[3] for r, n in zip(records, requests[1:], strict=False))  # no overlap
    sim_begin, sim_end, sim_jobs, sim_dense = reference_events(ctx, policy, dict(params), records, wire_bytes=128)  # fp32, H=32
    begin, end, jobs, dense = emulated_events(records)
    assert np.array_equal(begin, sim_begin) and np.array_equal(end, sim_end)
    assert jobs.shape == sim_jobs.shape and len(jobs) > 0
    assert np.array_equal(sorted_jobs(jobs), sorted_jobs(sim_jobs))
    # some row waited for the accelerator behind another row of its pass (the FIFO was exercised)
    assert (sim_jobs[:, 4] > sim_jobs[:, 3]).any()
    # the dense part (issue 12, item 5): every pass's every layer ran its dense work on its home's backbone
    # queue at the same nominal times in both backends, before that layer's expert calls left
    assert ctx.dense_on and dense.shape == sim_dense.shape == (len(sim_begin) * ctx.num_layers, 6)
    assert np.array_equal(sorted_jobs(dense), sorted_jobs(sim_dense))
    assert (dense[:, 5] > dense[:, 4]).all()


@pytest.mark.parametrize("dense", [True, False])
def test_a_charged_decision_takes_the_same_nominal_time_in_both_backends(tiny_path, lab3, dense):
    """Issue 21, item 2: with the policy's decision charged (`ServerConfig.decision_cost`, the simulator's
    `charge_decisions`), every layer's backbone stage lasts its dense work plus fixed + per-row seconds of its
    rows, on the virtual clock exactly as in the reference simulator (==), with the dense part on or off; and
    every pass ends later than the same requests uncharged."""
    from dataclasses import replace

    from edgemoe.distributed.measure import emulated_events, reference_events, sorted_jobs
    from edgemoe.runtime.decision_cost import DecisionCost

    ctx = lab3("migrate") if dense else replace(lab3("migrate"), dense_source="off")
    cost = DecisionCost(fixed_s=0.004, per_row_s=0.0005)
    params = (("budget", 0.3),)
    requests = [(0, PROMPT, 3, 0.0), (1, PROMPT[:4], 2, 5.0), (2, PROMPT[2:], 2, 10.0)]
    records = _virtual_run(ctx, tiny_path, "ordermoe", params, requests, cost)
    begin, end, jobs, stage = emulated_events(records)
    sim_begin, sim_end, sim_jobs, sim_stage = reference_events(ctx, "ordermoe", dict(params), records, wire_bytes=128,
                                                               decision_cost=cost)
    assert np.array_equal(begin, sim_begin) and np.array_equal(end, sim_end)
    assert np.array_equal(sorted_jobs(jobs), sorted_jobs(sim_jobs))
    assert np.array_equal(sorted_jobs(stage), sorted_jobs(sim_stage))
    # each stage: the dense work of its pass's rows (prefill: the prompt's), then the decision's 4 ms + 0.5 ms a row
    pass_rows = np.array([len(PROMPT), 1, 1, 4, 1, len(PROMPT) - 2, 1])
    rows = pass_rows[stage[:, 0].astype(int)]
    dense_s = ctx.dense_s(stage[:, 2].astype(int), rows)
    assert (dense_s > 0).all() == dense and len(stage) == len(pass_rows) * ctx.num_layers
    assert np.allclose(stage[:, 5] - stage[:, 4], dense_s + 0.004 + 0.0005 * rows, rtol=0, atol=1e-9)
    uncharged = _virtual_run(ctx, tiny_path, "ordermoe", params, requests)
    assert all(a.finished_s > b.finished_s for a, b in zip(records, uncharged, strict=True))
    with pytest.raises(EdgeMoEError, match=r"ServerConfig.decision_cost must be a DecisionCost or None, got 0.004"):
        ServerConfig(ctx, str(tiny_path), decision_cost=0.004)


def test_a_server_lost_mid_run_is_excluded_and_its_slots_rerouted(tiny_path, lab3):
    ctx = lab3("home")
    engine, servers = _engine(ctx, tiny_path)
    first = engine.generate(GenerateRequest("a", 0, PROMPT, 3))
    del servers[1]  # server b disappears: its calls now fail
    res = engine.generate(GenerateRequest("b", 0, PROMPT, 3))
    assert res.counts["failed_calls"] >= 1 and res.counts["repaired"] >= 1 and res.counts["dropped"] == 0
    alive, _ = engine.membership.snapshot()
    assert alive.tolist() == [True, False, True]
    # every expert has a second copy, so the answer is still the exact model's
    assert res.tokens.tolist() == first.tokens.tolist()
    engine.membership.readmit(1)
    assert engine.membership.events[-1][1:] == ("readmitted", 1)


def test_homes_feed_each_pass_back_to_an_adaptive_policy(tiny_path, lab3):
    """Issue 9, section 4, on the distributed backend: after every pass the home calls the policy's observe()
    with the user, the pass's measured latency, the policy's own estimate, and the budget spent and granted
    (only for policies that ask for feedback, `wants_feedback`)."""
    from edgemoe.runtime import make_policy

    ctx = lab3("home")
    engine, _ = _engine(ctx, tiny_path, policy="drop", params=(("budget", 0.5),), links=True, clock="virtual")
    seen = []

    class Recording:
        wants_feedback = True

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def observe(self, users, latency_s, estimate_s, spent, granted):
            seen.append((users.tolist(), float(latency_s[0]), float(estimate_s[0]), float(spent[0]), float(granted[0])))

    engine.policies.use(Recording(make_policy("drop", ctx, budget=0.5)))
    res = engine.generate(GenerateRequest("f", 0, PROMPT, 3, submit_s=0.0))
    assert [s[0] for s in seen] == [[0]] * 3
    assert [s[1] for s in seen] == (res.pass_end_s - res.pass_begin_s).tolist()
    assert all(s[2] > 0 and 0 <= s[3] <= s[4] for s in seen)
    assert sum(s[3] for s in seen) == pytest.approx(res.counts["quality_cost"])


def test_zeroed_branches_combine_like_the_local_backend(tiny_path, lab3):
    """A policy that zeroes remote branches (other gates unchanged) gives the local backend's tokens."""
    from edgemoe.runtime import make_policy

    ctx = lab3("home")
    params = {"budget": 100.0, "horizon": 0, "substitutes": ("zero",)}
    engine, _ = _engine(ctx, tiny_path, policy="ordermoe", params=tuple(params.items()))
    res = engine.generate(GenerateRequest("z", 0, PROMPT, 4))
    assert res.counts["dropped"] > 0  # zeroed slots are counted among the slots not run
    assert res.tokens.tolist() == _greedy_local(tiny_path, 4, make_policy("ordermoe", ctx, **params))


def test_exact_home_refuses_to_degrade_unless_the_request_allows_it(tiny_path, lab3, caplog):
    """Servers a and c lost: the experts e % 3 == 1 have no replica left (b lacks them). An exact request fails
    with Degraded naming the expert; one that allows degradation is answered and counts the slots it lost.
    Each exclusion is one log line naming the server."""
    import logging

    from edgemoe.distributed.dispatch import Degraded

    ctx = lab3("home")
    engine, servers = _engine(ctx, tiny_path, home=1)
    del servers[0], servers[2]
    with caplog.at_level(logging.INFO, logger="edgemoe.distributed"):
        with pytest.raises(Degraded, match="no reachable replica"):
            engine.generate(GenerateRequest("strict", 1, PROMPT, 2))
        res = engine.generate(GenerateRequest("lenient", 1, PROMPT, 2, allow_degraded=True))
        engine.membership.readmit(0)
    assert res.counts["degraded"] > 0 and res.counts["substituted"] + res.counts["dropped"] == res.counts["degraded"]
    lines = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("home b: excluded a") for m in lines) == 1
    assert sum(m.startswith("home b: excluded c") for m in lines) == 1
    assert any(m.startswith("home b: readmitted a") for m in lines)
