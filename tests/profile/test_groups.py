"""Similarity groups: a hand-checked worked example, invariants, properties, and the depth sanity check."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgemoe.errors import EdgeMoEError
from edgemoe.profile import synthetic_profile
from edgemoe.profile.groups import (
    adaptive_group_counts,
    cosine_error_spearman,
    fixed_count_groups,
    grouping_report,
    groups_for,
    layer_aware_groups,
    layer_thresholds,
    threshold_groups,
    traffic_coverage,
    uniform_threshold_groups,
)


def symmetric_sim(num_experts: int, pairs: dict[tuple[int, int], float]) -> np.ndarray:
    """[E, E] raw-cosine matrix with a unit diagonal, `pairs` set symmetrically, 0 elsewhere (as
    tests/plan/conftest.py builds them; tests/profile is no package, so it cannot import that one)."""
    sim = np.eye(num_experts)
    for (a, b), value in pairs.items():
        sim[a, b] = sim[b, a] = value
    return sim


# The worked example of docs/planners-ordermoe.md: one layer, six experts, threshold 0.5 (raw cosine).
FREQ = np.array([[0.6, 0.5, 0.4, 0.3, 0.15, 0.05]])
SIM = symmetric_sim(6, {
    (0, 1): 0.2, (0, 2): 0.7, (1, 2): 0.9, (0, 3): 0.55, (1, 3): 0.1, (2, 3): 0.95,
    (0, 4): 0.3, (1, 4): 0.4, (2, 4): 0.2, (3, 4): 0.6, (0, 5): 0.6, (4, 5): 0.55, (3, 5): 0.1,
})[None]
ERR = np.clip(1.0 - SIM, 0.0, 2.0)
ERR[0, 0, 3] = ERR[0, 0, 5] = 0.2  # tie: broken by similarity (5 is more similar to 0 than 3 is)
ERR[0, 3, 0], ERR[0, 3, 5] = 0.3, 0.1  # error beats similarity: 5 ranks above 0 as 3's substitute


def example_groups(theta: float = 0.5):
    return threshold_groups(SIM, FREQ, ERR, np.array([theta]), method="example")


def test_worked_example_groups():
    g = example_groups()
    # 0 leads; 1 (sim 0.2 to 0) leads; 2 joins 1 (0.9 beats 0.7 to 0); 3 joins 0 (0.55, 0.1);
    # 4 (0.3, 0.4) leads; 5 joins 0 (0.6 beats 0.55 to 4).
    assert g.group_of.tolist() == [[0, 1, 1, 0, 2, 0]]
    assert g.dominant.tolist() == [[0, 1, 4]]
    assert g.num_groups.tolist() == [3]
    assert g.size_histogram()[0, :4].tolist() == [0, 1, 1, 1]


def test_worked_example_substitutes():
    g = example_groups()
    assert g.substitute_ids.shape == (1, 6, 2)
    assert g.substitutes(0, 0).tolist() == [5, 3]  # equal error 0.2, similarity 0.6 > 0.55
    assert g.substitutes(0, 3).tolist() == [5, 0]  # error 0.1 < 0.3 despite similarity 0.1 < 0.55
    assert g.substitutes(0, 2).tolist() == [1]
    assert g.substitute_ids[0, 4].tolist() == [-1, -1]  # a singleton has no substitute
    assert g.substitute_sim[0, 3, 0] == pytest.approx(0.1)
    assert g.substitute_err[0, 3, 1] == pytest.approx(0.3)
    assert np.isnan(g.substitute_err[0, 2, 1])


def test_worked_example_stricter_threshold_splits_groups():
    g = example_groups(theta=0.7)
    # Only 2 -> 1 (0.9) clears 0.7; everyone else leads their own group.
    assert g.group_of.tolist() == [[0, 1, 1, 2, 3, 4]]


def test_worked_example_fixed_count():
    profile = _profile_with(FREQ, SIM, ERR)
    g = fixed_count_groups(profile, 2)
    # Dominants: the two most frequent (0, 1); 2 -> 1 (0.9), 3 -> 0, 4 -> 1 (0.4 > 0.3), 5 -> 0.
    assert g.group_of.tolist() == [[0, 1, 1, 0, 1, 0]]
    assert g.dominant.tolist() == [[0, 1]]
    capped = fixed_count_groups(profile, 3, max_group_size=2)
    # Dominants 0, 1, 2; 3 -> 2 (0.95); 4 -> 1 (0.4); 5 -> 0.
    assert capped.group_of.tolist() == [[0, 1, 2, 2, 1, 0]]


def test_thresholds_loosen_linearly():
    assert layer_thresholds(3, 0.6, 0.3) == pytest.approx([0.6, 0.45, 0.3])
    assert layer_thresholds(1, 0.6, 0.3) == pytest.approx([0.6])
    with pytest.raises(EdgeMoEError, match="theta_lo"):
        layer_thresholds(4, 0.3, 0.6)
    with pytest.raises(EdgeMoEError, match=r"\[-1, 1\]"):
        layer_thresholds(4, 1.5, 0.3)


def test_adaptive_group_counts_follow_skew():
    freq = np.array([[1.0, 0.5, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]])
    # Scaled rows: [1, .5, .3, .2] and [1, 1, 1, 1]. The 6th largest of all is 0.5 -> counts 2 and 4;
    # the 5th largest is 1.0 -> the skewed layer keeps 1 group, the flat one all 4 (ties at 1.0).
    assert adaptive_group_counts(freq, 6).tolist() == [2, 4]
    assert adaptive_group_counts(freq, 5).tolist() == [1, 4]
    assert adaptive_group_counts(freq, 8).tolist() == [4, 4]


def test_deeper_layers_give_larger_groups_on_synthetic_profiles():
    slopes_aware, slopes_uniform = [], []
    for seed in range(4):
        profile = synthetic_profile(8, 16, 2, 2000, seed=seed)
        aware = layer_aware_groups(profile).mean_group_size()
        uniform = uniform_threshold_groups(profile).mean_group_size()
        assert aware[4:].mean() > aware[:4].mean()
        slopes_aware.append(np.polyfit(np.arange(8), aware, 1)[0])
        slopes_uniform.append(np.polyfit(np.arange(8), uniform, 1)[0])
    assert np.mean(slopes_aware) > np.mean(slopes_uniform)


def test_groups_for_rejects_foreign_parameters():
    profile = synthetic_profile(2, 8, 2, 200, seed=0)
    with pytest.raises(EdgeMoEError, match="does not take"):
        groups_for(profile, "uniform", theta_hi=0.5)
    with pytest.raises(EdgeMoEError, match="grouping"):
        groups_for(profile, "kmeans")
    assert groups_for(profile, "fixed").num_groups.tolist() == [4, 4]


@st.composite
def random_layer(draw):
    E = draw(st.integers(1, 9))
    L = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(L, E, 5))
    x /= np.linalg.norm(x, axis=2, keepdims=True)
    sim = np.clip(x @ x.transpose(0, 2, 1), -1, 1)
    freq = np.round(rng.dirichlet(np.ones(E), size=L) * 2, 2)  # rounding makes frequency ties likely
    err = np.clip(1 - sim, 0, 2) + rng.uniform(0, 0.1, size=sim.shape)
    thresholds = np.sort(rng.uniform(-0.5, 0.9, size=L))[::-1]
    cap = draw(st.one_of(st.none(), st.integers(1, 4)))
    return sim, freq, err, thresholds, cap


@settings(max_examples=40, deadline=None)
@given(random_layer())
def test_threshold_group_invariants(case):
    sim, freq, err, thresholds, cap = case
    g = threshold_groups(sim, freq, err, thresholds, cap)
    L, E = freq.shape
    for layer in range(L):
        sizes = np.bincount(g.group_of[layer])
        assert sizes.sum() == E and (sizes > 0).all()
        if cap is not None:
            assert sizes.max() <= cap
        for grp in range(g.num_groups[layer]):
            dom = g.dominant[layer, grp]
            members = g.members(layer, grp)
            assert dom in members
            assert freq[layer, members].max() == freq[layer, dom]  # dominant is (one of) the most frequent
            others = members[members != dom]
            assert (sim[layer, dom, others] >= thresholds[layer]).all()
        if cap is None:  # without a cap, dominants are pairwise below the threshold (leader clustering)
            doms = g.dominant[layer, : g.num_groups[layer]]
            pair = sim[layer][np.ix_(doms, doms)] - 2 * np.eye(len(doms))
            assert (pair < thresholds[layer]).all()
        for e in range(E):
            subs = g.substitutes(layer, e)
            mates = g.members(layer, g.group_of[layer, e])
            assert sorted(subs.tolist()) == sorted(mates[mates != e].tolist())
            errs = err[layer, e, subs]
            assert (np.diff(errs) >= 0).all()  # ranked by substitution error


@settings(max_examples=30, deadline=None)
@given(random_layer(), st.integers(1, 9))
def test_fixed_count_group_invariants(case, count):
    sim, freq, err, _, _ = case
    L, E = freq.shape
    count = min(count, E)
    profile = _profile_with(freq, sim, err)
    g = fixed_count_groups(profile, count)
    assert g.num_groups.tolist() == [count] * L
    for layer in range(L):
        doms = g.dominant[layer, :count]
        top = np.sort(freq[layer])[::-1][:count]
        assert np.sort(freq[layer, doms])[::-1] == pytest.approx(top)
        for e in range(E):  # every non-dominant sits with a most similar dominant
            if e not in doms:
                assert sim[layer, e, doms[g.group_of[layer, e]]] == pytest.approx(sim[layer, e, doms].max())


def _profile_with(freq, sim, err):
    from dataclasses import replace

    L, E = freq.shape
    base = synthetic_profile(L, E, 1, 20, num_domains=1, seed=0)
    return replace(base, freq=freq, sim=sim, subst_err=err, freq_by_domain=freq[None])


# ------------------------------------------------------------------ groups from measured error, and reports


def _one_layer(sim_layer: np.ndarray, err_layer: np.ndarray, freq_layer: np.ndarray):
    freq = np.asarray(freq_layer, float)[None]
    return _profile_with(freq, sim_layer[None], err_layer[None])


def test_error_groups_use_measured_error_both_ways():
    # 0<->1 swap cheaply both ways; 2->3 is cheap but 3->2 is not, so 2 and 3 stay apart; cosine says the opposite.
    err = np.full((4, 4), 1.5)
    np.fill_diagonal(err, 0.0)
    err[0, 1], err[1, 0] = 0.3, 0.5
    err[2, 3], err[3, 2] = 0.2, 1.2
    sim = symmetric_sim(4, {(2, 3): 0.95, (0, 1): -0.2})
    profile = _one_layer(sim, err, [0.4, 0.3, 0.2, 0.1])
    g = groups_for(profile, "error", max_err=0.9)
    assert g.group_of[0].tolist() == [0, 0, 1, 2]
    assert g.substitutes(0, 0).tolist() == [1] and g.substitutes(0, 2).tolist() == []
    assert np.isnan(g.thresholds).all() and g.method == "error"
    cosine = groups_for(profile, "uniform", theta=0.5)
    assert cosine.group_of[0].tolist() == [0, 1, 2, 2]
    # traffic with a substitute: error groups 0.4 + 0.3 of 1.0; cosine groups 0.2 + 0.1, and of those only
    # 2 (-> 3 at 0.2) beats zeroing the branch
    assert traffic_coverage(g, profile.freq).tolist() == pytest.approx([0.7])
    assert traffic_coverage(cosine, profile.freq).tolist() == pytest.approx([0.3])
    assert traffic_coverage(cosine, profile.freq, max_err=1.0).tolist() == pytest.approx([0.2])


def test_spearman_sees_a_cosine_that_predicts_error_and_one_that_does_not():
    rng = np.random.default_rng(0)
    sim = rng.uniform(-1, 1, size=(2, 6, 6))
    sim = 0.5 * (sim + np.swapaxes(sim, 1, 2))
    err = np.stack([1.0 - sim[0], rng.uniform(0, 2, size=(6, 6))])  # layer 0: error falls as cosine rises
    rho, p = cosine_error_spearman(sim, err)
    assert rho[0] == pytest.approx(-1.0) and p[0] < 1e-6
    assert abs(rho[1]) < 0.5


def test_grouping_report_shapes_and_the_profile_report(tmp_path):
    from edgemoe.profile.report import specialisation_report

    profile = synthetic_profile(3, 8, 2, num_tokens=300, seed=1)
    rep = grouping_report(profile)
    assert len(rep["spearman_cosine_vs_error"]) == 3
    assert set(rep["groupings"]) == {"layer-aware", "error"}
    for g in rep["groupings"].values():
        assert all(0.0 <= v <= 1.0 for v in g["traffic_with_substitute"])
        assert all(b <= a for a, b in zip(g["traffic_with_substitute"], g["traffic_with_substitute_better_than_zero"],
                                            strict=True))
    # the synthetic profile's error is 1 - cosine + noise: the report must see cosine predicting it
    assert all(r < -0.8 for r in rep["spearman_cosine_vs_error"])
    out = specialisation_report(profile, tmp_path)
    assert out["substitution"]["spearman_cosine_vs_error"] == rep["spearman_cosine_vs_error"]
