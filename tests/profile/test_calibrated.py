"""Routing calibrated on the real expert counts (../shared/data/routing): fits, determinism, layer mapping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgemoe.profile.calibrated import (
    RealCounts,
    RoutingModel,
    fit_scores,
    inclusion_rates,
    load_real_counts,
    pair_mutual_information,
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
    assert gen.own and gen.rho in (0.8, 0.85, 0.9, 0.93, 0.96)
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
