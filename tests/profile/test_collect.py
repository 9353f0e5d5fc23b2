"""Profiles of every family's tiny model: invariants, measured substitution error, save/load round trip."""

import numpy as np
import pytest

from edgemoe.data import TokenBlocks
from edgemoe.errors import EdgeMoEError
from edgemoe.models import adapter_for
from edgemoe.models.tiny import FAMILIES, TINY_VOCAB, tiny_model
from edgemoe.profile import load_profile
from edgemoe.profile.collect import collect_profile


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_profile(request):
    adapter = adapter_for(tiny_model(request.param, seed=4), request.param)
    ids = np.random.default_rng(0).integers(1, TINY_VOCAB, (6, 24))
    blocks = TokenBlocks(ids, np.array([0, 0, 1, 1, 2, 2]), ("a", "b", "c"))
    return adapter, collect_profile(adapter, blocks, request.param, "random ids", batch_size=4, subst_tokens=48,
                                    progress=False)


def test_invariants(tiny_profile):
    adapter, p = tiny_profile
    T, L, E, K = 6 * 24, adapter.num_layers, adapter.num_experts, adapter.top_k
    assert p.router_logits.shape == (T, L, E) and p.topk.shape == (T, L, K)
    assert np.allclose(p.freq.sum(1), K)
    assert np.allclose(p.freq_by_domain.sum(2), K)
    assert np.allclose(p.sim, p.sim.transpose(0, 2, 1)) and np.allclose(np.diagonal(p.sim, 0, 1, 2), 1)
    rows = p.trans.sum(2)
    assert np.allclose(rows[p.freq[:-1] > 0], 1.0)
    assert np.allclose(np.diagonal(p.subst_err, 0, 1, 2), 0.0)
    off = ~np.eye(E, dtype=bool)
    assert (p.subst_err[:, off] > 0).all()  # random experts differ
    assert (p.expert_bytes == adapter.expert_bytes()).all()
    assert p.meta.hidden_bytes == 2 * adapter.hidden_size  # bf16 on the wire


def test_subst_err_is_measured(tiny_profile):
    """Recompute one entry by hand from expert outputs on the recorded routing."""
    adapter, p = tiny_profile
    import torch

    from edgemoe.profile.collect import substitution_error

    h = torch.randn(40, adapter.hidden_size, generator=torch.Generator().manual_seed(1))
    topk = torch.zeros(40, adapter.top_k, dtype=torch.long)  # every token routed to expert 0 (and 0)
    err = substitution_error(adapter, 0, h, topk)
    y0, y3 = adapter.expert_output(0, 0, h).double(), adapter.expert_output(0, 3, h).double()
    assert np.isclose(err[0, 3], float((y3 - y0).norm() / y0.norm()), rtol=1e-6)


def test_roundtrip(tiny_profile, tmp_path):
    adapter, p = tiny_profile
    p.save(tmp_path / "prof")
    q = load_profile(tmp_path / "prof")
    assert q.meta == p.meta
    for name in ("router_logits", "topk", "gates", "domain", "freq", "freq_by_domain", "coact", "trans", "sim",
                 "subst_err", "expert_bytes", "expert_flops"):
        assert np.array_equal(getattr(q, name), getattr(p, name)), name
    q.check_matches(adapter.num_layers, adapter.num_experts, adapter.top_k, adapter.weights_hash())
    with pytest.raises(EdgeMoEError, match="does not match"):
        q.check_matches(adapter.num_layers, adapter.num_experts, adapter.top_k, "0" * 64)
    with pytest.raises(EdgeMoEError, match=r"\(L, E, K\)"):
        q.check_matches(adapter.num_layers + 1, adapter.num_experts, adapter.top_k)


def test_load_errors(tmp_path):
    with pytest.raises(EdgeMoEError, match="not a profile folder"):
        load_profile(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    (tmp_path / "arrays.safetensors").write_bytes(b"")
    with pytest.raises(EdgeMoEError, match="invalid JSON"):
        load_profile(tmp_path)
