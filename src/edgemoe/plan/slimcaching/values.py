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

import math
from dataclasses import dataclass

import numpy as np

from edgemoe.jit import HAVE_NUMBA, njit


def capacity_grid(expert_bytes: np.ndarray, capacity_bytes: int, max_units: int) -> tuple[int, int, np.ndarray]:
    """(unit bytes, C, units [L, E]): the node's capacity and each expert's size in one discrete unit.

    The unit is the gcd of all expert sizes (one slot when they are equal). The capacity counted is at most
    the bytes of all experts. With unequal sizes, if that gives more than `max_units` units, the unit grows
    to ceil(capacity / max_units) and sizes round up, which keeps every DP solution feasible (it may waste
    up to one unit per expert); with equal sizes the unit stays one expert.
    """
    sizes = np.asarray(expert_bytes, dtype=np.int64)
    unit = int(np.gcd.reduce(sizes.ravel())) if sizes.size else 1
    unit = max(unit, 1)
    # A node never needs room for more than every expert: beyond that the DP's extra budgets are waste.
    capacity_bytes = min(int(capacity_bytes), int(sizes.sum()))
    equal = sizes.size == 0 or sizes.min() == sizes.max()
    # With equal sizes the unit stays one expert (C <= L x E slots): coarsening it would round each expert
    # up to a unit larger than itself (testbed8's 48 GB Orin held 1,024 of Qwen's 1,440 17.3 MB experts,
    # though the whole model fits) and the compiled DP handles C in the thousands.
    if capacity_bytes // unit > max_units and not equal:
        unit = math.ceil(capacity_bytes / max_units)
    units = -(-sizes // unit)
    return unit, int(capacity_bytes // unit), units


def capacity_units(expert_bytes: np.ndarray, capacity_bytes: int, max_units: int) -> tuple[int, np.ndarray]:
    """(C, units [L, E]) of `capacity_grid` (without the unit)."""
    return capacity_grid(expert_bytes, capacity_bytes, max_units)[1:]


def free_units(capacity_bytes: int, used_bytes: int, unit: int) -> int:
    """Units left for the DP once `used_bytes` are taken (fixed copies): whole units of the free bytes.

    Counted in bytes, not as C minus the fixed copies' rounded-up units: those copies were placed by byte
    (coverage repair), so their rounded sizes may exceed C. Any choice within the result fits in bytes,
    since every expert's rounded size is at least its true size.
    """
    return max(int(capacity_bytes) - int(used_bytes), 0) // int(unit)


@dataclass(frozen=True)
class SetGains:
    """Gains of one (node, layer) subproblem. M useful sets, K positions, c useful experts."""

    gain: np.ndarray  # [M, 2^K] seconds saved per token when the masked members of set m are on the node
    cand_pos: np.ndarray  # [M, K] index into `candidates` of each member, -1 if not a candidate
    candidates: np.ndarray  # [c] expert ids the node could usefully cache at this layer


def gain_pairs(prob: np.ndarray, weight: np.ndarray, sets: np.ndarray, E: int) -> tuple:
    """The (user, set) pairs with positive mass of one layer, for `set_gains`: (pu [P] user, pm [P] set,
    flat [P, K] index of each member's cell in a [U, E+1] table, mass [P] weight x probability, mass_all
    [U, M]). They depend on the users and the layer only, so a decomposition re-solving the same block in
    several passes computes them once."""
    mass_all = prob * weight[:, None]
    pu, pm = np.nonzero(mass_all > 0)  # [P]
    flat = pu[:, None] * (E + 1) + sets[pm]
    return pu, pm, flat, mass_all[pu, pm], mass_all


def set_gains(tau: np.ndarray, call: np.ndarray, prob: np.ndarray, weight: np.ndarray, sets: np.ndarray,
              cur_charge: np.ndarray | None = None, new_charge: np.ndarray | None = None,
              pairs: tuple | None = None) -> SetGains:
    """Tabulate G for one layer.

    tau: [U, E] current seconds per expert call (other caches fixed); call: [U, E] seconds on this node
    (inf where a user may not use it); prob: [U, M] set probabilities; weight: [U]; sets: [M, K]
    expert ids (E = no expert). cur_charge, new_charge: [U, E] remote-call charge of each call now / when
    this node serves it (objective.charged_model); the charge is summed over a set's calls, so its part of
    G is additive in the mask (None: the paper's objective). A copy is credited with the charges it removes
    but not debited with those it attracts (a call moving to a faster, busier node): debits make G negative
    for single experts, and the beam, which grows subsets from their singletons, then stops at the empty
    set (a saturated A100 then cached only a small part of the model). The refinement's accept test and the reported
    `charged_objective_s` count the charge in full. pairs: `gain_pairs(prob, weight, sets, E)` if already
    computed (the same values; None: computed here).
    """
    U, E = tau.shape
    M, K = sets.shape
    # Only (user, set) pairs with positive mass matter: a user's domain picks a fraction of the sets
    # (about a third with three domains), so work on that sparse list of pairs, not the dense [U, M].
    pu, pm, flat, mass_p, mass_all = gain_pairs(prob, weight, sets, E) if pairs is None else pairs
    cur = np.concatenate([tau, np.zeros((U, 1))], axis=1).ravel()[flat]  # [P, K]
    new = np.minimum(cur, np.concatenate([call, np.zeros((U, 1))], axis=1).ravel()[flat])
    helps = new < cur  # [P, K]
    useful_pos = np.zeros((M, K), bool)
    hit_p, hit_k = np.nonzero(helps)
    useful_pos[pm[hit_p], hit_k] = True
    useful_sets = np.flatnonzero(useful_pos.any(axis=1))
    if useful_sets.size == 0:
        return SetGains(np.zeros((0, 2**K)), np.zeros((0, K), np.int64), np.zeros(0, np.int64))
    row_of = np.full(M, -1, dtype=np.int64)
    row_of[useful_sets] = np.arange(useful_sets.size)
    keep = row_of[pm] >= 0
    gain = None
    if cur_charge is not None:
        pad = np.zeros((U, 1))
        c_cur = np.concatenate([cur_charge, pad], axis=1)[pu[keep][:, None], sets[pm[keep]]]  # [P', K]
        c_new = np.concatenate([new_charge, pad], axis=1)[pu[keep][:, None], sets[pm[keep]]]
        drop = np.where(helps[keep], np.maximum(c_cur - c_new, 0.0), 0.0) * mass_all[pu[keep], pm[keep]][:, None]  # [P', K]
        per_slot = np.zeros((useful_sets.size, K))
        np.add.at(per_slot, row_of[pm[keep]], drop)
        bits = (np.arange(2**K)[None, :] >> np.arange(K)[:, None]) & 1  # [K, 2^K]
        gain = per_slot @ bits
    cur, new, row, mass = cur[keep], new[keep], row_of[pm[keep]], mass_p[keep]
    latency_gain = (_gain_table if HAVE_NUMBA else _gain_table_numpy)(cur, new, row, mass, useful_sets.size)
    gain = latency_gain if gain is None else latency_gain + gain
    members = sets[useful_sets]
    candidates = np.unique(members[useful_pos[useful_sets]])
    lookup = np.full(E + 1, -1, dtype=np.int64)
    lookup[candidates] = np.arange(candidates.size)
    cand_pos = np.where(useful_pos[useful_sets], lookup[members], -1)
    return SetGains(gain=gain, cand_pos=cand_pos, candidates=candidates)


def _gain_table_numpy(cur: np.ndarray, new: np.ndarray, row: np.ndarray, mass: np.ndarray, rows: int) -> np.ndarray:
    """G [rows, 2^K] from the (user, set) pairs: cur, new [P, K] call times without / with the node,
    row [P] the pair's set row, mass [P] its weight x probability."""
    K = cur.shape[1]
    # served(mask) = max(max of `new` over the members in mask, max of `cur` over the others). Both maxima
    # are built for every mask from the mask without its lowest bit: one [P] maximum per mask.
    in_mask = np.zeros((2**K, cur.shape[0]))  # call times are >= 0, so 0 is the max of an empty set
    out_mask = np.zeros((2**K, cur.shape[0]))
    for mask in range(1, 2**K):
        low = (mask & -mask).bit_length() - 1
        in_mask[mask] = np.maximum(in_mask[mask & (mask - 1)], new[:, low])
    full = 2**K - 1
    for mask in range(full - 1, -1, -1):  # out_mask[mask] = max of cur over the members NOT in mask
        low = ((full & ~mask) & -(full & ~mask)).bit_length() - 1
        out_mask[mask] = np.maximum(out_mask[mask | (1 << low)], cur[:, low])
    saved = (out_mask[0][None] - np.maximum(in_mask, out_mask)) * mass[None]  # [2^K, P]
    idx = row[None, :] * 2**K + np.arange(2**K)[:, None]
    gain = np.bincount(idx.ravel(), weights=saved.ravel(), minlength=rows * 2**K)
    return gain.reshape(rows, 2**K)


@njit(cache=True)
def _gain_table(cur, new, row, mass, rows):  # pragma: no cover - compiled; tested against the numpy one
    """`_gain_table_numpy` compiled: per pair, the same maxima and products, summed per cell in pair order."""
    P, K = cur.shape
    F = 1 << K
    gain = np.zeros((rows, F))
    in_mask = np.zeros(F)
    out_mask = np.zeros(F)
    for p in range(P):
        for mask in range(1, F):
            low = 0
            while not (mask >> low) & 1:
                low += 1
            in_mask[mask] = max(in_mask[mask & (mask - 1)], new[p, low])
        for mask in range(F - 2, -1, -1):
            low = 0
            while (mask >> low) & 1:
                low += 1
            out_mask[mask] = max(out_mask[mask | (1 << low)], cur[p, low])
        for mask in range(F):
            gain[row[p], mask] += (out_mask[0] - max(in_mask[mask], out_mask[mask])) * mass[p]
    return gain


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
    singles = modular_values(g)
    if singles is not None:
        return (*_modular_table(singles, units, capacity), True)
    if n <= enum_max:
        return (*_enumerate(g, units, capacity), True)
    return (*_beam(g, units, capacity, beam_width), False)


def modular_values(g: SetGains, rel_tol: float = 1e-12) -> np.ndarray | None:
    """[c] each candidate's value alone if g is modular (no set's saving depends on which other members
    are cached: K = 1, or sets with one useful member), else None.

    g(S) = m(S) + h(S) with m the sum of singleton values and h >= 0 the supermodular interaction; the
    layer table needs no subset search exactly when h = 0.
    """
    M, K = g.cand_pos.shape
    masks = np.arange(2**K)
    bits = (masks[:, None] >> np.arange(K)[None]) & 1  # [2^K, K]
    single = g.gain[:, 1 << np.arange(K)]  # [M, K] value of each member alone
    additive = single @ bits.T  # [M, 2^K]
    scale = max(float(np.abs(g.gain).max(initial=0.0)), 1e-300)
    if np.abs(g.gain - additive).max(initial=0.0) > rel_tol * scale:
        return None
    valid = g.cand_pos >= 0
    return np.bincount(g.cand_pos[valid], weights=single[valid], minlength=g.candidates.size)


def _modular_table(values: np.ndarray, units: np.ndarray, capacity: int):
    """Exact V(c) for a modular g: a 0/1 knapsack by DP over candidates, O(c x C) (sorted prefix sums
    when sizes are equal, which is what the DP then computes). Returns ([C+1], [C+1, c])."""
    n = values.size
    units = units.astype(np.int64)
    best = np.zeros(capacity + 1)
    take = np.zeros((n, capacity + 1), bool)
    for x in range(n):
        if values[x] <= 0 or units[x] > capacity:
            continue
        shifted = np.full(capacity + 1, -np.inf)
        shifted[units[x]:] = best[: capacity + 1 - units[x]] + values[x]
        take[x] = shifted > best + 1e-18
        best = np.maximum(best, shifted)
    pick = np.zeros((capacity + 1, n), bool)
    room = np.arange(capacity + 1)  # backtrack every budget at once
    for x in range(n - 1, -1, -1):
        pick[:, x] = take[x, room]
        room = room - np.where(pick[:, x], units[x], 0)
    return best, pick


def _best_by_size(values: np.ndarray, sizes: np.ndarray, subsets: np.ndarray, capacity: int):
    """Cumulative best over size <= c. values, sizes: [P]; subsets: [P, c] bool. Returns ([C+1], [C+1, c])."""
    fits = sizes <= capacity
    values, sizes, subsets = values[fits], sizes[fits], subsets[fits]
    order = np.lexsort((-values, sizes))  # by size, best first within a size
    first = order[np.concatenate([[True], np.diff(sizes[order]) != 0])]
    exact = np.full(capacity + 1, -1, dtype=np.int64)
    exact[sizes[first]] = first
    cand = np.where(exact >= 0, values[np.maximum(exact, 0)], 0.0)
    cand = np.where(cand > 1e-18, cand, 0.0)  # the empty set (value 0) wins non-positive values
    table = np.maximum.accumulate(cand)
    improved = cand > np.concatenate([[0.0], table[:-1]])  # a strictly better subset first appears at c
    src = np.maximum.accumulate(np.where(improved, np.arange(capacity + 1), 0))
    idx = np.where(table > 0, exact[src], -1)
    pick = np.zeros((capacity + 1, subsets.shape[1]), bool)
    rows = idx >= 0
    pick[rows] = subsets[idx[rows]]
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


def _first_distinct(words: np.ndarray, limit: int) -> np.ndarray:
    """Indices of the first `limit` rows of words [R, W] whose row has not occurred earlier."""
    if words.shape[1] == 1:
        _, first = np.unique(words[:, 0], return_index=True)
    else:
        _, first = np.unique(words, axis=0, return_index=True)
    return np.sort(first)[:limit]


@dataclass(frozen=True)
class _BeamIndex:
    """Where each candidate x sits in the sets (CSR by x), for the beam's incremental deltas.

    n candidates, M useful sets, K positions; gains are read flat at set << K | mask.
    """

    gain: np.ndarray  # [M * 2^K] g.gain flattened
    nb_ptr: np.ndarray  # [n + 1] rows of x in `nb`
    nb: np.ndarray  # [4, T] every other position q of each set holding x: q's set << K, q's bit, q's candidate, x's bit
    own_ptr: np.ndarray  # [n + 1] rows of x in `own`
    own: np.ndarray  # [2, P] x's own positions: set index, x's bit there
    delta: np.ndarray  # [n] gain of adding each candidate to the empty set
    mask_dtype: np.dtype  # smallest unsigned type holding a K-bit membership mask


def _beam_index(g: SetGains) -> _BeamIndex:
    n = g.candidates.size
    M, K = g.cand_pos.shape
    flat_set, flat_k = np.nonzero(g.cand_pos >= 0)  # [P] positions, sorted by set
    flat_cand = g.cand_pos[flat_set, flat_k]
    flat_bit = (1 << flat_k).astype(np.int64)
    # x's positions grouped by x (CSR), each group by set; keys fit 16 bits, so the stable sort is a radix sort.
    own_order = np.argsort(flat_cand.astype(np.int16 if n < 2**15 else np.int64), kind="stable")
    own_ptr = np.concatenate([[0], np.cumsum(np.bincount(flat_cand, minlength=n))]).astype(np.int64)
    # Neighbours of x: for each of x's positions, every other position q of that set (in position order),
    # with x's bit, so that a step gathers each child's rows with one slice. x's own positions are left
    # out: once x is chosen its delta is never read again.
    first = np.searchsorted(flat_set, np.arange(M))  # first position of each set
    count = np.bincount(flat_set, minlength=M)
    owner_sets = flat_set[own_order]
    reps = count[owner_sets]
    nb_owner = np.repeat(own_order, reps)  # position of x
    nb_q = np.repeat(first[owner_sets] - np.cumsum(reps) + reps, reps) + np.arange(reps.sum())
    other = nb_q != nb_owner
    nb_q, nb_owner = nb_q[other], nb_owner[other]
    return _BeamIndex(
        gain=np.ascontiguousarray(g.gain, dtype=np.float64).ravel(),
        nb_ptr=np.concatenate([[0], np.cumsum(np.bincount(flat_cand[nb_owner], minlength=n))]).astype(np.int64),
        nb=np.ascontiguousarray(np.stack([flat_set[nb_q] << K, flat_bit[nb_q], flat_cand[nb_q], flat_bit[nb_owner]])),
        own_ptr=own_ptr,
        own=np.ascontiguousarray(np.stack([flat_set[own_order], flat_bit[own_order]])),
        delta=np.bincount(flat_cand, weights=g.gain[flat_set, flat_bit] - g.gain[flat_set, 0], minlength=n),
        mask_dtype=np.min_scalar_type(2**K - 1),
    )


def _beam(g: SetGains, units: np.ndarray, capacity: int, width: int, compiled: bool | None = None):
    """Beam search: grow subsets one candidate at a time, keep the `width` best distinct subsets.

    Each step ranks every (beam member, allowed candidate) child by value, best first, ties by member
    then candidate index, and keeps the first `width` distinct subsets. Each member carries its
    membership mask per set and its delta (gain of adding each candidate). Adding x only changes the masks
    of the sets containing x, so a child's deltas are its parent's plus a correction over the positions of
    those sets: one step costs O(width * sets-per-candidate * K^2) rather than O(width * M * K).
    compiled: the numba loop (`_beam_steps`, default where numba imports) or the numpy one
    (`_beam_steps_numpy`); both give the same tables bit for bit (tested).
    """
    ix = _beam_index(g)
    units = np.ascontiguousarray(units, dtype=np.int64)
    if compiled is None:
        compiled = HAVE_NUMBA
    steps = _beam_steps if compiled else _beam_steps_numpy
    M, K = g.cand_pos.shape
    values, sizes, subsets = steps(ix.gain, ix.nb_ptr, ix.nb, ix.own_ptr, ix.own, ix.delta, units, int(capacity),
                                   int(width), int(M), int(K), np.zeros(1, ix.mask_dtype))
    return _best_by_size(values, sizes, subsets, capacity)


def _beam_steps_numpy(gain, nb_ptr, nb, own_ptr, own, delta0, units, capacity, width, M, K, mask_like):
    """The beam's steps in numpy. Returns every subset it kept: (values [S], sizes [S], subsets [S, n])."""
    n = units.size
    word_of = np.arange(n) // 64
    bit_of = np.left_shift(np.uint64(1), (np.arange(n) % 64).astype(np.uint64))
    masks = np.zeros((1, M), dtype=mask_like.dtype)
    delta = delta0[None].copy()
    words = np.zeros((1, -(-n // 64)), dtype=np.uint64)
    value = np.zeros(1)
    size = np.zeros(1, dtype=np.int64)
    chosen = np.zeros((1, n), bool)
    seen_v, seen_s, seen_sub = [value], [size], [chosen]
    while True:
        allowed = ~chosen & (size[:, None] + units[None] <= capacity)
        if not allowed.any():
            break
        score = np.where(allowed, value[:, None] + delta, -np.inf)
        # best first, ties by flat index (member, then candidate): a stable sort of the negated scores
        top = min(width * score.shape[0], int(allowed.sum()))
        ranked = np.argsort(-score.ravel(), kind="stable")[:top]
        b_all, x_all = np.divmod(ranked, n)
        child_words = words[b_all]
        child_words[np.arange(ranked.size), word_of[x_all]] |= bit_of[x_all]
        pick = _first_distinct(child_words, width)
        b_idx, x_idx = b_all[pick], x_all[pick]
        B = pick.size
        xs = x_idx.tolist()
        blocks = [own[:, own_ptr[x]:own_ptr[x + 1]] for x in xs]
        child = np.repeat(np.arange(B), [b.shape[1] for b in blocks])
        own_set, own_bit = np.concatenate(blocks, axis=1)
        masks = masks[b_idx]
        flat_masks = masks.reshape(-1)
        flat_masks[child * M + own_set] |= own_bit.astype(masks.dtype)
        blocks = [nb[:, nb_ptr[x]:nb_ptr[x + 1]] for x in xs]
        child = np.repeat(np.arange(B), [b.shape[1] for b in blocks])
        base, bit, cand, xbit = np.concatenate(blocks, axis=1)
        after = base | flat_masks.take(child * M + (base >> K))
        before = after & ~xbit
        corr = (gain.take(after | bit) - gain.take(after)) - (gain.take(before | bit) - gain.take(before))
        delta = delta[b_idx] + np.bincount(child * n + cand, weights=corr, minlength=B * n).reshape(B, n)
        words = child_words[pick]
        chosen = chosen[b_idx]
        chosen[np.arange(B), x_idx] = True
        value = score[b_idx, x_idx]
        size = size[b_idx] + units[x_idx]
        seen_v.append(value)
        seen_s.append(size)
        seen_sub.append(chosen)
    return np.concatenate(seen_v), np.concatenate(seen_s), np.concatenate(seen_sub)


@njit(cache=True)
def _beam_steps(gain, nb_ptr, nb, own_ptr, own, delta0, units, capacity, width, M, K, mask_like):  # pragma: no cover
    """`_beam_steps_numpy` compiled, the same arithmetic in the same order (identical results)."""
    n = units.size
    W = (n + 63) // 64
    S = 1 + width * n  # at most n steps of at most `width` members
    seen_v = np.zeros(S)
    seen_s = np.zeros(S, np.int64)
    seen_sub = np.zeros((S, n), np.bool_)
    masks = np.zeros((1, M), mask_like.dtype)
    delta = np.zeros((1, n))
    delta[0] = delta0
    words = np.zeros((1, W), np.uint64)
    value = np.zeros(1)
    size = np.zeros(1, np.int64)
    chosen = np.zeros((1, n), np.bool_)
    S_used = 1
    acc = np.zeros(n)
    while True:
        B0 = value.size
        neg = np.empty(B0 * n)
        flat = np.empty(B0 * n, np.int64)
        cnt = 0
        for b in range(B0):
            for x in range(n):
                if not chosen[b, x] and size[b] + units[x] <= capacity:
                    neg[cnt] = -(value[b] + delta[b, x])
                    flat[cnt] = b * n + x
                    cnt += 1
        if cnt == 0:
            break
        order = np.argsort(neg[:cnt], kind="mergesort")  # stable: ties by flat index
        top = min(width * B0, cnt)
        pb = np.empty(width, np.int64)
        px = np.empty(width, np.int64)
        pw = np.zeros((width, W), np.uint64)
        B = 0
        for r in range(top):
            f = flat[order[r]]
            b = f // n
            x = f - b * n
            for w in range(W):
                pw[B, w] = words[b, w]
            pw[B, x // 64] |= np.uint64(1) << np.uint64(x % 64)
            dup = False
            for c in range(B):
                same = True
                for w in range(W):
                    if pw[c, w] != pw[B, w]:
                        same = False
                        break
                if same:
                    dup = True
                    break
            if not dup:
                pb[B] = b
                px[B] = x
                B += 1
                if B == width:
                    break
        new_masks = np.empty((B, M), masks.dtype)
        new_delta = np.empty((B, n))
        new_value = np.empty(B)
        new_size = np.empty(B, np.int64)
        new_chosen = np.empty((B, n), np.bool_)
        for c in range(B):
            b, x = pb[c], px[c]
            new_masks[c] = masks[b]
            for r in range(own_ptr[x], own_ptr[x + 1]):
                new_masks[c, own[0, r]] |= own[1, r]
            acc[:] = 0.0
            for r in range(nb_ptr[x], nb_ptr[x + 1]):
                base, bit, xbit = nb[0, r], nb[1, r], nb[3, r]
                after = base | np.int64(new_masks[c, base >> K])
                before = after & ~xbit
                acc[nb[2, r]] += (gain[after | bit] - gain[after]) - (gain[before | bit] - gain[before])
            for y in range(n):
                new_delta[c, y] = delta[b, y] + acc[y]
            new_value[c] = value[b] + delta[b, x]
            new_size[c] = size[b] + units[x]
            new_chosen[c] = chosen[b]
            new_chosen[c, x] = True
            seen_v[S_used] = new_value[c]
            seen_s[S_used] = new_size[c]
            seen_sub[S_used] = new_chosen[c]
            S_used += 1
        masks, delta, value, size, chosen = new_masks, new_delta, new_value, new_size, new_chosen
        words = pw[:B].copy()
    return seen_v[:S_used], seen_s[:S_used], seen_sub[:S_used]
