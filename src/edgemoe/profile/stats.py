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

    topk: [T, L, K]. Returns coact [L, E, E], symmetric: off-diagonal (e, e') counts tokens that chose
    both e and e' at that layer; the diagonal counts tokens that chose e.
    """
    onehot = _onehot_sets(topk, num_experts)  # [T, L, E]
    return np.einsum("tle,tlf->lef", onehot, onehot, optimize=True)


def transitions(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """Expert transition probabilities between consecutive MoE layers of the same token.

    topk: [T, L, K]. Returns trans [L-1, E, E] with trans[l, e, e'] = P(e' at layer l+1 | e at l).
    With K > 1 every one of the K x K (e, e') pairs of a token counts once (unweighted), so a row is the
    distribution of one uniformly chosen next-layer expert. Rows of experts never seen are all zero.
    """
    onehot = _onehot_sets(topk, num_experts)
    counts = np.einsum("tle,tlf->lef", onehot[:, :-1], onehot[:, 1:], optimize=True)
    totals = counts.sum(axis=2, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


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
    diagonal. Built from K x K slot pairs with np.add.at, so memory is O(T K^2), not O(T E).
    """
    T, L, K = topk.shape
    ids = np.asarray(topk, dtype=np.int64)
    g = np.abs(np.asarray(gates, dtype=np.float64))
    gram = np.zeros((L, num_experts, num_experts))
    layer = np.broadcast_to(np.arange(L)[None, :, None, None], (T, L, K, K))
    np.add.at(gram, (layer, ids[:, :, :, None].repeat(K, 3), ids[:, :, None, :].repeat(K, 2)),
              g[:, :, :, None] * g[:, :, None, :])
    norms = np.sqrt(np.diagonal(gram, axis1=1, axis2=2))  # [L, E]
    den = norms[:, :, None] * norms[:, None, :]
    sim = np.divide(gram, den, out=np.zeros_like(gram), where=den > 0)
    sim = np.clip(0.5 * (sim + sim.transpose(0, 2, 1)), 0.0, 1.0)
    sim[:, np.arange(num_experts), np.arange(num_experts)] = 1.0
    return sim


def _onehot_sets(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, L, K] ids -> [T, L, E] float indicator of each token's Top-K set."""
    T, L, K = topk.shape
    onehot = np.zeros((T, L, num_experts), dtype=np.float64)
    t = np.arange(T)[:, None, None]
    l_ = np.arange(L)[None, :, None]
    onehot[np.broadcast_to(t, topk.shape), np.broadcast_to(l_, topk.shape), topk.astype(np.int64)] = 1.0
    return onehot
