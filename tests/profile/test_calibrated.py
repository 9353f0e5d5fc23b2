"""Routing calibrated on the real expert counts (../shared/data/routing): fits, determinism, layer mapping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.profile.calibrated import (
    CORR_MAX,
    RealCounts,
    RoutingModel,
    fit_gap_correlations,
    fit_scores,
    inclusion_rates,
    load_real_counts,
    pair_mutual_information,
    step_coefficients,
)
from edgemoe.profile.specs import model_spec

COUNTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "routing" / "real_expert_counts.json"
needs_counts = pytest.mark.skipif(not COUNTS.is_file(), reason=f"real routing counts absent ({COUNTS})")


def test_fit_scores_recovers_inclusion_rates():
    pi = np.array([[0.9, 0.5, 0.3, 0.2, 0.1], [0.4, 0.4, 0.4, 0.4, 0.4]])  # rows sum to K = 2
    theta = fit_scores(pi, 2, samples=20000, iters=60, seed=1)
    rng = np.random.default_rng(2)
    g = -np.log(-np.log(rng.uniform(size=(40000, 5))))
    for row, target in zip(theta, pi, strict=True):
        s = row + g
        chosen = s >= np.sort(s, axis=1)[:, [-2]]
        assert np.abs(chosen.mean(0) - target).max() < 0.02
    assert np.ptp(theta[1]) < 0.05  # equal rates, equal scores


def test_inclusion_rates_rescale_and_cap():
    counts = RealCounts("m", "x/y", 4, 4, 2, (0,), (), ("d",), np.array([[[300.0, 100, 50, 50]]]), np.zeros((1, 0, 4, 4)))
    pi = inclusion_rates(counts, 3, 1)  # 250 tokens; keep 3 experts, top-1
    assert np.isclose(pi.sum(), 1.0) and pi.max() <= 0.98
    assert pi[0, 0, 0] > pi[0, 0, 1] > pi[0, 0, 2]
    assert pair_mutual_information(np.eye(4)) == pytest.approx(2.0)
    assert pair_mutual_information(np.ones((4, 4))) == pytest.approx(0.0)


@needs_counts
def test_mixtral_generator_reproduces_real_counts_at_measured_layers():
    counts = load_real_counts(COUNTS, "mixtral")
    assert counts.domains == ("arxiv", "book", "c4", "github", "wikipedia") and counts.layers == (0, 7, 15)
    gen = RoutingModel(model_spec("mixtral-8x7b"), counts, seed=0)
    assert gen.own
    r = gen.draw(3000, seed=1)
    assert r.topk.shape == (15000, 32, 2) and np.allclose(r.gates.sum(-1), 1.0)  # Mixtral renormalises
    for d in range(5):
        rows = r.topk[r.domain == d]
        for i, layer in enumerate(counts.layers):
            got = np.bincount(rows[:, layer].ravel(), minlength=8) / len(rows)
            want = counts.topk[d, i] / counts.tokens[d]
            assert np.abs(got - want).max() < 0.04, (d, layer)
    again = gen.draw(3000, seed=1)
    assert (again.topk == r.topk).all() and (again.gates == r.gates).all()
    # consecutive layers are dependent (AR(1) latent), more than layers far apart
    def mi(a, b):
        t = np.zeros((8, 8))
        np.add.at(t, (r.topk[:, a, 0], r.topk[:, b, 0]), 1)
        return pair_mutual_information(t)
    assert mi(20, 21) > mi(20, 31) > 0


@needs_counts
def test_qwen_dimensions_from_olmoe_counts():
    counts = load_real_counts(COUNTS, "olmoe")
    pi = inclusion_rates(counts, 60, 4)
    assert pi.shape == (5, 3, 60) and np.allclose(pi.sum(-1), 4.0) and pi.max() <= 0.98


def _counts(layers, pairs, num_layers, cross_scale):
    """Two domains, E = 4, top-1: layer pair tables that are the identity (fully dependent) times
    cross_scale plus a uniform floor, so the real mutual information grows with cross_scale."""
    E, D = 4, 2
    topk = np.full((D, len(layers), E), 250.0)
    cross = np.stack([np.stack([np.eye(E) * cross_scale * 250 + (1 - cross_scale) * 250 / E for _ in pairs])
                      for _ in range(D)])
    return RealCounts("m", "x/y", num_layers, E, 1, tuple(layers), tuple(pairs), ("a", "b"), topk, cross)


def test_gap_correlation_reproduces_each_pairs_mutual_information():
    """Each measured pair gets its own correlation; the generated pair's MI excess over independence equals
    the real one's (to the bisection's resolution), and a stronger pair gets a larger correlation."""
    counts = _counts((0, 2, 6), ((0, 2), (2, 6)), 8, 0.5)
    counts.cross[:, 1] = np.stack([np.eye(4) * 0.2 * 250 + 0.8 * 250 / 4 for _ in range(2)])  # pair 2: weaker
    theta = fit_scores(inclusion_rates(counts, 4, 1), 1, seed=0)
    corr, info = fit_gap_correlations(counts, theta, tokens=6000, seed=0)
    assert 0 < corr[1] < corr[0] < CORR_MAX
    excess_real = np.array(info["real_mi_bits"]) - np.array(info["independent_mi_bits"])
    excess_got = np.array(info["generated_mi_bits"]) - np.array(info["independent_mi_bits"])
    assert np.allclose(excess_got, excess_real, atol=2e-3)


def test_gap_correlation_bounds():
    """No real dependence beyond the finite-sample floor: c = 0; more dependence than any c reaches: CORR_MAX."""
    theta_counts = _counts((0, 4), ((0, 4),), 8, 0.0)
    theta = fit_scores(inclusion_rates(theta_counts, 4, 1), 1, seed=0)
    corr, _ = fit_gap_correlations(theta_counts, theta, tokens=4000, seed=0)
    assert corr[0] == 0.0
    full = _counts((0, 4), ((0, 4),), 8, 1.0)  # layer 4's expert is layer 0's: 2 bits, beyond any Gaussian latent
    corr, _ = fit_gap_correlations(full, theta, tokens=4000, seed=0)
    assert corr[0] == CORR_MAX


def test_step_coefficients_keep_each_spans_correlation():
    """The per-step coefficients inside a measured span multiply to its correlation, on the counted depth and
    on a target of another depth; steps past the last measured layer take the last span's coefficient."""
    counts = _counts((0, 7, 15), ((0, 7), (7, 15)), 16, 0.5)
    corr = np.array([0.3, 0.8])
    for L in (16, 24, 32):
        r = step_coefficients(counts, corr, L)
        depth = np.arange(L) / L
        first = (depth > 0) & (depth <= 7 / 16 + 1e-12)
        second = (depth > 7 / 16 + 1e-12) & (depth <= 15 / 16 + 1e-12)
        assert r[0] == 1.0 and np.isclose(np.prod(r[first]), 0.3) and np.isclose(np.prod(r[second]), 0.8)
        assert np.allclose(r[depth > 15 / 16 + 1e-12], r[second][-1])
    assert step_coefficients(counts, np.array([0.0, 0.5]), 16)[1:8].max() == 0.0  # an independent span stays so


@needs_counts
def test_mixtral_pairs_match_the_real_mutual_information():
    """The issue's check: the generated (0, 7) and (7, 15) pairs' MI matches the real pairs' (0.036 and 0.068
    bits on Mixtral); one coefficient for all layers gave 0.079 for (0, 7)."""
    gen = RoutingModel(model_spec("mixtral-8x7b"), load_real_counts(COUNTS, "mixtral"), seed=0)
    fit = gen.corr_info
    assert np.allclose(fit["generated_mi_bits"], fit["real_mi_bits"], atol=2e-3)
    assert gen.gap_corr[0] < gen.gap_corr[1]  # layers 0-7 are less dependent than 7-15 on Mixtral
    assert np.isclose(np.prod(gen.step_rho[1:8]), gen.gap_corr[0]) and np.isclose(np.prod(gen.step_rho[8:16]),
                                                                                     gen.gap_corr[1])


def _counts_file(tmp_path, pairs, tables):
    """A one-domain counts file of a 16-layer, 4-expert, top-1 model measured at layers 0, 7 and 15."""
    import json

    doc = {"models": {"m": {"hf_id": "x/y", "num_layers": 16, "num_experts": 4, "top_k": 1, "layers": [0, 7, 15],
                            "layer_pairs": pairs, "domains": {"d": {"topk": [[25, 25, 25, 25]] * 3,
                                                                    "crosslayer_topk": [np.eye(4).tolist()] * tables}}}}}
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("pairs, tables", [([[0, 3]], 1), ([[7, 0]], 1), ([[0, 7], [7, 15]], 1), ([[0, 7, 15]], 1)])
def test_layer_pairs_must_name_measured_layers_in_order(tmp_path, pairs, tables):
    """A pair of an unmeasured layer, a reversed pair, a table count that disagrees, or a triple: one clear
    error naming the file and the field, not a KeyError in the fit."""
    from edgemoe.errors import EdgeMoEError

    path = _counts_file(tmp_path, pairs, tables)
    with pytest.raises(EdgeMoEError, match=r"counts.json: models.m.layer_pairs: expected pairs"):
        load_real_counts(path, "m")
    assert load_real_counts(_counts_file(tmp_path, [[0, 7], [7, 15]], 2), "m").layer_pairs == ((0, 7), (7, 15))
