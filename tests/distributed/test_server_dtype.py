"""Servers in the checkpoint's dtype (issue 20 section 3): a server holds the expert bytes the planner charged
it, and a home in bf16 serves a stream on the CPU."""

import numpy as np
import pytest
import torch

from edgemoe.distributed.batching import HomeBatcher, StreamRequest
from edgemoe.distributed.sampling import SamplingParams
from edgemoe.distributed.server import HomeEngine, LocalTransport, ServerConfig, ServerCore, resolve_dtype
from edgemoe.distributed.weights import ExpertWeights
from edgemoe.errors import EdgeMoEError


def test_checkpoint_dtype_holds_what_the_planner_charged():
    from edgemoe.models import load_moe
    from edgemoe.models.loader import resolve_model_path

    path = resolve_model_path("default")
    charged = np.asarray(load_moe("default").expert_bytes(), float)  # [L, E] what profiles and planners charge
    pairs = [(0, 0), (0, 5), (1, 3), (3, 7)]
    want = sum(charged[layer, e] for layer, e in pairs)
    held = ExpertWeights.load(path, pairs, resolve_dtype("checkpoint", path)).nbytes()
    assert resolve_dtype("checkpoint", path) == torch.bfloat16
    assert abs(held - want) <= 0.10 * want
    assert ExpertWeights.load(path, pairs).nbytes() == 2 * held  # float32 (the default) holds twice as much
    with pytest.raises(EdgeMoEError, match="expected one of float32, bfloat16, float16 or checkpoint"):
        resolve_dtype("int8", path)


def test_a_bf16_home_serves_a_stream_and_its_servers_hold_half(tiny_path, lab3):
    from edgemoe.distributed.cli import planned_expert_bytes

    ctx = lab3("home")
    cfgs = {d: ServerConfig(ctx, str(tiny_path), wire="bf16", links_enabled=False, dtype=d)
            for d in ("checkpoint", "bfloat16")}
    cores = {d: {n: ServerCore(n, c.model_path, ctx, c.links(32), c.make_clock(), c.torch_dtype(), c.device)
                 for n in range(ctx.num_nodes)} for d, c in cfgs.items()}
    for n in range(ctx.num_nodes):  # the tiny checkpoint is float32: "checkpoint" holds the charged bytes
        assert cores["checkpoint"][n].memory()["expert_bytes"] == planned_expert_bytes(ctx, n) > 0
        assert 2 * cores["bfloat16"][n].memory()["expert_bytes"] == planned_expert_bytes(ctx, n)
    home = HomeEngine(cfgs["bfloat16"], 0, LocalTransport(cores["bfloat16"]))
    assert next(home.adapter.model.parameters()).dtype == torch.bfloat16
    batcher = HomeBatcher(lambda: home, orphan_s=3600.0)  # never forgets within a test, however slow the host
    try:
        batcher.start(StreamRequest("b", 0, np.array([5, 6, 7, 8]), 4, SamplingParams(temperature=0.0)))
        p = batcher.poll("b", 0, 60.0)
        while not p["done"]:
            p = batcher.poll("b", 0, 60.0)
        assert p["error"] is None and len(p["tokens"]) == 4 and p["stats"]["expert_slots"]["slots"] > 0
    finally:
        batcher.close()
