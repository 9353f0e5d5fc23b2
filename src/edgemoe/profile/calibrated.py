"""Synthetic per-token routing calibrated on real expert counts (pure numpy, seeded).

`../shared/data/routing/real_expert_counts.json` holds real Mixtral-8x7B and OLMoE-1B-7B routing statistics
on five domains: per-expert top-k counts at layers 0, 7 and 15 and slot-by-slot cross-layer pair counts for
layers (0, 7) and (7, 15). Counts, not traces, so paper-scale scenarios draw tokens from a generative model
fitted to them (docs/traces.md, "Calibrated routing"):

- Each token has a domain and a latent z_l in R^E per layer, an AR(1) chain z_{l+1} = rho_l z_l + sqrt(1 - rho_l^2) eps
  with N(0, I) marginals. Its Gumbel transform g = -log(-log Phi(z)) perturbs per-(domain, layer) scores theta,
  and the layer's experts are the top-K of theta + g (Gumbel top-K, i.e. Plackett-Luce sampling).
- theta is fitted so that each expert's top-K inclusion rate equals the real count / tokens, per domain and
  measured layer (fixed-point iteration on a fixed noise sample). The latent's marginal at every layer is
  the same, so the fit holds at every layer whatever the rho_l are.
- Each measured layer pair, (0, 7) and (7, 15), gets its own latent correlation, fitted so that the
  within-domain mutual information of its slot-by-slot expert pairs matches the real counts' pair
  (`fit_gap_correlations`); the steps inside the pair's span of relative depth share it evenly
  (rho_l = c^(1/n)), and steps deeper than the last measured layer take the last span's rho_l
  (`step_coefficients`).
- Target layer l takes the measured layer nearest in relative depth, with its expert ids permuted by a seeded
  permutation (expert ids of different layers are unrelated); when the target is the counted model itself,
  the measured layers keep their ids, so those layers reproduce the real counts.
- A target with other (E, K) (Qwen1.5-MoE-A2.7B: 60 experts, top-4, calibrated on OLMoE's 64, top-8) keeps
  the first E experts' counts and rescales inclusion rates to sum to K (each capped below 1).
- Gates: softmax of the chosen scores (renormalised over the K, as Mixtral does) or of all E scores
  (Qwen2-MoE / OLMoE, norm_topk_prob false), read off the chosen experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError

from .specs import ModelSpec

CORR_MAX = 0.999  # the largest latent correlation a measured layer pair may be given
CORR_BISECTIONS = 24  # halvings of [0, CORR_MAX] per pair: the fit's resolution, 6e-8
NORMALISES_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False, "deepseek_v2": False,
                   "deepseek_v3": True, "switch_transformers": False}


@dataclass(frozen=True)
class RealCounts:
    """One model's counts from real_expert_counts.json. D domains, M measured layers, P layer pairs."""

    model: str  # key in the file ("mixtral", "olmoe")
    hf_id: str
    num_layers: int
    num_experts: int
    top_k: int
    layers: tuple[int, ...]  # [M]
    layer_pairs: tuple[tuple[int, int], ...]  # [P]
    domains: tuple[str, ...]  # [D]
    topk: np.ndarray  # [D, M, E] selection counts (every selected expert of every token)
    cross: np.ndarray  # [D, P, E, E] slot-by-slot pair counts

    @property
    def tokens(self) -> np.ndarray:
        """[D] tokens per domain (top-k counts of a layer sum to tokens x K)."""
        return self.topk[:, 0].sum(axis=1) / self.top_k


def load_real_counts(path: str | Path, model: str) -> RealCounts:
    """Read one model's counts; EdgeMoEError naming the file and field on anything unexpected."""
    import json

    path = Path(path)
    if not path.is_file():
        raise EdgeMoEError(f"{path}: real routing counts not found (expected ../shared/data/routing/real_expert_counts.json)")
    try:
        doc = json.loads(path.read_text())
        m = doc["models"][model]
        per = m["domains"]  # {domain: {"topk": [M][E], "crosslayer_topk": [P][E][E], ...}}
        domains = tuple(per)
        topk = np.array([per[d]["topk"] for d in domains], dtype=np.float64)
        cross = np.array([per[d]["crosslayer_topk"] for d in domains], dtype=np.float64)
        counts = RealCounts(model=model, hf_id=m["hf_id"], num_layers=int(m["num_layers"]), num_experts=int(m["num_experts"]),
                            top_k=int(m["top_k"]), layers=tuple(m["layers"]), layer_pairs=tuple(tuple(p) for p in m["layer_pairs"]),
                            domains=domains, topk=topk, cross=cross)
    except (KeyError, TypeError, ValueError) as exc:
        raise EdgeMoEError(f"{path}: models.{model}: unexpected layout ({exc!r})") from exc
    D, M, E = counts.topk.shape
    if E != counts.num_experts or M != len(counts.layers) or counts.cross.shape[2:] != (E, E):
        raise EdgeMoEError(f"{path}: models.{model}: count shapes {counts.topk.shape}, {counts.cross.shape} disagree with "
                           f"{counts.num_experts} experts at layers {counts.layers}")
    if counts.cross.shape[1] != len(counts.layer_pairs) or any(
            len(p) != 2 or p[0] not in counts.layers or p[1] not in counts.layers or p[0] >= p[1]
            for p in counts.layer_pairs):
        raise EdgeMoEError(f"{path}: models.{model}.layer_pairs: expected pairs (a, b) of measured layers "
                           f"{counts.layers} with a < b, one per crosslayer_topk table; got {counts.layer_pairs} "
                           f"and {counts.cross.shape[1]} tables")
    return counts


def inclusion_rates(counts: RealCounts, num_experts: int, top_k: int) -> np.ndarray:
    """[D, M, E'] target inclusion probability of each expert (rows sum to K'), from the counts.

    E' <= E keeps the first E' experts; rates are rescaled to sum to K' and capped at 0.98 (a capped
    expert's excess is spread over the others in proportion).
    """
    if num_experts > counts.num_experts:
        raise EdgeMoEError(f"cannot calibrate {num_experts} experts on {counts.model}'s {counts.num_experts}")
    pi = counts.topk[:, :, :num_experts] / counts.tokens[:, None, None]
    pi = np.maximum(pi, 1e-6)
    for _ in range(50):  # rescale to K', cap, repeat until the cap no longer binds
        pi = pi * (top_k / pi.sum(axis=2, keepdims=True))
        if (pi <= 0.98).all():
            break
        pi = np.minimum(pi, 0.98)
    return pi


def gumbel_of_normal(z: np.ndarray) -> np.ndarray:
    """Standard Gumbel variates from standard normal ones, by the probability integral transform."""
    from scipy.special import ndtr

    u = np.clip(ndtr(z), 1e-12, 1 - 1e-12)
    return -np.log(-np.log(u))


def fit_scores(pi: np.ndarray, top_k: int, samples: int = 8000, iters: int = 40, seed: int = 0) -> np.ndarray:
    """[..., E] scores theta whose Gumbel top-K inclusion rates match pi [..., E] (fixed-point on fixed noise)."""
    rng = np.random.default_rng(seed)
    E = pi.shape[-1]
    g = -np.log(-np.log(rng.uniform(1e-12, 1 - 1e-12, size=(samples, E))))
    flat = pi.reshape(-1, E)
    out = np.empty_like(flat)
    for b, target in enumerate(flat):  # one row at a time: [S, E] memory, not [B, S, E]
        theta = np.log(target)
        for _ in range(iters):
            s = theta[None] + g
            kth = np.partition(s, E - top_k, axis=1)[:, E - top_k][:, None]
            rate = (s >= kth).mean(axis=0)
            theta = theta + 0.8 * (np.log(target) - np.log(np.maximum(rate, 0.5 / samples)))
            theta -= theta.max()
        out[b] = theta
    return out.reshape(pi.shape)


def _topk_of(s: np.ndarray, k: int) -> np.ndarray:
    """[..., k] ids of the k largest entries of s [..., E], largest first."""
    part = np.argpartition(-s, k - 1, axis=-1)[..., :k]
    vals = np.take_along_axis(s, part, axis=-1)
    return np.take_along_axis(part, np.argsort(-vals, axis=-1), axis=-1)


def pair_mutual_information(pairs: np.ndarray) -> float:
    """Mutual information (bits) of a [E, E] pair-count table."""
    p = pairs / max(pairs.sum(), 1e-300)
    pa, pb = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    ratio = np.divide(p, pa * pb, out=np.ones_like(p), where=p > 0)
    return float((p * np.log2(ratio)).sum())


def real_cross_mi(counts: RealCounts) -> np.ndarray:
    """[P] within-domain mutual information of the real slot-by-slot pairs, averaged over domains."""
    return np.array([[pair_mutual_information(counts.cross[d, p]) for d in range(len(counts.domains))]
                     for p in range(len(counts.layer_pairs))]).mean(axis=1)


def _gap_mi(chosen_a: np.ndarray, theta_b: np.ndarray, K: int, c: float, base: np.ndarray, eps: np.ndarray) -> float:
    """Within-domain mutual information (bits, mean over domains) of the slot-by-slot expert pairs of two layers
    whose latents have correlation c: z_b = c z_a + sqrt(1 - c^2) eps, z_a = base. chosen_a: [D, S, K] the first
    layer's experts on base (`_first_layer_choice`: the same for every c); theta_b: [D, E] the second layer's
    scores; base, eps: [S, E] fixed standard normal samples (the same for every c, so MI is smooth in c)."""
    gb = gumbel_of_normal(c * base + np.sqrt(1.0 - c * c) * eps)
    E = theta_b.shape[1]
    mi = 0.0
    for d in range(len(theta_b)):
        table = np.zeros((E, E))
        np.add.at(table, (chosen_a[d].ravel(), _topk_of(theta_b[d][None] + gb, K).ravel()), 1.0)
        mi += pair_mutual_information(table) / len(theta_b)
    return mi


def _first_layer_choice(theta_a: np.ndarray, K: int, base: np.ndarray) -> np.ndarray:
    """[D, S, K] the top-K experts of theta_a [D, E] + the Gumbel transform of base [S, E], per domain: a pair's
    first layer, whose latent the fit never changes."""
    ga = gumbel_of_normal(base)
    return np.stack([_topk_of(theta_a[d][None] + ga, K) for d in range(len(theta_a))])


def fit_gap_correlations(counts: RealCounts, theta_src: np.ndarray, tokens: int = 4000,
                         seed: int = 0) -> tuple[np.ndarray, dict]:
    """[P] latent correlation c_p = corr(z_a, z_b) of each measured layer pair (a, b), fitted so that the
    generated within-domain mutual information of the pair exceeds independence (c = 0) by as much as the
    real pair's does (the finite sample inflates MI a little on both sides). Bisection on fixed noise,
    CORR_BISECTIONS halvings of [0, CORR_MAX]: MI grows with c. theta_src: [D, M, E] scores of the counted
    model itself (fit_scores on its own rates). A real excess at or below zero gives c = 0; one beyond what
    CORR_MAX reaches gives CORR_MAX."""
    rng = np.random.default_rng(seed)
    E, K = theta_src.shape[2], counts.top_k
    target = real_cross_mi(counts)
    base, eps = rng.normal(size=(tokens, E)), rng.normal(size=(tokens, E))
    index = {layer: i for i, layer in enumerate(counts.layers)}
    corr, null, got = np.zeros(len(counts.layer_pairs)), np.zeros(len(target)), np.zeros(len(target))
    for p, (a, b) in enumerate(counts.layer_pairs):
        ta, tb = _first_layer_choice(theta_src[:, index[a]], K, base), theta_src[:, index[b]]
        null[p] = _gap_mi(ta, tb, K, 0.0, base, eps)
        want = target[p] - null[p]
        lo, hi = 0.0, CORR_MAX
        if want <= 0:
            hi = 0.0
        elif _gap_mi(ta, tb, K, hi, base, eps) - null[p] <= want:
            lo = hi
        for _ in range(CORR_BISECTIONS if lo < hi else 0):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _gap_mi(ta, tb, K, mid, base, eps) - null[p] < want else (lo, mid)
        corr[p] = 0.5 * (lo + hi)
        got[p] = _gap_mi(ta, tb, K, corr[p], base, eps)
    return corr, {"real_mi_bits": target.round(4).tolist(), "generated_mi_bits": got.round(4).tolist(),
                  "independent_mi_bits": null.round(4).tolist(), "gap_correlation": corr.round(4).tolist(),
                  "layer_pairs": [list(p) for p in counts.layer_pairs], "bisections": CORR_BISECTIONS}


def step_coefficients(counts: RealCounts, corr: np.ndarray, num_layers: int) -> np.ndarray:
    """[L] AR(1) coefficient of the latent's step into each target layer (entry 0 unused: layer 0 starts the
    chain), so that across each measured pair's span of relative depth the latent keeps the pair's fitted
    correlation corr [P]: the n_p target steps whose relative depth l / L lies in (a / L_src, b / L_src]
    each take c_p^(1 / n_p). Steps outside every measured span (deeper than the last measured layer, or in
    an unmeasured gap) take the per-step coefficient of the nearest span: the counts say nothing of them."""
    src = counts.num_layers
    lo = np.array([a for a, _ in counts.layer_pairs], float) / src  # [P] span of each pair in relative depth
    hi = np.array([b for _, b in counts.layer_pairs], float) / src
    depth = np.arange(1, num_layers) / num_layers  # [L - 1] relative depth of the step into layer l
    inside = (depth[:, None] > lo[None] + 1e-12) & (depth[:, None] <= hi[None] + 1e-12)  # [L - 1, P]
    gap = np.maximum(lo[None] - depth[:, None], depth[:, None] - hi[None])  # distance outside each span
    span = np.where(inside.any(axis=1), inside.argmax(axis=1), gap.argmin(axis=1))  # [L - 1]
    n = inside.sum(axis=0)  # [P] target steps inside each span
    per_step = np.where(n > 0, np.maximum(corr, 0.0) ** (1.0 / np.maximum(n, 1)), corr)
    return np.concatenate([[1.0], per_step[span]])


@dataclass(frozen=True)
class CalibratedRouting:
    """Routing drawn by `calibrated_routing`. T tokens, L layers, K slots."""

    topk: np.ndarray  # [T, L, K] int64
    gates: np.ndarray  # [T, L, K] float64
    domain: np.ndarray  # [T] int64 index into domains
    domains: tuple[str, ...]
    info: dict  # calibration facts (source, rho, layer map, fit errors)


class RoutingModel:
    """A fitted generator for one target spec: build once (fits theta and rho), then `draw` token sets."""

    def __init__(self, spec: ModelSpec, counts: RealCounts, seed: int = 0):
        self.spec, self.counts, self.seed = spec, counts, seed
        E, K, L = spec.num_experts, spec.top_k, spec.num_layers
        self.pi = inclusion_rates(counts, E, K)  # [D, M, E]
        self.theta = fit_scores(self.pi, K, seed=seed)
        own = counts.hf_id == spec.hf_id and (E, K) == (counts.num_experts, counts.top_k)
        theta_src = self.theta if own else fit_scores(inclusion_rates(counts, counts.num_experts, counts.top_k),
                                                      counts.top_k, seed=seed)
        self.gap_corr, self.corr_info = fit_gap_correlations(counts, theta_src, seed=seed)
        self.step_rho = step_coefficients(counts, self.gap_corr, L)  # [L] the latent's AR(1) step into layer l
        src_depth = np.array(counts.layers) / counts.num_layers
        self.layer_src = np.abs(np.arange(L)[:, None] / L - src_depth[None]).argmin(axis=1)  # [L] measured index
        rng = np.random.default_rng(seed + 1)
        self.perm = np.stack([rng.permutation(E) for _ in range(L)])  # [L, E] target id of source slot j
        if own:
            for i, layer in enumerate(counts.layers):
                self.perm[layer] = np.arange(E)
                self.layer_src[layer] = i
        self.own = own

    def draw(self, tokens_per_domain: int, seed: int) -> CalibratedRouting:
        """tokens_per_domain tokens of every domain (domain-major order), seeded."""
        spec, D = self.spec, len(self.counts.domains)
        E, K, L = spec.num_experts, spec.top_k, spec.num_layers
        rng = np.random.default_rng(seed)
        T = tokens_per_domain * D
        domain = np.repeat(np.arange(D), tokens_per_domain)
        topk = np.empty((T, L, K), np.int64)
        gates = np.empty((T, L, K), np.float64)
        z = rng.normal(size=(T, E))
        for layer in range(L):
            if layer:
                r = self.step_rho[layer]
                z = r * z + np.sqrt(1.0 - r * r) * rng.normal(size=(T, E))
            s = self.theta[domain, self.layer_src[layer]] + gumbel_of_normal(z)  # [T, E] in source slots
            slots = _topk_of(s, K)
            chosen = np.take_along_axis(s, slots, axis=1)
            if NORMALISES_TOPK.get(spec.family, True):
                w = np.exp(chosen - chosen.max(axis=1, keepdims=True))
                w /= w.sum(axis=1, keepdims=True)
            else:
                full = np.exp(s - s.max(axis=1, keepdims=True))
                w = np.take_along_axis(full / full.sum(axis=1, keepdims=True), slots, axis=1)
            topk[:, layer] = self.perm[layer][slots]
            gates[:, layer] = w
        info = {"source": f"{self.counts.model} ({self.counts.hf_id}) real expert counts",
                "source_layers": list(self.counts.layers), "layer_source": [int(self.counts.layers[i]) for i in self.layer_src],
                "measured_layers_keep_ids": self.own, "step_rho": self.step_rho.round(4).tolist(),
                "gap_fit": self.corr_info,
                "experts_kept": E, "top_k_rescaled_from": self.counts.top_k}
        return CalibratedRouting(topk=topk, gates=gates, domain=domain, domains=self.counts.domains, info=info)


def inclusion_error(routing: CalibratedRouting, model: RoutingModel) -> float:
    """Largest |generated - target| inclusion rate over domains and measured layers (a calibration check)."""
    worst = 0.0
    E = model.spec.num_experts
    for d in range(len(routing.domains)):
        rows = routing.topk[routing.domain == d]
        for layer in range(model.spec.num_layers):
            i = model.layer_src[layer]
            got = np.bincount(rows[:, layer].ravel(), minlength=E) / max(len(rows), 1)
            want = model.pi[d, i][np.argsort(model.perm[layer])]
            worst = max(worst, float(np.abs(got - want).max()))
    return worst
