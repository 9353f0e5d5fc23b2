"""`greedy`: SlimCaching's per-expert greedy baseline on the true K >= 1 objective (ALGORITHMS.md §2.5.5).

Repeatedly cache the (node, expert) with the largest drop in expected per-token latency per byte, until
nothing that helps fits. With K >= 2 the objective is not submodular (a gain can grow once a co-activated
partner is cached), so stale gains are not upper bounds and lazy evaluation would be wrong. Instead the
gains are exact at every step: the objective is a sum over layers and caching (l, e) only changes layer
l, so after each choice only layer l's gains (for every node) are recomputed.

Without a cloud (or with coverage=True) every expert left without an edge-server copy is then placed by
the shared coverage repair (`slimcaching.cover_edges`: free memory first, else evicting the least demanded
duplicate copy), so every expert stays reachable.

Ties, including the start where every single addition saves nothing because a set's partner still comes
from the cloud, are broken by the additive saving sum_A P(A) (t_before - t_after) of the calls themselves
(the K = 1 gain); that is what lets the baseline start at all.

The strong baseline (default `variant="best"`): the true-objective greedy above stalls where gains are
supermodular (once one layer's pair is cached its partners' gains jump, so it keeps filling that layer and
leaves others uncached). SlimCaching's own K = 1 greedy (`slim_k1.greedy_k1`: lazy greedy on each
call's additive saving, i.e. a popularity greedy that knows the devices, the edge servers and the link
times) does not stall. Both run; the one with the lower true objective is kept (`params["variant_used"]`).
`variant="true"` or `"k1"` runs one of them.
"""

from __future__ import annotations

import time

import numpy as np

from edgemoe.errors import EdgeMoEError

from .base import Placement, PlanProblem, empty_hosts, make_placement, register
from .baselines import resolve_coverage
from .objective import (
    SlimModel,
    expert_latency,
    latency_per_user_from_tau,
    require_covered,
    require_servable,
    slim_model,
)
from .slim_k1 import greedy_k1
from .slimcaching import cover_edges

TIE_TOL = 1e-12  # relative: ratios this close to the best count as ties
CHUNK_ELEMENTS = 4_000_000  # bound on the temporary [X, U, M, K] array


def _others_max(cur: np.ndarray) -> np.ndarray:
    """[..., K]: for each position, the max of the other K-1 entries (0 when K = 1)."""
    K = cur.shape[-1]
    if K == 1:
        return np.zeros_like(cur)
    part = np.sort(cur, axis=-1)
    first, second = part[..., -1:], part[..., -2:-1]
    is_top = np.arange(K) == cur.argmax(axis=-1)[..., None]
    return np.where(is_top, second, first)


def edge_gains(model: SlimModel, tau_l: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(gain, additive saving), each [S, E]: effect of adding each expert of `layer` to each edge server.

    tau_l: [U, E] current seconds per call.
    """
    U, E = tau_l.shape
    sets = model.layers[layer].sets
    mass = model.user_set_prob(layer) * model.weight[:, None]  # [U, M]
    cur = np.concatenate([tau_l, np.zeros((U, 1))], axis=1)[:, sets]  # [U, M, K]
    top, others = cur.max(axis=-1), _others_max(cur)
    S = model.edge_nodes.size
    gain, saving = np.zeros((S, E + 1)), np.zeros((S, E + 1))
    step = max(1, CHUNK_ELEMENTS // max(cur.size, 1))
    flat_ids = np.broadcast_to(sets, cur.shape).ravel()
    for start in range(0, S, step):
        stop = min(start + step, S)
        call = np.concatenate([model.edge_call[:, start:stop, layer], np.full((U, stop - start, 1), np.inf)], axis=2)
        new = np.minimum(cur[None], call.transpose(1, 0, 2)[:, :, sets])  # [X, U, M, K]
        drop = (top[None, :, :, None] - np.maximum(others[None], new)) * mass[None, :, :, None]
        cut = (cur[None] - new) * mass[None, :, :, None]
        for i in range(stop - start):
            gain[start + i] = np.bincount(flat_ids, weights=drop[i].ravel(), minlength=E + 1)
            saving[start + i] = np.bincount(flat_ids, weights=cut[i].ravel(), minlength=E + 1)
    return gain[:, :E], saving[:, :E]


def device_gains(model: SlimModel, tau_l: np.ndarray, layer: int, owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gain, additive saving), each [U_d, E], for adding each expert of `layer` to each owner's device."""
    E = tau_l.shape[1]
    sets = model.layers[layer].sets
    mass = (model.user_set_prob(layer) * model.weight[:, None])[owners]
    pad = np.zeros((owners.size, 1))
    cur = np.concatenate([tau_l[owners], pad], axis=1)[:, sets]
    new = np.minimum(cur, np.concatenate([model.device_call[owners, layer], pad + np.inf], axis=1)[:, sets])
    drop = (cur.max(axis=-1)[..., None] - np.maximum(_others_max(cur), new)) * mass[..., None]
    cut = (cur - new) * mass[..., None]
    ids = (np.arange(owners.size)[:, None, None] * (E + 1) + sets[None]).ravel()
    size = owners.size * (E + 1)
    gain = np.bincount(ids, weights=drop.ravel(), minlength=size).reshape(owners.size, E + 1)
    saving = np.bincount(ids, weights=cut.ravel(), minlength=size).reshape(owners.size, E + 1)
    return gain[:, :E], saving[:, :E]


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


def true_objective_greedy(problem: PlanProblem, model: SlimModel) -> tuple[np.ndarray, int]:
    """(hosts [N, L, E], steps): greedy by exact marginal latency reduction per byte, ties by call saving."""
    L, E = problem.expert_bytes.shape
    hosts = empty_hosts(problem)
    tau = expert_latency(model, hosts)  # [U, L, E]
    owners = np.flatnonzero(model.device_node >= 0)
    nodes = np.concatenate([model.edge_nodes, model.device_node[owners]]).astype(np.int64)  # [X]
    S = model.edge_nodes.size
    gain, saving = np.zeros((nodes.size, L, E)), np.zeros((nodes.size, L, E))

    def refresh(layer: int) -> None:
        if S:
            gain[:S, layer], saving[:S, layer] = edge_gains(model, tau[:, layer], layer)
        if owners.size:
            gain[S:, layer], saving[S:, layer] = device_gains(model, tau[:, layer], layer, owners)

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
        refresh(layer)
        steps += 1
    return hosts, steps
