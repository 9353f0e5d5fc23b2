"""Routing statistics derived from a router sample (pure numpy, no torch).

Every function takes the calibration sample in the shapes of ARCHITECTURE.md:
`router_logits [T, L, E]`, `topk [T, L, K]` (expert ids), `gates [T, L, K]`.
"""

from __future__ import annotations

import numpy as np


def activation_frequency(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Mean activations per token of each expert.

    topk: [T, L, K] expert ids. Returns freq [L, E]; each layer's row sums to K, since every token
    activates K experts per layer.
    """
    T, L, K = topk.shape
    counts = np.zeros((L, num_experts), dtype=np.float64)
    layer_idx = np.broadcast_to(np.arange(L)[None, :, None], topk.shape)
    np.add.at(counts, (layer_idx.ravel(), topk.ravel().astype(np.int64)), 1.0)
    return counts / max(T, 1)


def frequency_by_domain(topk: np.ndarray, domain: np.ndarray, num_domains: int, num_experts: int) -> np.ndarray:
    """Activation frequency per domain (user class).

    topk: [T, L, K]; domain: [T] ids in [0, U). Returns [U, L, E]; rows of domains with no token are 0.
    """
    return np.stack(
        [activation_frequency(topk[domain == u], num_experts) for u in range(num_domains)]
    ) if num_domains else np.zeros((0, topk.shape[1], num_experts))


def coactivation(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Co-activation counts within a layer.

    topk: [T, L, K] with distinct ids per token and layer. Returns coact [L, E, E], symmetric: off-diagonal
    (e, e') counts tokens that chose both e and e' at that layer; the diagonal counts tokens that chose e.
    Counted over the K x K slot pairs of each token (np.bincount per layer), so memory is O(T K^2), not the
    O(T L E) of one-hot sets: a 50k-token trace of a 128-expert model stays small.
    """
    ids = np.asarray(topk, dtype=np.int64)
    return np.stack([_pair_counts(ids[:, layer], ids[:, layer], num_experts) for layer in range(ids.shape[1])]) \
        if ids.shape[1] else np.zeros((0, num_experts, num_experts))


def transitions(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Expert transition probabilities between consecutive MoE layers of the same token.

    topk: [T, L, K] with distinct ids per token and layer. Returns trans [L-1, E, E] with trans[l, e, e'] =
    P(e' at layer l+1 | e at l). With K > 1 every one of the K x K (e, e') pairs of a token counts once
    (unweighted), so a row is the distribution of one uniformly chosen next-layer expert. Rows of experts
    never seen are all zero.
    """
    ids = np.asarray(topk, dtype=np.int64)
    L = ids.shape[1]
    counts = np.stack([_pair_counts(ids[:, layer], ids[:, layer + 1], num_experts) for layer in range(L - 1)]) \
        if L > 1 else np.zeros((0, num_experts, num_experts))
    totals = counts.sum(axis=2, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


def _pair_counts(a: np.ndarray, b: np.ndarray, num_experts: int, weights: np.ndarray | None = None) -> np.ndarray:
    """[E, E] sum over tokens and slot pairs (i, j) of weights[t, i, j] at (a[t, i], b[t, j]); a, b: [T, K]."""
    E = num_experts
    flat = (a[:, :, None] * E + b[:, None, :]).ravel()
    w = None if weights is None else weights.ravel()
    return np.bincount(flat, weights=w, minlength=E * E).astype(np.float64).reshape(E, E)


def router_similarity(router_logits: np.ndarray) -> np.ndarray:
    """Cosine similarity of router-logit columns (OrderMoE's expert similarity).

    router_logits: [T, L, E]. Column e of layer l is the vector of e's logits over the T calibration
    tokens; sim [L, E, E] is their cosine, symmetric with a unit diagonal (an all-zero column is
    similar to nothing but itself).
    """
    x = np.asarray(router_logits, dtype=np.float64).transpose(1, 2, 0)  # [L, E, T]
    norms = np.linalg.norm(x, axis=2)  # [L, E]
    unit = np.divide(x, norms[..., None], out=np.zeros_like(x), where=norms[..., None] > 0)
    sim = np.clip(unit @ unit.transpose(0, 2, 1), -1.0, 1.0)
    E = sim.shape[1]
    sim[:, np.arange(E), np.arange(E)] = 1.0
    return 0.5 * (sim + sim.transpose(0, 2, 1))


def coselection_similarity(topk: np.ndarray, gates: np.ndarray, num_experts: int) -> np.ndarray:
    """Expert similarity from routing alone (no router logits): cosine of gate-weighted selection columns.

    topk, gates: [T, L, K]. Column e of layer l holds, for each token, the gate it gave e (0 when e was not
    chosen), so two experts are similar when the router picks them for the same tokens with similar weight;
    it lies in [0, 1] (never negative, unlike the logit cosine). Returns sim [L, E, E], symmetric, unit
    diagonal. Built from the K x K slot pairs of each token, layer by layer (O(T K^2) memory).
    """
    ids = np.asarray(topk, dtype=np.int64)
    g = np.abs(np.asarray(gates, dtype=np.float64))
    gram = np.stack([_pair_counts(ids[:, layer], ids[:, layer], num_experts, g[:, layer, :, None] * g[:, layer, None, :])
                     for layer in range(ids.shape[1])])
    norms = np.sqrt(np.diagonal(gram, axis1=1, axis2=2))  # [L, E]
    den = norms[:, :, None] * norms[:, None, :]
    sim = np.divide(gram, den, out=np.zeros_like(gram), where=den > 0)
    sim = np.clip(0.5 * (sim + sim.transpose(0, 2, 1)), 0.0, 1.0)
    sim[:, np.arange(num_experts), np.arange(num_experts)] = 1.0
    return sim
