"""Per-layer subset values of one cache node's subproblem (ALGORITHMS.md §2.5.2–2.5.3).

For a node n and layer l, with every other cache fixed, caching the subset S of layer-l experts on n
saves g(S) = sum_u w_u sum_A P_u(A) [max_{e in A} tau_ue - max_{e in A} tau'_ue(S)] seconds per token,
where tau' = min(tau, t_n) on S. A set A only sees which of its K members are in S, so g is tabulated
once per set and per K-bit membership mask: G [M, 2^K]. Then g(S) = sum_m G[m, mask(S, A_m)].

`value_table` turns this into V(c) = best g(S) with size(S) <= c for c = 0..C, either by enumerating
every subset of the useful experts (exact; when there are at most `enum_max` of them) or, for large E,
by a beam search that grows subsets one expert at a time (an extension, not from the paper).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SetGains:
    """Gains of one (node, layer) subproblem. M useful sets, K positions, c useful experts."""

    gain: np.ndarray  # [M, 2^K] seconds saved per token when the masked members of set m are on the node
    cand_pos: np.ndarray  # [M, K] index into `candidates` of each member, -1 if not a candidate
    candidates: np.ndarray  # [c] expert ids the node could usefully cache at this layer


def set_gains(tau: np.ndarray, call: np.ndarray, prob: np.ndarray, weight: np.ndarray, sets: np.ndarray) -> SetGains:
    """Tabulate G for one layer.

    tau: [U, E] current seconds per expert call (other caches fixed); call: [U, E] seconds on this node
    (inf where a user may not use it); prob: [U, M] set probabilities; weight: [U]; sets: [M, K]
    expert ids (E = no expert).
    """
    U, E = tau.shape
    K = sets.shape[1]
    pad = np.zeros((U, 1))
    cur = np.concatenate([tau, pad], axis=1)[:, sets]  # [U, M, K]
    new = np.minimum(cur, np.concatenate([call, pad], axis=1)[:, sets])
    helps = (new < cur) & (prob[:, :, None] * weight[:, None, None] > 0)  # [U, M, K]
    useful_pos = helps.any(axis=0)  # [M, K]
    useful_sets = np.flatnonzero(useful_pos.any(axis=1))
    if useful_sets.size == 0:
        return SetGains(np.zeros((0, 2**K)), np.zeros((0, K), np.int64), np.zeros(0, np.int64))
    cur, new = cur[:, useful_sets], new[:, useful_sets]
    mass = prob[:, useful_sets] * weight[:, None]  # [U, M']
    base = cur.max(axis=2)
    gain = np.empty((useful_sets.size, 2**K))
    bits = (np.arange(2**K)[:, None] >> np.arange(K)[None]) & 1  # [2^K, K]
    for mask in range(2**K):
        served = np.where(bits[mask].astype(bool), new, cur).max(axis=2)  # [U, M']
        gain[:, mask] = (mass * (base - served)).sum(axis=0)
    members = sets[useful_sets]
    candidates = np.unique(members[useful_pos[useful_sets]])
    lookup = np.full(E + 1, -1, dtype=np.int64)
    lookup[candidates] = np.arange(candidates.size)
    cand_pos = np.where(useful_pos[useful_sets], lookup[members], -1)
    return SetGains(gain=gain, cand_pos=cand_pos, candidates=candidates)


def subset_value(g: SetGains, chosen: np.ndarray) -> float:
    """g(S) for S = candidates[chosen] (chosen: [c] bool)."""
    if g.gain.shape[0] == 0:
        return 0.0
    inside = np.where(g.cand_pos >= 0, chosen[np.maximum(g.cand_pos, 0)], False)  # [M, K]
    mask = (inside.astype(np.int64) << np.arange(inside.shape[1])).sum(axis=1)
    return float(g.gain[np.arange(mask.size), mask].sum())


def value_table(g: SetGains, units: np.ndarray, capacity: int, enum_max: int = 12,
                beam_width: int = 8) -> tuple[np.ndarray, np.ndarray, bool]:
    """V [C+1] (best value with size <= c) and the subsets attaining it [C+1, c] bool over g.candidates.

    units: [c] size of each candidate in capacity units. The third value says whether the table is exact
    (subset enumeration) or from the beam search.
    """
    n = g.candidates.size
    if n == 0 or capacity == 0:
        return np.zeros(capacity + 1), np.zeros((capacity + 1, n), bool), True
    if n <= enum_max:
        return (*_enumerate(g, units, capacity), True)
    return (*_beam(g, units, capacity, beam_width), False)


def _best_by_size(values: np.ndarray, sizes: np.ndarray, subsets: np.ndarray, capacity: int):
    """Cumulative best over size <= c. values, sizes: [P]; subsets: [P, c] bool. Returns ([C+1], [C+1, c])."""
    fits = sizes <= capacity
    values, sizes, subsets = values[fits], sizes[fits], subsets[fits]
    table = np.zeros(capacity + 1)
    pick = np.zeros((capacity + 1, subsets.shape[1]), bool)
    order = np.lexsort((-values, sizes))  # by size, best first within a size
    first = order[np.concatenate([[True], np.diff(sizes[order]) != 0])]
    exact = np.full(capacity + 1, -1, dtype=np.int64)
    exact[sizes[first]] = first
    best_val, best_idx = 0.0, -1
    for c in range(capacity + 1):
        i = exact[c]
        if i >= 0 and values[i] > best_val + 1e-18:
            best_val, best_idx = values[i], i
        table[c] = best_val
        if best_idx >= 0:
            pick[c] = subsets[best_idx]
    return table, pick


def _enumerate(g: SetGains, units: np.ndarray, capacity: int, chunk: int = 4096):
    """Exact: every subset of the candidates, evaluated in chunks of subset ids."""
    n = g.candidates.size
    K = g.cand_pos.shape[1]
    ids = np.arange(2**n, dtype=np.int64)
    member = ((ids[:, None] >> np.arange(n)[None]) & 1).astype(bool)  # [2^n, n]
    sizes = member @ units.astype(np.int64)
    values = np.zeros(ids.size)
    pos = np.maximum(g.cand_pos, 0)  # [M, K]
    valid = g.cand_pos >= 0
    rows = np.arange(g.gain.shape[0])[:, None]
    for start in range(0, ids.size, chunk):
        sub = ids[start:start + chunk]
        bit = ((sub[None, None, :] >> pos[:, :, None]) & 1) & valid[:, :, None]  # [M, K, B]
        mask = (bit << np.arange(K)[None, :, None]).sum(axis=1)  # [M, B]
        values[start:start + chunk] = g.gain[rows, mask].sum(axis=0)
    return _best_by_size(values, sizes, member, capacity)


def _beam(g: SetGains, units: np.ndarray, capacity: int, width: int):
    """Beam search: grow subsets one candidate at a time, keep the `width` best distinct subsets.

    The gain of adding candidate x to a subset only involves the sets containing x; each beam member
    carries its membership mask per set, so one step costs O(width * M * K).
    """
    n = g.candidates.size
    M, K = g.cand_pos.shape
    flat_set, flat_k = np.nonzero(g.cand_pos >= 0)
    flat_cand = g.cand_pos[flat_set, flat_k]
    masks = np.zeros((1, M), dtype=np.int64)
    chosen = np.zeros((1, n), bool)
    value = np.zeros(1)
    size = np.zeros(1, dtype=np.int64)
    seen_v, seen_s, seen_sub = [0.0], [0], [np.zeros(n, bool)]
    units = units.astype(np.int64)
    while True:
        B = masks.shape[0]
        old = g.gain[flat_set[None], masks[:, flat_set]]  # [B, P]
        new = g.gain[flat_set[None], masks[:, flat_set] | (1 << flat_k)[None]]
        delta = np.bincount((np.arange(B)[:, None] * n + flat_cand[None]).ravel(), weights=(new - old).ravel(),
                            minlength=B * n).reshape(B, n)
        allowed = ~chosen & (size[:, None] + units[None] <= capacity)
        if not allowed.any():
            break
        score = np.where(allowed, value[:, None] + delta, -np.inf)
        order = np.argsort(-score, axis=None)
        keep, keys = [], set()
        for flat in order:
            b, x = divmod(int(flat), n)
            if not np.isfinite(score[b, x]):
                break
            sub = chosen[b].copy()
            sub[x] = True
            key = sub.tobytes()
            if key not in keys:
                keys.add(key)
                keep.append((b, x, sub))
            if len(keep) == width:
                break
        b_idx = np.array([k[0] for k in keep])
        x_idx = np.array([k[1] for k in keep])
        chosen = np.stack([k[2] for k in keep])
        value = score[b_idx, x_idx]
        size = size[b_idx] + units[x_idx]
        add = np.zeros((len(keep), M), dtype=np.int64)
        hit = flat_cand[None] == x_idx[:, None]  # [B', P]
        np.add.at(add, (np.nonzero(hit)[0], flat_set[np.nonzero(hit)[1]]), 1 << flat_k[np.nonzero(hit)[1]])
        masks = masks[b_idx] | add
        seen_v.extend(value.tolist())
        seen_s.extend(size.tolist())
        seen_sub.extend(chosen)
    return _best_by_size(np.array(seen_v), np.array(seen_s), np.stack(seen_sub), capacity)
