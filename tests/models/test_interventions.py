"""Known answers for substitution, gate modes and drops at the level of one MoE block."""

import pytest
import torch

from edgemoe.models import Intervention, LayerCall, adapter_for, apply_intervention
from edgemoe.models.tiny import tiny_model


@pytest.fixture(scope="module")
def mixtral():
    return adapter_for(tiny_model("mixtral", seed=3), "mixtral")


def block_call(adapter, layer=0, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, adapter.hidden_size, generator=g)
    logits = adapter.router_logits(layer, hidden)
    topk, gates = adapter.route(layer, logits)
    return LayerCall(layer, hidden, logits, topk, gates)


def manual_output(adapter, call, experts, gates):
    out = torch.zeros_like(call.hidden)
    for t in range(call.hidden.shape[0]):
        for k in range(experts.shape[1]):
            out[t] += gates[t, k] * adapter.expert_output(call.layer, int(experts[t, k]), call.hidden[t:t + 1])[0]
    return out


def run_block(adapter, call, policy):
    with adapter.intervene(policy), torch.no_grad():
        return adapter.blocks[call.layer](call.hidden[None])[0]


def test_keep_gate_substitution_known_answer(mixtral):
    call = block_call(mixtral)
    subst = call.topk.clone()
    subst[:, 1] = (subst[:, 1] + 3) % mixtral.num_experts
    got = run_block(mixtral, call, lambda c: Intervention(subst))
    want = manual_output(mixtral, call, subst, call.gates)
    assert torch.allclose(got, want, atol=1e-5)


def test_drop_renormalises_remaining_gates(mixtral):
    call = block_call(mixtral)
    experts = call.topk.clone()
    experts[:, 1] = -1
    got = run_block(mixtral, call, lambda c: Intervention(experts))
    # Mixtral's two gates sum to 1, so the survivor gets weight 1.
    want = manual_output(mixtral, call, call.topk[:, :1], torch.ones(call.topk.shape[0], 1))
    assert torch.allclose(got, want, atol=1e-5)


def test_drop_everything_gives_zero(mixtral):
    call = block_call(mixtral)
    got = run_block(mixtral, call, lambda c: Intervention(torch.full_like(c.topk, -1)))
    assert torch.count_nonzero(got) == 0


def test_router_gate_mode_uses_substitute_score(mixtral):
    call = block_call(mixtral)
    subst = call.topk.clone()
    subst[:, 0] = (subst[:, 0] + 5) % mixtral.num_experts
    topk, gates = apply_intervention(mixtral, call, Intervention(subst, gate_mode="router"))
    probs = torch.softmax(call.router_logits, -1)
    raw = torch.stack([probs.gather(1, subst[:, :1])[:, 0], call.gates[:, 1]], 1)
    assert torch.allclose(gates, raw / raw.sum(1, keepdim=True), atol=1e-6)
    assert torch.equal(topk, subst)


def test_bad_intervention_is_rejected(mixtral):
    from edgemoe.errors import EdgeMoEError

    call = block_call(mixtral)
    with pytest.raises(EdgeMoEError, match="ids must lie"):
        apply_intervention(mixtral, call, Intervention(call.topk + 100))
    with pytest.raises(EdgeMoEError, match="shape"):
        apply_intervention(mixtral, call, Intervention(call.topk[:, :1]))
    with pytest.raises(EdgeMoEError, match="gate_mode"):
        apply_intervention(mixtral, call, Intervention(call.topk, gate_mode="nope"))


def test_switch_drop_and_substitute():
    adapter = adapter_for(tiny_model("switch_transformers", seed=2), "switch")
    call = block_call(adapter, T=4)
    got = run_block(adapter, call, lambda c: Intervention((c.topk + 1) % adapter.num_experts))
    want = manual_output(adapter, call, (call.topk + 1) % adapter.num_experts, call.gates)
    assert torch.allclose(got, want, atol=1e-5)
    zero = run_block(adapter, call, lambda c: Intervention(torch.full_like(c.topk, -1)))
    assert torch.count_nonzero(zero) == 0
