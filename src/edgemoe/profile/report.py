"""Does the router specialise? Per-domain expert usage and similarity structure by depth.

Pure numpy statistics plus matplotlib figures, computed from a Profile.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgemoe.io import atomic_write_figure, atomic_write_json
from edgemoe.results import environment

from .store import Profile


def domain_mutual_information(topk: np.ndarray, domain: np.ndarray, num_experts: int) -> np.ndarray:
    """Mutual information (bits) between a token's domain and one of its routed experts, per layer.

    topk: [T, L, K]; domain: [T]. Returns [L]. 0 means routing ignores the domain.
    """
    T, L, K = topk.shape
    U = int(domain.max()) + 1
    joint = np.zeros((L, U, num_experts))
    for k in range(K):
        np.add.at(joint, (np.arange(L)[None, :].repeat(T, 0), domain[:, None].repeat(L, 1), topk[:, :, k]), 1.0)
    joint /= joint.sum(axis=(1, 2), keepdims=True)
    pu, pe = joint.sum(2, keepdims=True), joint.sum(1, keepdims=True)
    ratio = np.divide(joint, pu * pe, out=np.ones_like(joint), where=joint > 0)
    return (joint * np.log2(ratio)).sum(axis=(1, 2))


def similarity_by_depth(sim: np.ndarray, thresholds=(0.3, 0.5, 0.7)) -> dict:
    """Mean off-diagonal router-logit cosine per layer and the share of expert pairs above each threshold."""
    L, E, _ = sim.shape
    off = sim[:, ~np.eye(E, dtype=bool)].reshape(L, -1)
    return {
        "mean_offdiag_cosine": off.mean(1).round(4).tolist(),
        "share_of_pairs_above": {str(t): (off > t).mean(1).round(4).tolist() for t in thresholds},
    }


def grouping_report(profile: Profile) -> dict:
    """`edgemoe.profile.groups.grouping_report` (imported here so the profile package does not need plan/ to load)."""
    from edgemoe.profile.groups import grouping_report as report

    return report(profile)


def specialisation_report(profile: Profile, out_dir: str | Path, seed: int = 0) -> dict:
    """Write specialisation.json, usage_heatmaps.png and similarity.png under `out_dir`; return the JSON."""
    out_dir = Path(out_dir)
    E = profile.E
    domain = profile.domain.astype(np.int64)
    mi = domain_mutual_information(profile.topk.astype(np.int64), domain, E)
    shuffled = np.random.default_rng(seed).permutation(domain)
    mi_null = domain_mutual_information(profile.topk.astype(np.int64), shuffled, E)
    freq_u = profile.freq_by_domain
    usage_entropy = -(np.where(profile.freq > 0, profile.freq / profile.K * np.log2(profile.freq / profile.K + 1e-30), 0)).sum(1)
    report = {
        "model": profile.meta.model,
        "data": profile.meta.data,
        "num_tokens": profile.num_tokens,
        "domains": profile.meta.domains,
        "what": "Router specialisation: per-domain expert usage per layer, domain-expert mutual information "
                "against a shuffled-domain null, router-logit similarity by depth, and how well that similarity "
                "predicts measured substitution error (Spearman) with the traffic share groups cover",
        "domain_expert_mutual_information_bits": mi.round(4).tolist(),
        "shuffled_domain_mutual_information_bits": mi_null.round(4).tolist(),
        "usage_entropy_bits": usage_entropy.round(3).tolist(),
        "max_usage_entropy_bits": float(np.log2(E)),
        "top_expert_per_domain": {d: [int(np.argmax(freq_u[u, layer])) for layer in range(profile.L)]
                                  for u, d in enumerate(profile.meta.domains)},
        "freq_by_domain": freq_u.round(4).tolist(),
        "similarity": similarity_by_depth(profile.sim),
        # OrderMoE's groups: does router cosine predict measured substitution error, and how much traffic
        # gets a stand-in (router-cosine groups vs groups from measured error)
        "substitution": grouping_report(profile),
        "environment": environment(),  # commit, load and CPU s of the run, as every results file records them
    }
    atomic_write_json(out_dir / "specialisation.json", report)
    _plot_usage(profile, out_dir / "usage_heatmaps.png")
    _plot_similarity(profile, out_dir / "similarity.png")
    return report


def _plot_usage(profile: Profile, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = profile.L
    fig, axes = plt.subplots(1, L, figsize=(3.2 * L, 2.6), squeeze=False)
    for layer, ax in enumerate(axes[0]):
        im = ax.imshow(profile.freq_by_domain[:, layer], aspect="auto", cmap="viridis")
        ax.set_title(f"MoE layer {layer}")
        ax.set_xlabel("expert")
        ax.set_yticks(range(len(profile.meta.domains)), profile.meta.domains if layer == 0 else [""] * len(profile.meta.domains))
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle("activations per token by domain")
    fig.tight_layout()
    atomic_write_figure(fig, path)


def _plot_similarity(profile: Profile, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = profile.L
    fig, axes = plt.subplots(1, L + 1, figsize=(3.0 * (L + 1), 2.8), squeeze=False)
    for layer in range(L):
        ax = axes[0][layer]
        im = ax.imshow(profile.sim[layer], vmin=-1, vmax=1, cmap="RdBu_r")
        ax.set_title(f"cosine, layer {layer}")
    fig.colorbar(im, ax=axes[0][L - 1], fraction=0.046)
    stats = similarity_by_depth(profile.sim)
    ax = axes[0][L]
    ax.plot(range(L), stats["mean_offdiag_cosine"], marker="o", label="mean off-diagonal")
    for t, share in stats["share_of_pairs_above"].items():
        ax.plot(range(L), share, marker=".", label=f"share > {t}")
    ax.set_xlabel("MoE layer")
    ax.set_title("similarity by depth")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_figure(fig, path)
