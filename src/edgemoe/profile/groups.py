"""OrderMoE similarity groups: which experts of a layer can stand in for each other (pure numpy).

Similarity is the profile's router-logit cosine `sim [L, E, E]` on the **raw cosine scale [-1, 1]**
(never MC-SMoE's (cos+1)/2; every threshold here is on the raw scale). Three ways to group a layer:

- `layer_aware_groups`: threshold clustering with a threshold that loosens with depth,
  theta(l) = theta_hi - (theta_hi - theta_lo) * l / (L - 1), so deeper layers get larger groups.
- `uniform_threshold_groups`: the same with one threshold for every layer (the ablation).
- `fixed_count_groups`: MC-SMoE style, the n_l most frequent experts are dominants and every other
  expert joins the dominant it is most similar to.
- `error_groups`: the same leader clustering on *measured* substitution error instead of router cosine:
  two experts may share a group when running either in place of the other costs at most `max_err`
  (relative output error on calibration hidden states; zeroing the branch costs 1.0).

How well router cosine predicts measured error (`cosine_error_spearman`) and how much of the traffic a
grouping covers (`traffic_coverage`) are reported per layer by `grouping_report`.

Threshold procedure (leader clustering in descending frequency): experts are visited from most to least
frequent (ties: lower id first). An expert joins the most similar existing dominant whose similarity is
>= theta(l) (and whose group is not full, if a size cap is set); otherwise it becomes a new dominant.
This yields exactly the dominants of ALGORITHMS.md §3.4.2's greedy seeding; the only difference is that a
member joins its *most similar* qualifying dominant rather than the most frequent one. Every dominant is
the most frequent expert of its group, and every member is >= theta(l)-similar to its dominant.

Substitutes of an expert are the other members of its group, ranked by measured substitution error
`subst_err[l, e, e']` (error of running e' in place of e; lower first), ties by similarity (higher
first), then by id. They are stored as -1 padded arrays so a runtime can read `substitutes(l, e)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.profile import Profile

# Thresholds on raw cosine. 0.6 -> 0.3 is ALGORITHMS.md §3.4.2's example; on the synthetic profile
# (E=8) it keeps shallow layers mostly singletons/pairs and gives the last layer groups of 3-5.
THETA_HI = 0.6
THETA_LO = 0.3


@dataclass(frozen=True)
class SimilarityGroups:
    """Groups of every layer, and each expert's ranked substitutes. L layers, E experts, S = max group size - 1.

    Group ids of a layer are 0..num_groups[l]-1 in order of creation, which is the dominants' order of
    descending frequency (group 0 holds the layer's most frequent expert).
    """

    group_of: np.ndarray  # [L, E] int64 group id of each expert within its layer
    dominant: np.ndarray  # [L, G] int64 dominant expert of each group, -1 padded (G = max groups in a layer)
    num_groups: np.ndarray  # [L] int64
    substitute_ids: np.ndarray  # [L, E, S] int64 ranked substitutes of each expert (same group), -1 padded
    substitute_sim: np.ndarray  # [L, E, S] float64 their similarity to the expert (nan where padded)
    substitute_err: np.ndarray  # [L, E, S] float64 their measured substitution error (nan where padded)
    thresholds: np.ndarray  # [L] float64 raw-cosine threshold used per layer (nan for fixed-count and error groups)
    method: str  # "layer-aware" | "uniform" | "fixed-count" | "error"

    @property
    def num_layers(self) -> int:
        return int(self.group_of.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.group_of.shape[1])

    def substitutes(self, layer: int, expert: int) -> np.ndarray:
        """[S'] ids of the experts that may stand in for (layer, expert), best first (no padding)."""
        ids = self.substitute_ids[layer, expert]
        return ids[ids >= 0]

    def members(self, layer: int, group: int) -> np.ndarray:
        """[m] ids of the experts in `group` of `layer`, ascending."""
        return np.flatnonzero(self.group_of[layer] == group)

    def is_dominant(self) -> np.ndarray:
        """[L, E] bool: the expert is its group's dominant."""
        L, E = self.group_of.shape
        mask = np.zeros((L, E), dtype=bool)
        rows, cols = np.nonzero(self.dominant >= 0)
        mask[rows, self.dominant[rows, cols]] = True
        return mask

    def group_sizes(self) -> np.ndarray:
        """[L, E] size of the group each expert belongs to (1 = no substitute)."""
        L, E = self.group_of.shape
        counts = np.zeros((L, E), dtype=np.int64)
        np.add.at(counts, (np.repeat(np.arange(L), E), self.group_of.ravel()), 1)
        return np.take_along_axis(counts, self.group_of, axis=1)

    def size_histogram(self) -> np.ndarray:
        """[L, E+1] hist[l, s] = number of groups of size s in layer l."""
        L, E = self.group_of.shape
        hist = np.zeros((L, E + 1), dtype=np.int64)
        for layer in range(L):
            sizes = np.bincount(self.group_of[layer], minlength=self.num_groups[layer])
            hist[layer] = np.bincount(sizes, minlength=E + 1)
        return hist

    def mean_group_size(self) -> np.ndarray:
        """[L] experts per group in each layer."""
        return self.num_experts / self.num_groups


def layer_thresholds(num_layers: int, theta_hi: float = THETA_HI, theta_lo: float = THETA_LO) -> np.ndarray:
    """[L] raw-cosine thresholds interpolated linearly from theta_hi (first layer) to theta_lo (last)."""
    _check_theta(theta_hi, "theta_hi")
    _check_theta(theta_lo, "theta_lo")
    if theta_lo > theta_hi:
        raise EdgeMoEError(f"theta_lo={theta_lo} must be <= theta_hi={theta_hi} (thresholds loosen with depth)")
    if num_layers == 1:
        return np.array([theta_hi], dtype=np.float64)
    return theta_hi - (theta_hi - theta_lo) * np.arange(num_layers) / (num_layers - 1)


def layer_aware_groups(
    profile: Profile,
    theta_hi: float = THETA_HI,
    theta_lo: float = THETA_LO,
    max_group_size: int | None = None,
) -> SimilarityGroups:
    """OrderMoE's layer-aware grouping: thresholds loosen linearly from theta_hi to theta_lo with depth."""
    thresholds = layer_thresholds(profile.sim.shape[0], theta_hi, theta_lo)
    return threshold_groups(profile.sim, profile.freq, profile.subst_err, thresholds, max_group_size, "layer-aware")


def uniform_threshold_groups(
    profile: Profile, theta: float = 0.5 * (THETA_HI + THETA_LO), max_group_size: int | None = None
) -> SimilarityGroups:
    """Ablation: one threshold for every layer (default: the middle of the layer-aware schedule)."""
    _check_theta(theta, "theta")
    thresholds = np.full(profile.sim.shape[0], float(theta))
    return threshold_groups(profile.sim, profile.freq, profile.subst_err, thresholds, max_group_size, "uniform")


def threshold_groups(
    sim: np.ndarray,
    freq: np.ndarray,
    subst_err: np.ndarray,
    thresholds: np.ndarray,
    max_group_size: int | None = None,
    method: str = "threshold",
) -> SimilarityGroups:
    """Leader clustering of every layer in descending frequency (see the module docstring).

    sim: [L, E, E] raw cosine; freq: [L, E]; subst_err: [L, E, E]; thresholds: [L] raw cosine.
    """
    L, E = _check_inputs(sim, freq, subst_err)
    thresholds = np.asarray(thresholds, dtype=np.float64)
    if thresholds.shape != (L,):
        raise EdgeMoEError(f"thresholds has shape {thresholds.shape}, expected ({L},)")
    cap = _check_cap(max_group_size, E)
    group_of = np.stack([_leader_layer(sim[layer], freq[layer], thresholds[layer], cap) for layer in range(L)])
    return _assemble(group_of, freq, sim, subst_err, thresholds, method)


def fixed_count_groups(
    profile: Profile, groups_per_layer: int | np.ndarray, max_group_size: int | None = None
) -> SimilarityGroups:
    """MC-SMoE-style grouping: the n_l most frequent experts of layer l are dominants.

    Every other expert, in descending frequency, joins the dominant it is most similar to (skipping full
    groups when `max_group_size` is set). groups_per_layer: int or [L] ints in [1, E].
    """
    sim, freq, err = profile.sim, profile.freq, profile.subst_err
    L, E = _check_inputs(sim, freq, err)
    counts = np.broadcast_to(np.asarray(groups_per_layer, dtype=np.int64), (L,))
    if np.any(counts < 1) or np.any(counts > E):
        raise EdgeMoEError(f"groups_per_layer must be in [1, {E}] for every layer, got {counts.tolist()}")
    cap = _check_cap(max_group_size, E)
    if cap is not None and np.any(counts * cap < E):
        raise EdgeMoEError(f"max_group_size={cap} x groups_per_layer is smaller than E={E} in some layer")
    group_of = np.stack([_fixed_layer(sim[layer], freq[layer], int(counts[layer]), cap) for layer in range(L)])
    return _assemble(group_of, freq, sim, err, np.full(L, np.nan), "fixed-count")


MAX_ERR = 0.9  # error groups: a substitute must beat zeroing the branch (error 1.0) by a margin


def symmetric_error(subst_err: np.ndarray) -> np.ndarray:
    """[L, E, E] max(err(e -> e'), err(e' -> e)): the worse direction, so membership is mutual."""
    err = np.asarray(subst_err, dtype=np.float64)
    return np.maximum(err, np.swapaxes(err, 1, 2))


def error_groups(profile: Profile, max_err: float = MAX_ERR, max_group_size: int | None = None) -> SimilarityGroups:
    """Leader clustering (descending frequency) on measured substitution error: an expert joins the existing
    dominant it can swap with at the lowest symmetric error, if that error is <= max_err; else it leads.

    Substitutes are ranked as for every grouping (measured error first). `thresholds` is nan (not a cosine).
    """
    sim, freq, err = profile.sim, profile.freq, profile.subst_err
    L, E = _check_inputs(sim, freq, err)
    if not max_err >= 0:
        raise EdgeMoEError(f"max_err must be >= 0 (relative output error), got {max_err}")
    cap = _check_cap(max_group_size, E)
    closeness = -symmetric_error(err)  # larger = closer, so the cosine machinery applies unchanged
    group_of = np.stack([_leader_layer(closeness[layer], freq[layer], -float(max_err), cap) for layer in range(L)])
    return _assemble(group_of, freq, sim, err, np.full(L, np.nan), "error")


def cosine_error_spearman(sim: np.ndarray, subst_err: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([L] Spearman rho, [L] p-value) between router cosine sim[l, e, e'] and measured error
    subst_err[l, e, e'] over the ordered pairs e != e'. A cosine that predicts error gives rho well below 0."""
    from scipy.stats import spearmanr

    L, E, _ = np.shape(sim)
    off = ~np.eye(E, dtype=bool)
    rho, p = np.full(L, np.nan), np.full(L, np.nan)
    for layer in range(L):
        x, y = np.asarray(sim[layer])[off], np.asarray(subst_err[layer])[off]
        if np.ptp(x) > 0 and np.ptp(y) > 0:
            res = spearmanr(x, y)
            rho[layer], p[layer] = float(res.statistic), float(res.pvalue)
    return rho, p


def traffic_coverage(groups: SimilarityGroups, freq: np.ndarray, max_err: float | None = None) -> np.ndarray:
    """[L] share of a layer's activations (freq [L, E]) whose expert has a substitute in its group; with
    `max_err`, only substitutes whose measured error is below it count (1.0: better than zeroing)."""
    has = groups.substitute_ids[:, :, 0] >= 0  # [L, E]
    if max_err is not None:
        best = np.where(np.isnan(groups.substitute_err), np.inf, groups.substitute_err).min(axis=2)
        has &= best < max_err
    freq = np.asarray(freq, dtype=np.float64)
    total = freq.sum(axis=1)
    return np.divide((freq * has).sum(axis=1), total, out=np.zeros(len(total)), where=total > 0)


def grouping_report(profile: Profile, groupings: tuple[str, ...] = ("layer-aware", "error")) -> dict:
    """Per layer: Spearman(router cosine, measured error), and for each grouping the mean group size, the
    traffic share with a substitute, the share with one better than zeroing, and the median error of each
    expert's best substitute."""
    rho, p = cosine_error_spearman(profile.sim, profile.subst_err)
    out = {"spearman_cosine_vs_error": np.round(rho, 4).tolist(), "spearman_p_value": [float(f"{v:.3g}") for v in p],
           "groupings": {}}
    for name in groupings:
        g = groups_for(profile, name)
        best = np.where(np.isnan(g.substitute_err), np.inf, g.substitute_err).min(axis=2)
        med = [float(np.median(row[np.isfinite(row)])) if np.isfinite(row).any() else None for row in best]
        out["groupings"][name] = {
            "mean_group_size": np.round(g.mean_group_size(), 3).tolist(),
            "traffic_with_substitute": np.round(traffic_coverage(g, profile.freq), 4).tolist(),
            "traffic_with_substitute_better_than_zero": np.round(traffic_coverage(g, profile.freq, 1.0), 4).tolist(),
            "median_best_substitute_error": [None if m is None else round(m, 4) for m in med],
        }
    return out


def adaptive_group_counts(freq: np.ndarray, total_groups: int) -> np.ndarray:
    """[L] group counts that sum to about `total_groups`, fewer where routing is skewed (MC-SMoE "globally").

    freq: [L, E]. Each layer's frequencies are scaled to a maximum of 1 (so every layer's top expert ties
    at 1.0 and keeps >= 1 group); the global threshold is the total_groups-th largest scaled frequency and
    a layer gets as many groups as it has experts at or above it.
    """
    freq = np.asarray(freq, dtype=np.float64)
    L, E = freq.shape
    if not 1 <= total_groups <= L * E:
        raise EdgeMoEError(f"total_groups must be in [1, {L * E}], got {total_groups}")
    top = freq.max(axis=1, keepdims=True)
    scaled = np.divide(freq, top, out=np.ones_like(freq), where=top > 0)
    threshold = np.sort(scaled.ravel())[::-1][total_groups - 1]
    return np.maximum((scaled >= threshold).sum(axis=1), 1).astype(np.int64)


# ---------------------------------------------------------------------------------------------- internals


def _frequency_order(freq_row: np.ndarray) -> np.ndarray:
    """[E] expert ids from most to least frequent; ties by lower id (stable sort)."""
    return np.argsort(-np.asarray(freq_row, dtype=np.float64), kind="stable")


def _leader_layer(sim: np.ndarray, freq: np.ndarray, theta: float, cap: int | None) -> np.ndarray:
    """[E] group id of each expert of one layer by threshold leader clustering. sim: [E, E]; freq: [E]."""
    E = freq.shape[0]
    group_of = np.full(E, -1, dtype=np.int64)
    dominants: list[int] = []
    sizes: list[int] = []
    for e in _frequency_order(freq):
        best = -1
        if dominants:
            doms = np.asarray(dominants)
            score = sim[e, doms].astype(np.float64)
            open_group = np.asarray(sizes) < cap if cap is not None else np.ones(len(doms), dtype=bool)
            score[(score < theta) | ~open_group] = -np.inf
            if np.isfinite(score.max()):
                best = int(np.argmax(score))  # first max = the more frequent dominant on ties
        if best < 0:
            best = len(dominants)
            dominants.append(int(e))
            sizes.append(0)
        group_of[e] = best
        sizes[best] += 1
    return group_of


def _fixed_layer(sim: np.ndarray, freq: np.ndarray, num_groups: int, cap: int | None) -> np.ndarray:
    """[E] group id of each expert: top-`num_groups` frequent experts lead, the rest join the most similar."""
    order = _frequency_order(freq)
    dominants = order[:num_groups]
    group_of = np.full(freq.shape[0], -1, dtype=np.int64)
    group_of[dominants] = np.arange(num_groups)
    sizes = np.ones(num_groups, dtype=np.int64)
    for e in order[num_groups:]:
        score = sim[e, dominants].astype(np.float64)
        if cap is not None:
            score[sizes >= cap] = -np.inf
        best = int(np.argmax(score))
        group_of[e] = best
        sizes[best] += 1
    return group_of


def _assemble(
    group_of: np.ndarray, freq: np.ndarray, sim: np.ndarray, subst_err: np.ndarray, thresholds: np.ndarray,
    method: str,
) -> SimilarityGroups:
    """Dominants and ranked, -1 padded substitute tables from the group ids [L, E]."""
    L, E = group_of.shape
    num_groups = group_of.max(axis=1) + 1
    dominant = np.full((L, int(num_groups.max())), -1, dtype=np.int64)
    for layer in range(L):
        for e in _frequency_order(freq[layer])[::-1]:  # the last write per group is its most frequent member
            dominant[layer, group_of[layer, e]] = e
    same_group = group_of[:, :, None] == group_of[:, None, :]  # [L, E, E]
    same_group[:, np.arange(E), np.arange(E)] = False
    width = max(int(same_group.sum(axis=2).max()), 1)
    # Rank every candidate e' of e: invalid pairs last, then by error asc, similarity desc, id asc.
    err = np.where(same_group, subst_err, np.inf)
    neg_sim = np.where(same_group, -sim, np.inf)
    ids = np.broadcast_to(np.arange(E), (L, E, E))
    order = np.lexsort((ids, neg_sim, err), axis=-1)[:, :, :width]
    valid = np.take_along_axis(same_group, order, axis=2)
    return SimilarityGroups(
        group_of=group_of.astype(np.int64),
        dominant=dominant,
        num_groups=num_groups.astype(np.int64),
        substitute_ids=np.where(valid, order, -1).astype(np.int64),
        substitute_sim=np.where(valid, np.take_along_axis(sim, order, axis=2), np.nan),
        substitute_err=np.where(valid, np.take_along_axis(subst_err, order, axis=2), np.nan),
        thresholds=np.asarray(thresholds, dtype=np.float64),
        method=method,
    )


def _check_inputs(sim: np.ndarray, freq: np.ndarray, subst_err: np.ndarray) -> tuple[int, int]:
    L, E = np.shape(freq)
    if np.shape(sim) != (L, E, E):
        raise EdgeMoEError(f"sim has shape {np.shape(sim)}, expected {(L, E, E)} to match freq {(L, E)}")
    if np.shape(subst_err) != (L, E, E):
        raise EdgeMoEError(f"subst_err has shape {np.shape(subst_err)}, expected {(L, E, E)}")
    return L, E


def _check_theta(theta: float, name: str) -> None:
    if not -1.0 <= float(theta) <= 1.0:
        raise EdgeMoEError(f"{name}={theta} is outside the raw-cosine range [-1, 1]")


def _check_cap(max_group_size: int | None, num_experts: int) -> int | None:
    if max_group_size is None:
        return None
    if int(max_group_size) < 1:
        raise EdgeMoEError(f"max_group_size must be >= 1, got {max_group_size}")
    return min(int(max_group_size), num_experts)


def groups_for(profile: Profile, grouping: str = "layer-aware", **params) -> SimilarityGroups:
    """Group `profile` by name: "layer-aware" (theta_hi, theta_lo), "uniform" (theta), "fixed" (groups_per_layer)
    or "error" (max_err: measured substitution error instead of router cosine).

    All accept max_group_size. Unknown parameters for the chosen grouping raise EdgeMoEError.
    """
    allowed = {
        "layer-aware": {"theta_hi", "theta_lo", "max_group_size"},
        "uniform": {"theta", "max_group_size"},
        "fixed": {"groups_per_layer", "max_group_size"},
        "error": {"max_err", "max_group_size"},
    }
    if grouping not in allowed:
        raise EdgeMoEError(f"grouping={grouping!r}; expected one of {sorted(allowed)}")
    extra = set(params) - allowed[grouping]
    if extra:
        raise EdgeMoEError(f"grouping={grouping!r} does not take {sorted(extra)}; it takes {sorted(allowed[grouping])}")
    if grouping == "layer-aware":
        return layer_aware_groups(profile, **params)
    if grouping == "uniform":
        return uniform_threshold_groups(profile, **params)
    if grouping == "error":
        return error_groups(profile, **params)
    params.setdefault("groups_per_layer", max(1, profile.E // 2))
    return fixed_count_groups(profile, **params)
