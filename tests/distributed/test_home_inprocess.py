"""The home engine with servers as in-process objects: same tokens as the model, bytes as predicted,
policies' substitutions applied like the local backend, and a server lost mid-request."""

import numpy as np
import pytest
import torch

from edgemoe.distributed.links import LinkTable
from edgemoe.distributed.server import HomeEngine, LocalTransport, ServerConfig, ServerCore
from edgemoe.distributed.wire import GenerateRequest

PROMPT = np.array([5, 6, 7, 8, 9, 10, 11])


def _engine(ctx, path, policy="exact", links=False, params=(), servers=None):
    cfg = ServerConfig(ctx, str(path), policy=policy, policy_params=params, wire="fp32", links_enabled=links,
                       call_timeout_s=2.0)
    table = LinkTable.from_context(ctx, links)
    servers = servers or {n: ServerCore(n, cfg.model_path, ctx.hosts[n], table, 32) for n in range(ctx.num_nodes)}
    return HomeEngine(cfg, 0, LocalTransport(servers)), servers


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


def test_drop_policy_combines_like_the_local_backend(tiny_path, lab3):
    from edgemoe.runtime import make_policy

    ctx = lab3("home")
    engine, _ = _engine(ctx, tiny_path, policy="drop")
    res = engine.generate(GenerateRequest("d", 0, PROMPT, 4))
    assert res.counts["dropped"] > 0 and res.counts["remote"] == 0
    assert res.tokens.tolist() == _greedy_local(tiny_path, 4, make_policy("drop", ctx))


def test_links_on_hold_the_emulated_time(tiny_path, lab3):
    engine, _ = _engine(lab3("home"), tiny_path, links=True)
    res = engine.generate(GenerateRequest("l", 0, PROMPT, 2))
    total = res.prefill_s + res.decode_s.sum()
    assert res.counts["emulated_s"] > 0
    assert total >= 0.5 * res.counts["emulated_s"] / 2  # parallel legs overlap, but the wait is real


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
