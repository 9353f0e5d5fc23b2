"""Link arithmetic (hand-checked), expert loading by key (both checkpoint layouts), repair rules."""

import numpy as np
import pytest
import torch

from edgemoe.distributed.links import LinkTable
from edgemoe.distributed.weights import ExpertWeights, checkpoint_files, expert_index
from edgemoe.errors import EdgeMoEError

LAT = np.array([[0.0, 0.01, 0.02], [0.01, 0.0, 0.03], [0.02, 0.03, 0.0]])
BW = np.array([[np.inf, 1e6, 2e6], [1e6, np.inf, 1e6], [2e6, 1e6, np.inf]])


def test_each_row_is_its_own_message_as_the_simulator_charges():
    from edgemoe.distributed.links import VirtualAccelerator

    xfer = LAT + 1000 / BW  # rows of 1000 bytes
    np.fill_diagonal(xfer, 0.0)
    links = LinkTable(xfer, 1000)
    # rows from 0, 0, 2 and 1 (local) to node 1: 0.01 + 0.001, twice; 0.03 + 0.001; 0
    assert links.legs_s(np.array([0, 0, 2, 1]), np.array([1, 1, 1, 1])) == pytest.approx([0.011, 0.011, 0.031, 0.0])
    assert links.bytes_moved(np.array([0, 0, 2, 1]), np.array([1, 1, 1, 1])) == 3000
    off = LinkTable(xfer, 1000, enabled=False)
    assert off.legs_s(np.array([0]), np.array([2])).tolist() == [0.0] and off.bytes_moved([0], [2]) == 1000
    # FIFO accelerator: start = max(arrival, free_at), end = start + service, in the order given
    acc = VirtualAccelerator()
    start, end, free = acc.serve(np.array([1.0, 1.0, 5.0]), np.array([2.0, 1.0, 0.5]))
    assert start.tolist() == [1.0, 3.0, 5.0] and end.tolist() == [3.0, 4.0, 5.5] and free == 5.5
    start, end, _ = acc.serve(np.array([5.2]), np.array([1.0]))
    assert start.tolist() == [5.5] and end.tolist() == [6.5] and acc.busy_s == 4.5


def test_virtual_clock_never_waits_and_dilation_stretches_real_waits():
    """Only orderings and lower bounds (a wait never ends early), never an upper bound on a busy machine."""
    import time

    from edgemoe.distributed.links import Clock

    v = Clock("virtual")
    assert v.now() == -np.inf and v.stamp(3.5) == 3.5
    before = time.monotonic()
    v.wait_until(before + 3600.0)  # an hour of nominal time: returns at once (any wait would time the test out)
    real = Clock("real", 10.0)
    a = time.monotonic()
    now = real.now()
    b = time.monotonic()
    assert a / 10.0 <= now <= b / 10.0  # nominal time is monotonic seconds divided by the dilation
    assert real.stamp(now + 50.0) == now + 50.0  # a deadline in the future is the event's time
    late = real.stamp(0.0)
    assert now <= late <= time.monotonic() / 10.0  # a deadline long past stamps as now
    # a nominal wait of 4 ms at dilation 10 lasts at least 40 ms of the machine's time
    start = time.monotonic()
    real.wait_until(real.now() + 0.004)
    assert time.monotonic() - start >= 0.04 - 1e-9
    assert real.now() >= start / 10.0 + 0.004
    with pytest.raises(ValueError):
        Clock("real", 0.5)


def _adapter(path):
    from edgemoe.models import load_moe

    return load_moe(str(path))


def test_per_expert_keys_reproduce_the_model_experts(tiny_path):
    adapter = _adapter(tiny_path)
    pairs = [(0, 1), (1, 4), (2, 7)]
    weights = ExpertWeights.load(tiny_path, pairs)
    assert weights.pairs == pairs
    x = torch.randn(6, adapter.hidden_size)
    for layer, e in pairs:
        torch.testing.assert_close(weights.forward(layer, e, x), adapter.expert_output(layer, e, x), atol=1e-6, rtol=0)
    # only what was asked for is held: 3 experts x (2I x H + H x I) fp32
    H, inter = adapter.hidden_size, adapter.config.intermediate_size
    assert weights.nbytes() == 3 * 3 * inter * H * 4
    with pytest.raises(EdgeMoEError, match="not hosted"):
        weights.forward(0, 0, x)


def test_fused_layout_is_sliced_per_expert(tiny_path, tmp_path):
    from safetensors.torch import save_file

    adapter = _adapter(tiny_path)
    state = {k: v.contiguous() for k, v in adapter.model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_path / "config.json").read_text())
    index = expert_index(checkpoint_files(tmp_path))
    assert index.decoder_layers == (0, 1, 2) and set(index.fused) == {0, 1, 2} and not index.per_expert
    weights = ExpertWeights.load(tmp_path, [(1, 3)])
    x = torch.randn(4, adapter.hidden_size)
    torch.testing.assert_close(weights.forward(1, 3, x), adapter.expert_output(1, 3, x), atol=1e-6, rtol=0)


def test_dense_cost_counted_on_headers_equals_the_loaded_backbone(tiny_path, tmp_path):
    """The dense part's FLOPs and bytes (issue 12, item 5): `edgemoe serve` counts them on the checkpoint's headers,
    the demo on the loaded model; both rules give the same numbers, per-expert and fused layouts alike."""
    from safetensors.torch import save_file

    from edgemoe.distributed.weights import dense_cost_of_checkpoint
    from edgemoe.runtime.dense import dense_cost_of_model

    adapter = _adapter(tiny_path)
    loaded = dense_cost_of_model(adapter)
    assert dense_cost_of_checkpoint(tiny_path) == loaded and loaded.flops_per_token > 0
    save_file({k: v.contiguous() for k, v in adapter.model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    assert dense_cost_of_checkpoint(tmp_path).flops_per_token == loaded.flops_per_token


def test_checkpoint_without_experts_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(EdgeMoEError, match="no routed-expert weights"):
        expert_index(checkpoint_files(tmp_path))
    with pytest.raises(EdgeMoEError, match="no model.safetensors"):
        checkpoint_files(tmp_path / "missing")


def test_repair_prefers_live_replica_then_substitute_then_drop(lab3):
    from edgemoe.distributed.repair import degraded_context, repair_slots

    ctx = lab3()
    alive = np.array([True, False, True])
    # expert 0 is on nodes 1 and 2 (node 0 lacks e % 3 == 0); node 1 is dead -> node 2
    experts, node, changed = repair_slots(ctx, 0, np.array([[0, 2]]), np.array([[1, 0]]), np.array([0]), np.array([0]), alive)
    assert changed == 1 and experts.tolist() == [[0, 2]] and node.tolist() == [[2, 0]]
    # with nodes 1 and 2 dead, expert 0 has no live copy: a group substitute that node 0 holds, or a drop
    alive = np.array([True, False, False])
    experts, node, _ = repair_slots(ctx, 0, np.array([[0, 1]]), np.array([[2, 0]]), np.array([0]), np.array([0]), alive)
    subs = [s for s in ctx.groups.substitute_ids[0, 0] if s >= 0 and ctx.hosts[0, 0, s]]
    assert experts[0, 0] == (subs[0] if subs else -1) and node[0, 0] == (0 if subs else -1)
    deg = degraded_context(ctx, np.array([True, False, True]))
    assert not deg.hosts[1].any() and not deg.usable[:, 1].any() and deg.hosts[0].sum() == ctx.hosts[0].sum()
