"""The adapter is exact: no intervention -> the HF model's own logits; routing equals the model's."""

import pytest
import torch

from edgemoe.models import Intervention, adapter_for
from edgemoe.models.tiny import FAMILIES, TINY_VOCAB, tiny_model


def reference_logits(model, family, x):
    if family == "switch_transformers":
        return model(input_ids=x, decoder_input_ids=model._shift_right(x)).logits
    return model(input_ids=x).logits


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    family = request.param
    model = tiny_model(family, seed=1)
    if family == "switch_transformers":  # the reference also runs without capacity dropping
        for stack in (model.encoder, model.decoder):
            for block in stack.block:
                if hasattr(block.layer[-1].mlp, "router"):
                    block.layer[-1].mlp.router.expert_capacity = 1 << 30
    x = torch.randint(1, TINY_VOCAB, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference_logits(model, family, x)
    return family, adapter_for(model, family), x, ref


def test_logits_equal_hf_forward(family_model):
    family, adapter, x, ref = family_model
    out = adapter.forward_logits(x)
    assert (out - ref).abs().max().item() <= 1e-5


def test_identity_intervention_is_exact(family_model):
    family, adapter, x, ref = family_model
    with adapter.intervene(lambda call: Intervention(call.topk.clone())):
        out = adapter.forward_logits(x)
    assert (out - ref).abs().max().item() <= 1e-5


def test_route_matches_model_routing(family_model):
    family, adapter, x, _ = family_model
    calls = []
    with adapter.record(calls.append):
        adapter.forward_logits(x)
    assert len(calls) == adapter.num_layers
    for call in calls:
        topk, gates = adapter.route(call.layer, call.router_logits)
        order_a, order_b = topk.argsort(-1), call.topk.argsort(-1)
        assert torch.equal(topk.gather(1, order_a), call.topk.gather(1, order_b))
        assert torch.allclose(gates.gather(1, order_a), call.gates.gather(1, order_b), atol=1e-6)


def test_substitution_changes_output(family_model):
    family, adapter, x, ref = family_model
    E = adapter.num_experts
    with adapter.intervene(lambda call: Intervention((call.topk + 1) % E)):
        out = adapter.forward_logits(x)
    assert (out - ref).abs().max().item() > 1e-4


def test_facts(family_model):
    family, adapter, _, _ = family_model
    assert adapter.num_experts == 8
    assert adapter.top_k == (1 if family == "switch_transformers" else 2)
    assert adapter.expert_bytes().shape == (adapter.num_layers, 8)
    assert (adapter.expert_flops() == 2 * adapter.expert_params()).all()
    # fp32 storage in these tiny models: 4 bytes per parameter
    assert (adapter.expert_bytes(torch.float32) == 4 * adapter.expert_params()).all()
    assert (adapter.expert_bytes(torch.bfloat16) == 2 * adapter.expert_params()).all()
