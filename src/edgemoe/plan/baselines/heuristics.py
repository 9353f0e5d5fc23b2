"""Baseline planners: uniform, random, lfu, activation-aware, eplb, affinity (pure numpy).

All of them fill only the node kinds named by `fill` (default "edge": edge servers; "edge,device" adds
user devices; the cloud is never filled, it holds everything). `coverage` says whether every expert must
get at least one non-cloud copy; its default (None) means "yes exactly when the problem has no cloud node".
With coverage on and enough total memory, every planner here leaves every expert reachable; a planner whose
own rule would not do that (lfu, eplb, affinity, activation-aware with skewed budgets) is repaired by
`ensure_coverage`, which evicts the least valuable duplicate copies. See docs/planners-ordermoe.md.

The helpers they share with the other planners (`fillable_nodes`, `access_nodes`, `node_demand`,
`ensure_coverage`, ...) are in `edgemoe.plan.nodes`.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..base import Placement, PlanProblem, empty_hosts, make_placement, register
from ..nodes import (
    access_nodes,
    argmax_lex,
    cover_uncovered,
    ensure_coverage,
    fill_by_order,
    fillable_nodes,
    free_bytes,
    global_demand,
    node_demand,
    proportional_slots,
    resolve_coverage,
)


def _finish(problem: PlanProblem, method: str, hosts: np.ndarray, **params) -> Placement:
    placement = make_placement(problem, method, hosts, **params)
    placement.check_capacity()
    return placement


def _check_common(problem: PlanProblem, fill: str, coverage: bool | None,
                  method: str = "baseline") -> tuple[np.ndarray, bool]:
    from ..objective import require_servable  # objective imports base only; local import keeps layering flat

    fillable, cover = fillable_nodes(problem, fill), resolve_coverage(problem, coverage)
    require_servable(problem, method, cover)
    return fillable, cover


# ---------------------------------------------------------------------------------------------- uniform


@register("uniform")
def plan_uniform(problem: PlanProblem, fill: str = "edge") -> Placement:
    """Expert-parallel sharding: every expert exactly once, round-robin weighted by capacity.

    Experts are visited layer by layer, id by id; each goes to the fitting fillable node with the largest
    free fraction of its memory (ties: lower index), which is plain round-robin for equal memories and
    proportional to memory otherwise. Leftover memory stays empty.
    """
    fillable = fillable_nodes(problem, fill)
    hosts = empty_hosts(problem)
    capacity = np.maximum(np.asarray(problem.capacity_bytes, dtype=np.float64), 1.0)
    free = free_bytes(problem, hosts).astype(np.float64)
    L, E = problem.expert_bytes.shape
    for layer in range(L):
        for expert in range(E):
            need = problem.expert_bytes[layer, expert]
            fits = fillable & (free >= need)
            if not fits.any():
                continue
            node = int(np.argmax(np.where(fits, free / capacity, -np.inf)))
            hosts[node, layer, expert] = True
            free[node] -= need
    return _finish(problem, "uniform", hosts, fill=fill)


# ----------------------------------------------------------------------------------------------- random


@register("random")
def plan_random(problem: PlanProblem, seed: int = 0, fill: str = "edge", coverage: bool | None = None) -> Placement:
    """Seeded random caching: (coverage first) then each node caches random experts until full.

    Coverage phase (when required): experts in random order, each on a random fillable node that fits.
    Fill phase: each fillable node walks its own random permutation of all experts and keeps each one that
    is not held yet and still fits.
    """
    fillable, cover = _check_common(problem, fill, coverage, "random")
    rng = np.random.default_rng(seed)
    hosts = empty_hosts(problem)
    L, E = problem.expert_bytes.shape
    if cover:
        free = free_bytes(problem, hosts)
        for flat in rng.permutation(L * E):
            layer, expert = divmod(int(flat), E)
            fits = np.flatnonzero(fillable & (free >= problem.expert_bytes[layer, expert]))
            if fits.size:
                node = int(rng.choice(fits))
                hosts[node, layer, expert] = True
                free[node] -= problem.expert_bytes[layer, expert]
    for node in np.flatnonzero(fillable):
        fill_by_order(problem, hosts, int(node), rng.permutation(L * E))
    return _finish(problem, "random", hosts, seed=seed, fill=fill, coverage=cover)


# -------------------------------------------------------------------------------------------------- lfu


def resolve_fill(problem: PlanProblem, fill: str) -> str:
    """fill="auto": edge servers and, when the cluster has any, user devices."""
    if fill != "auto":
        return fill
    return "edge,device" if "device" in problem.node_kind else "edge"


@register("lfu")
def plan_lfu(problem: PlanProblem, fill: str = "auto", coverage: bool | None = None) -> Placement:
    """Each node caches the experts its own users activate most, until full; then coverage repair.

    Device-aware (fill "auto" with devices, or "edge,device"): each device first caches its owner's most
    frequent experts (per byte); then each edge server counts, for the users whose nearest edge server it
    is, only the activations their own device does not already serve. Edge servers: a node's users are
    those whose access node it is (`access_nodes` over edge servers); its value of (l, e) is their
    token-weighted activation frequency, ties (e.g. a node without users) broken by the global
    user-weighted frequency. Nodes decide independently, so popular experts are duplicated. With coverage
    required, `ensure_coverage` then evicts the least globally frequent duplicates to cover the rest.
    """
    fill = resolve_fill(problem, fill)
    fillable, cover = _check_common(problem, fill, coverage, "lfu")
    kinds = np.array(problem.node_kind)
    overall = global_demand(problem)
    hosts = empty_hosts(problem)
    tie = -(overall / np.maximum(problem.expert_bytes, 1)).ravel()
    weighted = problem.user_weight[:, None, None] * problem.user_freq()  # [U, L, E]
    home = np.asarray(problem.user_home, dtype=np.int64)
    for u in np.flatnonzero(fillable[home] & (kinds[home] == "device")):
        own = (weighted[u] / np.maximum(problem.expert_bytes, 1)).ravel()
        fill_by_order(problem, hosts, int(home[u]), np.lexsort((tie, -own)))
    on_device = np.where((kinds[home] == "device")[:, None, None], hosts[home], False)  # [U, L, E]
    edge_fill = fillable & (kinds == "edge")
    if edge_fill.any():
        demand = np.zeros((problem.num_nodes, *problem.expert_bytes.shape))
        np.add.at(demand, access_nodes(problem, edge_fill), np.where(on_device, 0.0, weighted))
        for node in np.flatnonzero(edge_fill):
            # Value per byte, so that with unequal sizes a node keeps the most activations per byte.
            own = (demand[node] / np.maximum(problem.expert_bytes, 1)).ravel()
            fill_by_order(problem, hosts, int(node), np.lexsort((tie, -own)))
    if cover:
        ensure_coverage(problem, hosts, edge_fill if edge_fill.any() else fillable, overall)
    return _finish(problem, "lfu", hosts, fill=fill, coverage=cover)


# ------------------------------------------------------------------------------------- activation-aware


def entropy_layer_budget(freq: np.ndarray, expert_bytes: np.ndarray, total_bytes: float, floor_bytes: np.ndarray) -> np.ndarray:
    """[L] bytes each layer may use: `floor_bytes` [L] first, the rest in proportion to routing entropy.

    freq: [L, E]. H_l = -sum_e p log p with p = freq[l] / sum(freq[l]) (DanceMoE/Prism's "activation
    diversity"): layers whose routing is spread out get more copies.
    """
    totals = freq.sum(axis=1, keepdims=True)
    p = np.divide(freq, totals, out=np.zeros_like(freq, dtype=np.float64), where=totals > 0)
    entropy = -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1)
    extra = max(float(total_bytes) - float(floor_bytes.sum()), 0.0)
    share = entropy / entropy.sum() if entropy.sum() > 0 else np.full(len(entropy), 1.0 / len(entropy))
    return floor_bytes + extra * share


def cover_by_local_value(problem: PlanProblem, hosts: np.ndarray, fillable: np.ndarray, local: np.ndarray,
                         overall: np.ndarray) -> np.ndarray:
    """Give every uncovered expert a copy where it costs the fewest local activations (in place).

    local: [N, L, E] activations per token of (l, e) among node n's own users; overall: [L, E] (order:
    most demanded uncovered expert first). An uncovered expert goes to a fitting node with free room
    (most local demand for it first); else it replaces a duplicate copy (held on >= 2 nodes) on a node
    where that makes room, choosing the swap that loses the least local demand net of what it gains.
    """
    return cover_uncovered(problem, hosts, fillable, overall,
                  pick=lambda layer, expert, free, fits: argmax_lex(local[:, layer, expert], free, fits),
                  eviction_cost=lambda layer, expert: local - local[:, layer, expert][:, None, None])


@register("activation-aware")
def plan_activation_aware(problem: PlanProblem, fill: str = "edge", coverage: bool | None = None) -> Placement:
    """DanceMoE/Prism-style placement: entropy-guided per-layer budgets, demand-first greedy, coverage.

    Objective (Prism's proxy): keep as many activations as possible on the user's own (access) node,
    sum_n sum_(l,e) f_n(l, e) [n holds (l, e)], with every expert somewhere.
    1. Budget: layer l may use its coverage bytes (one copy of each expert, when coverage is on) plus a
       share of the remaining memory proportional to its routing entropy H_l.
    2. Greedy: all (node, l, e) in descending local frequency f_n^l(e) per byte (the node's users'
       activations), placed while the node has room and layer l is within its budget.
    3. Memory the layer budgets left unused (rounding) is filled by the same order without budgets.
    4. Coverage (`cover_by_local_value`): each expert still held nowhere takes free room on the node that
       wants it most, else replaces the duplicate copy whose loss of local activations is least.
    The coverage copies come last, not first: placing one copy of every expert before demand was
    considered filled the largest nodes with rarely used experts (on edge8 it then served fewer activations
    locally than eplb and lfu).
    """
    fillable, cover = _check_common(problem, fill, coverage, "activation-aware")
    L, E = problem.expert_bytes.shape
    demand = node_demand(problem, fillable)  # [N, L, E]
    overall = global_demand(problem)
    sizes = problem.expert_bytes
    total = float(np.asarray(problem.capacity_bytes)[fillable].sum())
    floor = sizes.sum(axis=1).astype(np.float64) if cover else np.zeros(L)
    budget = entropy_layer_budget(overall, sizes, total, np.minimum(floor, total * floor / max(floor.sum(), 1.0)))
    hosts = empty_hosts(problem)
    layer_used = np.zeros(L)
    free = free_bytes(problem, hosts).astype(np.float64)
    # Local-frequency order over all (node, l, e) on fillable nodes; global frequency breaks ties.
    nodes = np.flatnonzero(fillable)
    local = (demand[nodes] / np.maximum(sizes, 1)[None]).ravel()
    tie = np.broadcast_to(overall / np.maximum(sizes, 1), (len(nodes), L, E)).ravel()
    order = np.lexsort((-tie, -local))
    for respect_budget in (True, False):
        for flat in order:
            i, rest = divmod(int(flat), L * E)
            layer, expert = divmod(rest, E)
            node, need = nodes[i], sizes[layer, expert]
            if hosts[node, layer, expert] or free[node] < need:
                continue
            if respect_budget and layer_used[layer] + need > budget[layer]:
                continue
            hosts[node, layer, expert] = True
            free[node] -= need
            layer_used[layer] += need
    if cover:
        cover_by_local_value(problem, hosts, fillable, demand, overall)
    return _finish(problem, "activation-aware", hosts, fill=fill, coverage=cover)


# ------------------------------------------------------------------------------------------------- eplb


def replicate_by_load(weight: np.ndarray, num_slots: int, max_copies: int) -> np.ndarray:
    """[E] copies of each expert: one each, then extra copies to the largest load per copy (EPLB step 1).

    weight: [E] load estimate of each expert of one layer. With fewer slots than experts, the heaviest
    `num_slots` experts get one copy each. No expert gets more than `max_copies` (one per node).
    Ties go to the lower expert id.
    """
    E = weight.shape[0]
    counts = np.zeros(E, dtype=np.int64)
    if num_slots <= 0 or max_copies <= 0:
        return counts
    if num_slots < E:
        counts[np.argsort(-weight, kind="stable")[:num_slots]] = 1
        return counts
    counts[:] = 1
    heap = [(-float(weight[e]), e) for e in range(E)]
    heapq.heapify(heap)
    for _ in range(num_slots - E):
        while heap and counts[heap[0][1]] >= max_copies:
            heapq.heappop(heap)
        if not heap:
            break
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(weight[e]) / counts[e], e))
    return counts


def pack_balanced(item_expert: np.ndarray, item_weight: np.ndarray, slots: np.ndarray, speed_s: np.ndarray) -> np.ndarray:
    """[M] node of each copy (-1 if none could take it): heaviest copy first into the lightest node (EPLB step 2).

    item_expert, item_weight: [M] expert id and load of each copy; slots: [N] free slots per node;
    speed_s: [N] seconds per unit of load on each node (busy time = load x speed_s, so a faster node
    takes more load). A node never takes two copies of the same expert. Ties: lower node index.
    """
    busy = np.zeros(len(slots))
    room = slots.astype(np.int64).copy()
    held: list[set[int]] = [set() for _ in range(len(slots))]
    node_of = np.full(len(item_expert), -1, dtype=np.int64)
    for i in np.argsort(-item_weight, kind="stable"):
        ok = np.array([room[n] > 0 and int(item_expert[i]) not in held[n] for n in range(len(slots))])
        if not ok.any():
            continue
        node = int(np.argmin(np.where(ok, busy, np.inf)))
        node_of[i] = node
        room[node] -= 1
        busy[node] += item_weight[i] * speed_s[node]
        held[node].add(int(item_expert[i]))
    return node_of


@register("eplb")
def plan_eplb(problem: PlanProblem, fill: str = "edge", coverage: bool | None = None) -> Placement:
    """DeepSeek-EPLB-style: per layer, replicate heavy experts, then pack copies onto nodes by load.

    Re-implemented from the description in ALGORITHMS.md §4.7 (global policy; a node is one pack):
    1. Slots: each node's memory is split evenly over layers (`proportional_slots`).
    2. Replicate: the layer's slots become copies, one per expert, extra ones to the expert with the
       largest user-weighted load per copy (at most one copy per node).
    3. Pack: copies, heaviest per-copy load first, go to the node with the least busy time (load x mean
       compute seconds of the node for the layer) among nodes with a free slot of that layer and no copy
       of that expert yet.
    4. Slots left empty by step 3 take the expert with the largest load per copy that the node lacks.
    """
    fillable, cover = _check_common(problem, fill, coverage, "eplb")
    L, E = problem.expert_bytes.shape
    load = global_demand(problem)
    slots = proportional_slots(problem, fillable)  # [N, L]
    hosts = empty_hosts(problem)
    for layer in range(L):
        counts = replicate_by_load(load[layer], int(slots[:, layer].sum()), int((slots[:, layer] > 0).sum()))
        item_expert = np.repeat(np.arange(E), counts)
        item_weight = (load[layer] / np.maximum(counts, 1))[item_expert]
        speed = problem.compute_s[:, layer].mean(axis=1)
        node_of = pack_balanced(item_expert, item_weight, slots[:, layer], speed)
        placed = node_of >= 0
        hosts[node_of[placed], layer, item_expert[placed]] = True
        _fill_empty_slots(hosts, slots, layer, load[layer], fillable)
    if cover:
        ensure_coverage(problem, hosts, fillable, load)
    return _finish(problem, "eplb", hosts, fill=fill, coverage=cover)


def _fill_empty_slots(hosts: np.ndarray, slots: np.ndarray, layer: int, load: np.ndarray, fillable: np.ndarray) -> None:
    """Put the expert with the largest load per copy that a node lacks into each unused slot of `layer`."""
    for node in np.flatnonzero(fillable):
        while hosts[node, layer].sum() < slots[node, layer]:
            copies = hosts[fillable, layer].sum(axis=0)
            score = np.where(hosts[node, layer], -np.inf, load / (copies + 1))
            hosts[node, layer, int(np.argmax(score))] = True


# --------------------------------------------------------------------------------------------- affinity


@register("affinity")
def plan_affinity(problem: PlanProblem, fill: str = "edge", replicate: bool = True) -> Placement:
    """ExFlow-style placement: experts that follow each other across layers share a node.

    Affinity of (l, e) -> (l+1, e') is the expected transitions per token f_l(e) * trans[l, e, e'].
    1. Layer 0: like `uniform` (largest free fraction), most frequent expert first.
    2. Layer l+1: experts, most frequent first, each to the node with room and under its quota (the node's
       memory share of the layer's E experts, rounded up) that maximises the affinity to the layer-l
       experts it holds (ties: largest free fraction). Every expert is placed once (as in ExFlow's expert
       parallelism), when memory allows.
    3. With `replicate`, each node fills its leftover memory with the copies of largest affinity to its
       neighbours in the adjacent layers (per byte), computed once per node after step 2.
    """
    fillable = fillable_nodes(problem, fill)
    L, E = problem.expert_bytes.shape
    freq = global_demand(problem)
    joint = freq[:-1, :, None] * problem.profile.trans  # [L-1, E, E] expected e -> e' transitions per token
    capacity = np.asarray(problem.capacity_bytes, dtype=np.float64)
    share = np.where(fillable, capacity, 0.0) / max(capacity[fillable].sum(), 1.0)
    quota = np.ceil(share * E).astype(np.int64)  # [N] experts of each layer a node should hold at most
    hosts = empty_hosts(problem)
    free = free_bytes(problem, hosts).astype(np.float64)
    safe_cap = np.maximum(capacity, 1.0)
    for layer in range(L):
        held_prev = hosts[:, layer - 1].astype(np.float64) if layer > 0 else None  # [N, E]
        for expert in np.argsort(-freq[layer], kind="stable"):
            need = problem.expert_bytes[layer, expert]
            fits = fillable & (free >= need)
            if not fits.any():
                continue
            under = fits & (hosts[:, layer].sum(axis=1) < quota)
            pool = under if under.any() else fits
            gain = held_prev @ joint[layer - 1][:, expert] if held_prev is not None else np.zeros(len(free))
            node = argmax_lex(gain, free / safe_cap, pool)
            hosts[node, layer, expert] = True
            free[node] -= need
    if replicate:
        for node in np.flatnonzero(fillable):
            score = _neighbour_affinity(hosts[node], joint) / np.maximum(problem.expert_bytes, 1)
            order = np.lexsort((-(freq / np.maximum(problem.expert_bytes, 1)).ravel(), -score.ravel()))
            fill_by_order(problem, hosts, int(node), order)
    return _finish(problem, "affinity", hosts, fill=fill, replicate=replicate)


def _neighbour_affinity(held: np.ndarray, joint: np.ndarray) -> np.ndarray:
    """[L, E] expected transitions per token between (l, e) and the experts held ([L, E] bool) in layers l+-1."""
    L, E = held.shape
    score = np.zeros((L, E))
    h = held.astype(np.float64)
    if L > 1:
        score[1:] += np.einsum("le,lef->lf", h[:-1], joint)  # from held predecessors into (l, e)
        score[:-1] += np.einsum("lef,lf->le", joint, h[1:])  # from (l, e) into held successors
    return score
