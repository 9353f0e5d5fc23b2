"""`greedy`: SlimCaching's per-expert greedy baseline on the true K >= 1 objective (ALGORITHMS.md §2.5.5).

Repeatedly cache the (node, expert) with the largest drop in expected per-token latency per byte, until
nothing that helps fits. With K >= 2 the objective is not submodular (a gain can grow once a co-activated
partner is cached), so stale gains are not upper bounds and lazy evaluation would be wrong. Instead the
gains are exact at every step: the objective is a sum over layers and caching (l, e) only changes layer
l's sets that hold e, so after each choice only those sets' contributions (for every node) are recomputed
and layer l's gains re-summed from them.

Without a cloud (or with coverage=True) every expert left without an edge-server copy is then placed by
the shared coverage repair (`nodes.cover_edges`: free memory first, else evicting the least demanded
duplicate copy), so every expert stays reachable.

Ties, including the start where every single addition saves nothing because a set's partner still comes
from the cloud, are broken by the additive saving sum_A P(A) (t_before - t_after) of the calls themselves
(the K = 1 gain); that is what lets the baseline start at all.

The strong baseline (default `variant="best"`): the true-objective greedy above stalls where gains are
supermodular (once one layer's pair is cached its partners' gains jump, so it keeps filling that layer and
leaves others uncached). SlimCaching's own K = 1 greedy (`slimcaching.k1.greedy_k1`: lazy greedy on each
call's additive saving, i.e. a popularity greedy that knows the devices, the edge servers and the link
times) does not stall. Both run; the one with the lower true objective is kept (`params["variant_used"]`).
`variant="true"` or `"k1"` runs one of them.
"""

from __future__ import annotations

import time

import numpy as np

from edgemoe.errors import EdgeMoEError

from ..base import Placement, PlanProblem, empty_hosts, make_placement, register
from ..nodes import cover_edges, resolve_coverage
from ..objective import (
    SlimModel,
    expert_latency,
    latency_per_user_from_tau,
    require_covered,
    require_servable,
    slim_model,
)
from ..slimcaching.k1 import greedy_k1

TIE_TOL = 1e-12  # relative: ratios this close to the best count as ties
CHUNK_ELEMENTS = 4_000_000  # bound on the temporary [X, U, M, K] array
CACHE_BYTES = 512e6  # bound on the per-set contribution tables `true_objective_greedy` keeps


def _others_max(cur: np.ndarray) -> np.ndarray:
    """[..., K]: for each position, the max of the other K-1 entries (0 when K = 1)."""
    K = cur.shape[-1]
    if K == 1:
        return np.zeros_like(cur)
    part = np.sort(cur, axis=-1)
    first, second = part[..., -1:], part[..., -2:-1]
    is_top = np.arange(K) == cur.argmax(axis=-1)[..., None]
    return np.where(is_top, second, first)


def set_contributions(model: SlimModel, tau_l: np.ndarray, layer: int, owners: np.ndarray,
                      rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(drop, cut), each [X, R, K]: what adding each slot's expert to each node would do to sets `rows`.

    X = the S edge servers, then the devices of `owners` [U_d]; R = len(rows) sets of `layer` (all M by
    default); slot k of set m holds expert sets[m, k]. drop: the fall in expected latency (max over the set's
    K calls), cut: the fall in the additive call time, both weighted by each user's set probability x user
    weight and summed over users. tau_l: [U, E] current seconds per call.

    Every entry depends only on its own set's current call times, so after caching expert e only the sets
    holding e change (`true_objective_greedy` recomputes those rows). The sums over users run in user order
    (np.bincount), whatever rows are asked for: a row computed alone equals the same row of a full call bit
    for bit.
    """
    U, E = tau_l.shape
    all_sets = model.layers[layer].sets
    rows = np.arange(all_sets.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
    sets = all_sets[rows]  # [R, K]
    R, K = sets.shape
    mass = model.user_set_prob(layer)[:, rows] * model.weight[:, None]  # [U, R]
    cur = np.concatenate([tau_l, np.zeros((U, 1))], axis=1)[:, sets]  # [U, R, K]; padding slots cost nothing
    top, others = cur.max(axis=-1), _others_max(cur)
    S = model.edge_nodes.size
    drop, cut = np.zeros((S + owners.size, R, K)), np.zeros((S + owners.size, R, K))
    step = max(1, CHUNK_ELEMENTS // max(cur.size, 1))
    slot = np.arange(R * K).reshape(R, K)
    for start in range(0, S, step):
        stop = min(start + step, S)
        X = stop - start
        call = np.concatenate([model.edge_call[:, start:stop, layer], np.full((U, X, 1), np.inf)], axis=2)
        new = np.minimum(cur[None], call.transpose(1, 0, 2)[:, :, sets])  # [X, U, R, K]
        weight = mass[None, :, :, None]
        key = np.broadcast_to((np.arange(X)[:, None, None, None] * (R * K) + slot[None, None]), new.shape).ravel()
        size = X * R * K
        drop[start:stop] = np.bincount(key, weights=((top[None, :, :, None] - np.maximum(others[None], new))
                                                      * weight).ravel(), minlength=size).reshape(X, R, K)
        cut[start:stop] = np.bincount(key, weights=((cur[None] - new) * weight).ravel(),
                                      minlength=size).reshape(X, R, K)
    if owners.size:  # a device serves its owner only: one user per row, nothing to sum
        own = cur[owners]
        pad = np.full((owners.size, 1), np.inf)
        new = np.minimum(own, np.concatenate([model.device_call[owners, layer], pad], axis=1)[:, sets])
        weight = mass[owners][..., None]
        drop[S:] = (own.max(axis=-1)[..., None] - np.maximum(_others_max(own), new)) * weight
        cut[S:] = (own - new) * weight
    return drop, cut


def gains_from_contributions(contrib: np.ndarray, sets: np.ndarray, num_experts: int) -> np.ndarray:
    """[X, E]: per node, the sum of contrib [X, M, K] over the slots holding each expert (sets [M, K])."""
    X = contrib.shape[0]
    ids = (np.arange(X)[:, None, None] * (num_experts + 1) + sets[None]).ravel()
    out = np.bincount(ids, weights=contrib.ravel(), minlength=X * (num_experts + 1))
    return out.reshape(X, num_experts + 1)[:, :num_experts]


def edge_gains(model: SlimModel, tau_l: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(gain, additive saving), each [S, E]: effect of adding each expert of `layer` to each edge server.

    tau_l: [U, E] current seconds per call.
    """
    drop, cut = set_contributions(model, tau_l, layer, np.zeros(0, dtype=np.int64))
    sets, E = model.layers[layer].sets, tau_l.shape[1]
    return gains_from_contributions(drop, sets, E), gains_from_contributions(cut, sets, E)


def device_gains(model: SlimModel, tau_l: np.ndarray, layer: int, owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gain, additive saving), each [U_d, E], for adding each expert of `layer` to each owner's device."""
    drop, cut = set_contributions(model, tau_l, layer, owners)
    S, sets, E = model.edge_nodes.size, model.layers[layer].sets, tau_l.shape[1]
    return gains_from_contributions(drop[S:], sets, E), gains_from_contributions(cut[S:], sets, E)


VARIANTS = ("best", "true", "k1")


@register("greedy")
def greedy(problem: PlanProblem, coverage: bool | None = None, variant: str = "best") -> Placement:
    """Per-(node, expert) greedy on edge servers and devices; see the module docstring for `variant`.

    coverage: give every expert an edge-server copy afterwards; default (None) exactly when there is no cloud.
    """
    start = time.perf_counter()
    if variant not in VARIANTS:
        raise EdgeMoEError(f"greedy: variant={variant!r}; expected one of {VARIANTS}")
    cover = resolve_coverage(problem, coverage)
    require_servable(problem, "greedy", cover)
    model = slim_model(problem)
    candidates = {}
    if variant in ("best", "true"):
        candidates["true"] = true_objective_greedy(problem, model)
    if variant in ("best", "k1"):
        rules = ("ratio",) if np.unique(problem.expert_bytes).size == 1 else ("ratio", "plain")
        for rule in rules:
            candidates[f"k1-{rule}"] = (greedy_k1(problem, model, rule), 0)
    value = {}
    for name, (hosts, _) in candidates.items():
        if cover:
            cover_edges(problem, hosts)
            require_covered(problem, hosts, "greedy")
        value[name] = float(model.weight @ latency_per_user_from_tau(model, expert_latency(model, hosts)))
    used = min(value, key=lambda k: value[k])
    hosts, steps = candidates[used]
    return make_placement(problem, "greedy", hosts, objective_s=value[used], steps=steps, coverage=cover,
                          variant=variant, variant_used=used, variant_objective_s=value,
                          plan_seconds=time.perf_counter() - start)


def true_objective_greedy(problem: PlanProblem, model: SlimModel,
                          cache_bytes: float = CACHE_BYTES) -> tuple[np.ndarray, int]:
    """(hosts [N, L, E], steps): greedy by exact marginal latency reduction per byte, ties by call saving.

    After caching expert e of layer l only the sets of layer l that hold e change, so the per-set
    contributions (`set_contributions`) of every layer are kept and only those rows recomputed; the gains
    are then re-summed from them. When the kept tables would exceed cache_bytes, each step recomputes its
    whole layer instead: the same numbers (each row is computed the same way either way), more work.
    """
    L, E = problem.expert_bytes.shape
    hosts = empty_hosts(problem)
    tau = expert_latency(model, hosts)  # [U, L, E]
    owners = np.flatnonzero(model.device_node >= 0)
    nodes = np.concatenate([model.edge_nodes, model.device_node[owners]]).astype(np.int64)  # [X]
    gain, saving = np.zeros((nodes.size, L, E)), np.zeros((nodes.size, L, E))
    table_bytes = 2 * 8 * nodes.size * sum(layer.sets.size for layer in model.layers)
    kept: list[tuple[np.ndarray, np.ndarray] | None] = [None] * L

    def refresh(layer: int, expert: int | None = None) -> None:
        sets = model.layers[layer].sets
        if kept[layer] is None or expert is None:
            drop, cut = set_contributions(model, tau[:, layer], layer, owners)
            if table_bytes <= cache_bytes:
                kept[layer] = drop, cut
        else:
            drop, cut = kept[layer]
            rows = np.flatnonzero((sets == expert).any(axis=1))
            drop[:, rows], cut[:, rows] = set_contributions(model, tau[:, layer], layer, owners, rows)
        gain[:, layer] = gains_from_contributions(drop, sets, E)
        saving[:, layer] = gains_from_contributions(cut, sets, E)

    for layer in range(L):
        refresh(layer)
    size = np.maximum(problem.expert_bytes, 1).astype(np.float64)[None]  # padding experts have 0 bytes
    free = problem.capacity_bytes[nodes].astype(np.int64)
    steps = 0
    while True:
        ok = ~hosts[nodes] & (problem.expert_bytes[None] <= free[:, None, None]) & ((gain > 0) | (saving > 0))
        if not ok.any():
            break
        ratio = np.where(ok, gain / size, -np.inf)
        best = ratio.max()
        ties = ok & (ratio >= best - TIE_TOL * max(abs(best), 1e-300))
        x, layer, e = np.unravel_index(np.argmax(np.where(ties, saving / size, -np.inf)), ratio.shape)
        n = nodes[x]
        hosts[n, layer, e] = True
        free[x] -= problem.expert_bytes[layer, e]
        tau[:, layer, e] = np.minimum(tau[:, layer, e], model.node_call(n)[:, layer, e])
        refresh(layer, e)
        steps += 1
    return hosts, steps
