"""OrderMoE placement: representative coverage, then redundant deployment (pure numpy).

Reconstructed from ALGORITHMS.md §3.4.3 (structure [B], details [R]; every choice is listed in
docs/planners-ordermoe.md):

Stage 1, representative coverage. Every expert is placed once (when memory allows), in rank-major order:
all groups' dominants first, then every group's second member, and so on; within a rank, the more
important expert first. Each goes to the fitting node with the largest
    score(n) = load[n] * 1[m_n = 0] + eta * (free[n] / capacity[n]) / (1 + m_n),
m_n being how many members of the expert's group node n holds already. So one group's members land on
different nodes (each node then holds a stand-in for many groups), busy nodes collect representatives
first, a group larger than the node count is spread evenly, and ties go to the emptier node.

Stage 2, redundant deployment. Nodes are visited busiest first; each fills its leftover memory by a
lazy greedy on gain per byte, where the gain of a copy of (l, e) on node n is
    (1 + rep_weight * rep[l, e]) * sum_u w_u f_u(l, e) * max(0, best_u(l, e) - call_s[u, n, l, e])
                                 * (1 - gamma * 1[u's access node holds a substitute of e]),
best_u being the cheapest current copy for user u (cloud included). Once no copy gains anything, the rest
of the memory takes experts by importance / (1 + copies) so it is not left idle.

importance[l, e] = f_l(e) * (1 + rep[l, e]), with representativeness
    rep[l, e] = sum_{e' in G(e), e' != e} f_l(e') * max(0, sim_l(e, e')) / sum_{e' in G(e)} f_l(e')  in [0, 1):
the share of its group's traffic the expert can stand in for, weighted by similarity.
"""

from __future__ import annotations

import heapq
import inspect
from dataclasses import dataclass, fields, replace

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.profile.groups import (
    MAX_ERR,
    THETA_HI,
    THETA_LO,
    SimilarityGroups,
    cosine_error_spearman,
    groups_for,
    traffic_coverage,
)

from ..base import Placement, PlanProblem, empty_hosts, make_placement, register
from ..nodes import access_nodes, fillable_nodes, free_bytes, node_load, replica_counts
from .runtime_model import PathModel
from .search import LatencySearch, frequent_sets
from .standins import KINDS, QUALITY_POWER, check_kinds

# Tie-break weight of the free-memory fraction in stage 1: below any load difference that matters
# (loads sum to 1, so 8 equal servers have 0.125 each) but enough to spread when loads tie.
ETA = 0.1
# Gain discount for a copy whose user already has a local substitute (it would mostly substitute):
# 0 = ignore substitutes, 1 = such a copy is worthless. Middle value; no number in the sources.
GAMMA = 0.5


def representativeness(groups: SimilarityGroups, freq: np.ndarray, sim: np.ndarray) -> np.ndarray:
    """[L, E] share of the rest of its group's activations an expert can stand in for, similarity-weighted.

    freq: [L, E]; sim: [L, E, E] raw cosine. Singletons get 0.
    """
    same = groups.group_of[:, :, None] == groups.group_of[:, None, :]  # [L, E, E]
    E = freq.shape[1]
    others = same.copy()
    others[:, np.arange(E), np.arange(E)] = False
    covered = np.einsum("lef,lf->le", others * np.clip(sim, 0.0, None), freq)
    group_mass = np.einsum("lef,lf->le", same, freq)
    return np.divide(covered, group_mass, out=np.zeros_like(covered), where=group_mass > 0)


def importance(groups: SimilarityGroups, freq: np.ndarray, sim: np.ndarray) -> np.ndarray:
    """[L, E] activation frequency x (1 + representativeness)."""
    return freq * (1.0 + representativeness(groups, freq, sim))


def coverage_order(groups: SimilarityGroups, weight: np.ndarray) -> np.ndarray:
    """[L*E, 2] (layer, expert) pairs in rank-major order: rank within group, then weight desc, then (l, e).

    weight: [L, E]. Rank 0 is the dominant, then the other members by weight desc.
    """
    L, E = weight.shape
    rank = np.zeros((L, E), dtype=np.int64)
    for layer in range(L):
        order = np.lexsort((np.arange(E), -weight[layer]))
        dominants = groups.is_dominant()[layer]
        order = np.concatenate([order[dominants[order]], order[~dominants[order]]])
        seen = np.zeros(groups.num_groups[layer], dtype=np.int64)
        for e in order:
            g = groups.group_of[layer, e]
            rank[layer, e] = seen[g]
            seen[g] += 1
    flat = np.lexsort((np.arange(L * E), -weight.ravel(), rank.ravel()))
    return np.stack(np.divmod(flat, E), axis=1)


def representative_coverage(
    problem: PlanProblem, groups: SimilarityGroups, weight: np.ndarray, fillable: np.ndarray, load: np.ndarray,
    eta: float = ETA, cover: str = "all",
) -> np.ndarray:
    """Stage 1: [N, L, E] hosts with every expert once (memory permitting), group members spread out.

    weight: [L, E] importance (order within a rank); load: [N] token share per node. cover="dominants"
    places only each group's dominant (one representative per group), "none" nothing.
    """
    hosts = empty_hosts(problem)
    capacity = np.maximum(np.asarray(problem.capacity_bytes, dtype=np.float64), 1.0)
    free = free_bytes(problem, hosts).astype(np.float64)
    members_on = np.zeros((problem.num_nodes, groups.num_layers, int(groups.num_groups.max())), dtype=np.int64)
    order = coverage_order(groups, weight)
    if cover == "dominants":
        order = order[groups.is_dominant()[order[:, 0], order[:, 1]]]
    elif cover == "none":
        order = order[:0]
    for layer, expert in order:
        need = problem.expert_bytes[layer, expert]
        fits = fillable & (free >= need)
        if not fits.any():
            continue  # memory is too small for every expert once; the cloud (if any) serves it
        group = groups.group_of[layer, expert]
        held = members_on[:, layer, group]
        score = load * (held == 0) + eta * (free / capacity) / (1 + held)
        node = int(np.argmax(np.where(fits, score, -np.inf)))
        hosts[node, layer, expert] = True
        members_on[node, layer, group] += 1
        free[node] -= need
    return hosts


class _GainModel:
    """Latency-saving gain of one more copy, kept up to date as copies are added (stage 2)."""

    def __init__(self, problem: PlanProblem, groups: SimilarityGroups, hosts: np.ndarray, fillable: np.ndarray,
                 rep_factor: np.ndarray, gamma: float):
        self.problem, self.groups, self.hosts, self.gamma = problem, groups, hosts, gamma
        self.access = access_nodes(problem, fillable)  # [U]
        self.demand = problem.user_weight[:, None, None] * problem.user_freq()  # [U, L, E]
        self.rep_factor = rep_factor  # [L, E]
        self.best = self._initial_best()  # [U, L, E]
        self.same = groups.group_of[:, :, None] == groups.group_of[:, None, :]  # [L, E, E]
        E = self.same.shape[1]
        self.same[:, np.arange(E), np.arange(E)] = False  # a substitute is another member

    def call_s(self, node: int) -> np.ndarray:
        """[U, L, E] seconds for each user to run each expert on `node`."""
        return self.problem.comm_s[:, node, None, None] + self.problem.compute_s[node][None]

    def _initial_best(self) -> np.ndarray:
        U, (L, E) = len(self.problem.user_weight), self.problem.expert_bytes.shape
        best = np.full((U, L, E), np.inf)
        for node in np.flatnonzero(self.hosts.any(axis=(1, 2))):
            best = np.where(self.hosts[node][None], np.minimum(best, self.call_s(int(node))), best)
        finite = best[np.isfinite(best)]
        # An expert nobody holds (no cloud, memory too small) costs a penalty well above any real call.
        penalty = 10.0 * (finite.max() if finite.size else 1.0)
        return np.where(np.isfinite(best), best, penalty)

    def local_substitute(self) -> np.ndarray:
        """[U, L, E] bool: the user's access node holds another member of e's group."""
        nodes, where = np.unique(self.access, return_inverse=True)  # few nodes, many users
        held = self.hosts[nodes].astype(np.float64)  # [n, L, E]
        return (np.einsum("lef,nlf->nle", self.same, held) > 0)[where]

    def gains(self, node: int) -> np.ndarray:
        """[L, E] gain of adding each expert to `node` (0 where held)."""
        saved = np.maximum(self.best - self.call_s(node), 0.0)
        discount = 1.0 - self.gamma * self.local_substitute()
        gain = self.rep_factor * (self.demand * saved * discount).sum(axis=0)
        return np.where(self.hosts[node], 0.0, gain)

    def gain_of(self, node: int, layer: int, expert: int) -> float:
        call = self.problem.comm_s[:, node] + self.problem.compute_s[node, layer, expert]
        saved = np.maximum(self.best[:, layer, expert] - call, 0.0)
        mates = self.same[layer, expert]
        has_sub = self.hosts[self.access, layer][:, mates].any(axis=1)  # [U]
        weight = self.demand[:, layer, expert] * (1.0 - self.gamma * has_sub)
        return float(self.rep_factor[layer, expert] * (weight * saved).sum())

    def add(self, node: int, layer: int, expert: int) -> None:
        self.hosts[node, layer, expert] = True
        call = self.problem.comm_s[:, node] + self.problem.compute_s[node, layer, expert]
        self.best[:, layer, expert] = np.minimum(self.best[:, layer, expert], call)


def redundant_deployment(
    problem: PlanProblem, groups: SimilarityGroups, hosts: np.ndarray, fillable: np.ndarray, load: np.ndarray,
    weight: np.ndarray, rep_factor: np.ndarray, gamma: float = GAMMA, fill_rest: bool = True,
) -> np.ndarray:
    """Stage 2: fill leftover memory, busiest node first, by lazy greedy on gain per byte. In place.

    weight: [L, E] importance (fallback order once gains are zero, when `fill_rest`); rep_factor: [L, E]
    gain multiplier.
    Gains only fall as copies are added, so a stale heap entry is an upper bound (lazy evaluation is exact).
    """
    model = _GainModel(problem, groups, hosts, fillable, rep_factor, gamma)
    sizes = problem.expert_bytes
    E = sizes.shape[1]
    for node in sorted(np.flatnonzero(fillable), key=lambda n: (-load[n], n)):
        node = int(node)
        free = int(free_bytes(problem, hosts)[node])
        per_byte = model.gains(node) / sizes
        heap = [(-per_byte.flat[i], i) for i in np.flatnonzero(per_byte.ravel() > 0)]
        heapq.heapify(heap)
        while heap:
            _, flat = heapq.heappop(heap)
            layer, expert = divmod(int(flat), E)
            if hosts[node, layer, expert] or sizes[layer, expert] > free:
                continue
            fresh = model.gain_of(node, layer, expert) / sizes[layer, expert]
            if heap and fresh < -heap[0][0] - 1e-15:
                if fresh > 0:
                    heapq.heappush(heap, (-fresh, flat))
                continue
            if fresh <= 0:
                continue
            model.add(node, layer, expert)
            free -= int(sizes[layer, expert])
        if not fill_rest:
            continue
        # No copy saves anything any more: spend the rest on important experts with few copies.
        copies = replica_counts(hosts, fillable)
        fallback = (weight / (1.0 + copies) / sizes).ravel()
        for flat in np.lexsort((np.arange(fallback.size), -fallback)):
            layer, expert = divmod(int(flat), E)
            if not hosts[node, layer, expert] and sizes[layer, expert] <= free:
                model.add(node, layer, expert)
                free -= int(sizes[layer, expert])
    return hosts


ALGORITHMS = ("search", "two-stage")
BUDGET = 0.05  # the ordermoe policy's default allowance per token-layer (docs/runtime.md): plan for it
PATHS_PER_USER = 128  # calibration paths replayed per user (2048 rows on edge8's 16 users)
SETS_PER_LAYER = 24  # frequent Top-K sets per layer offered as one-move completions
MAX_EVALS = 4000  # objective evaluations the search may spend (each a batched incremental replay)
# Share of the traffic planned as exact execution (budget 0) beside the policy's: a placement tuned only for
# the stand-ins leaves exact execution (users without budget, the `exact` policy) slow (docs/planners-ordermoe.md)
EXACT_SHARE = 0.25
# Rows replayed at most: 32 servers with 2 users each and 128 paths; larger clusters get fewer paths per user
# (never under runtime_model.MIN_PATHS), so one evaluation's cost stops growing with the cluster.
MAX_ROWS = 8192


@dataclass(frozen=True)
class OrderMoESettings:
    """The knobs of `plan_ordermoe` (every field is also a `--param` of `edgemoe plan --method ordermoe`).

    Parameters:
        mode: token location the search plans for, "migrate" or "home"; None: problem.params["mode"], else
            "migrate".
        algorithm: "search" (default, `ordermoe.search`) or "two-stage" (the earlier reconstruction of
            §3.4.3, kept as an ablation; module docstring).
        budget: the ordermoe policy's quality allowance per token-layer planned for (0: exact execution).
        substitutes: the policy's stand-in kinds, a subset of "sub,drop,zero".
        quality_power: stand-ins priced (gate x error) ** quality_power, as the policy prices them.
        exact_share: share of the traffic planned without budget (exact execution), beside the policy's.
        paths_per_user: calibration paths replayed per user.
        max_rows: cap on the replayed rows (larger clusters get fewer paths per user).
        sets_per_layer: most frequent Top-K sets per layer offered as one-move completions.
        max_evals: objective evaluations the search may spend (each a batched incremental replay).
        swap_rounds: rounds of the local search (exchanges and swaps).
        init: start of the search, "successive" (the per-node successive decomposition) or "greedy".
        relocate_rounds: re-solves of the start for where tokens sit (migrate mode).
        exchange_neighbours: nearest servers each server exchanges contents with.
        start_neighbours: nearest cache nodes a user's weight reaches in the start's decomposition.
        grouping: similarity groups, "layer-aware" (theta_hi -> theta_lo over depth, router cosine: the
            paper's option), "uniform" (one `theta`, default the middle of theta_hi and theta_lo), "fixed"
            (`groups_per_layer` dominants per layer, default E // 2) or "error" (measured substitution error
            <= `max_err` both ways).
        theta_hi, theta_lo, theta, groups_per_layer, max_group_size, max_err: the grouping's thresholds.
        redundancy, eta, gamma, rep_weight, cover: the two-stage ablation's knobs (redundant deployment on or
            off, stage 1's free-memory tie-break weight, the substitute discount in [0, 1], the
            representativeness weight, and which experts stage 1 covers: "all", "dominants" or "none";
            None: "dominants" with a cloud, else "all").
        fill: node kinds to fill, comma-separated (None: "edge,device" for the search in home mode, the
            device-edge-cloud setting where devices cache for their owner, else "edge"; never the cloud).
    """

    mode: str | None = None
    algorithm: str = "search"
    budget: float = BUDGET
    substitutes: str = ",".join(KINDS)
    quality_power: float = QUALITY_POWER
    exact_share: float = EXACT_SHARE
    paths_per_user: int = PATHS_PER_USER
    max_rows: int = MAX_ROWS
    sets_per_layer: int = SETS_PER_LAYER
    max_evals: int = MAX_EVALS
    swap_rounds: int = 4
    init: str = "successive"
    relocate_rounds: int = 2
    exchange_neighbours: int = 7
    start_neighbours: int = 8
    grouping: str = "layer-aware"
    theta_hi: float = THETA_HI
    theta_lo: float = THETA_LO
    theta: float | None = None
    groups_per_layer: int | None = None
    max_group_size: int | None = None
    max_err: float = MAX_ERR
    redundancy: bool = True
    eta: float = ETA
    gamma: float = GAMMA
    rep_weight: float = 1.0
    fill: str | None = None
    cover: str | None = None

    def check(self) -> OrderMoESettings:
        """Raise EdgeMoEError naming the first knob out of range; return self."""
        for name in ("eta", "gamma", "rep_weight"):
            value = getattr(self, name)
            if value < 0 or (name == "gamma" and value > 1):
                raise EdgeMoEError(f"ordermoe: {name}={value} out of range ({'[0, 1]' if name == 'gamma' else '>= 0'})")
        if self.algorithm not in ALGORITHMS:
            raise EdgeMoEError(f"ordermoe: algorithm={self.algorithm!r}; expected one of {list(ALGORITHMS)}")
        if self.init not in ("successive", "greedy"):
            raise EdgeMoEError(f"ordermoe: init={self.init!r}; expected 'successive' or 'greedy'")
        if self.max_evals < 0 or self.swap_rounds < 0 or self.sets_per_layer < 0:
            raise EdgeMoEError("ordermoe: max_evals, swap_rounds and sets_per_layer must be >= 0")
        if self.start_neighbours < 1 or self.exchange_neighbours < 1:
            raise EdgeMoEError("ordermoe: start_neighbours and exchange_neighbours must be >= 1")
        return self


def ordermoe_settings(settings: OrderMoESettings | None = None, **overrides) -> OrderMoESettings:
    """`settings` (default: the defaults) with `overrides` {field: value} applied, checked.

    Parameters:
        settings: the base settings; None: `OrderMoESettings()`.
        overrides: field names of OrderMoESettings and their values (the CLI's `--param key=value`).
    Returns:
        the frozen, range-checked OrderMoESettings. An unknown name raises EdgeMoEError listing the valid ones.
    """
    names = [f.name for f in fields(OrderMoESettings)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise EdgeMoEError(f"ordermoe: unknown setting(s) {unknown}; valid: {', '.join(names)}")
    return replace(settings or OrderMoESettings(), **overrides).check()


@register("ordermoe")
def plan_ordermoe(problem: PlanProblem, settings: OrderMoESettings | None = None, **overrides) -> Placement:
    """OrderMoE placement.

    Parameters:
        problem: the planning problem (profile x cluster).
        settings: the planner's knobs (`OrderMoESettings`; None: the defaults).
        overrides: any OrderMoESettings field by name, applied over `settings` (`plan(problem, "ordermoe",
            budget=0.1)`, `--param budget=0.1`).
    Returns:
        the Placement: hosts [N, L, E] within every node's capacity, and in its params the settings used
        plus, per layer, the traffic share with a substitute (and with one better than zeroing the branch)
        and the Spearman correlation of router cosine with measured error; the search adds its facts
        (evaluations, accepted moves, expected latency at each stage).

    algorithm "search": minimise the runtime's expected per-token latency in token-location `mode`, replaying
    `paths_per_user` calibration paths per user with the ordermoe policy's stand-ins within `budget` per
    token-layer (`exact_share` of the traffic planned without budget), by a lazy greedy over single copies and
    completions of the `sets_per_layer` most frequent Top-K sets, a coverage repair (no cloud) and
    `swap_rounds` rounds of swaps, within `max_evals` objective evaluations. The groups give the substitutes
    (search with budget > 0) and the two-stage coverage.
    """
    s = ordermoe_settings(settings, **overrides)
    groups = _make_groups(problem, s)
    rho, _ = cosine_error_spearman(problem.profile.sim, problem.profile.subst_err)
    common = {"algorithm": s.algorithm, "grouping": s.grouping, "theta_hi": s.theta_hi, "theta_lo": s.theta_lo,
              "theta": s.theta, "groups_per_layer": s.groups_per_layer, "max_group_size": s.max_group_size,
              "max_err": s.max_err, "num_groups": groups.num_groups.tolist(),
              # per layer: how much traffic the groups give a stand-in, and whether router cosine predicts
              # the measured substitution error at all (Spearman; well below 0 when it does)
              "traffic_with_substitute": np.round(traffic_coverage(groups, problem.profile.freq), 4).tolist(),
              "traffic_with_substitute_better_than_zero":
                  np.round(traffic_coverage(groups, problem.profile.freq, 1.0), 4).tolist(),
              "spearman_cosine_vs_error": [None if np.isnan(r) else round(float(r), 4) for r in rho]}
    if s.algorithm == "search":
        mode = problem.params.get("mode", "migrate") if s.mode is None else s.mode
        # home mode is SlimCaching's device-edge-cloud setting, where devices cache for their owner too
        s = replace(s, mode=mode, fill=s.fill or ("edge,device" if mode == "home" else "edge"))
        hosts, info = _search(problem, groups, s)
        params = {**common, **info}
    else:
        hosts, cover = _two_stage(problem, groups, replace(s, fill=s.fill or "edge"))
        params = {**common, "redundancy": s.redundancy, "eta": s.eta, "gamma": s.gamma, "rep_weight": s.rep_weight,
                  "fill": s.fill or "edge", "cover": cover}
    placement = make_placement(problem, "ordermoe", hosts, **params)
    placement.check_capacity()
    return placement


def _with_settings_signature(fn):
    """Give `fn` (problem, settings, **overrides) the signature (problem, *, <every OrderMoESettings field>), so
    `edgemoe.params.validate_params` types and range-checks `--param`s against the fields as for any planner."""
    params = [inspect.Parameter("problem", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="PlanProblem")]
    params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in fields(OrderMoESettings)]
    fn.__signature__ = inspect.Signature(params, return_annotation="Placement")
    fn.__annotations__ = {p.name: p.annotation for p in params} | {"return": "Placement"}
    return fn


_with_settings_signature(plan_ordermoe)


def _search(problem: PlanProblem, groups: SimilarityGroups, s: OrderMoESettings) -> tuple[np.ndarray, dict]:
    """The latency search (`ordermoe.search`) with settings `s` (mode and fill resolved); returns (hosts
    [N, L, E], facts for the placement's params)."""
    mode, kinds = s.mode, check_kinds(s.substitutes)
    fill_kinds = {k.strip() for k in s.fill.split(",")}
    present = set(problem.node_kind)
    fillable = fillable_nodes(problem, ",".join(sorted(fill_kinds & present)) or s.fill)
    model = PathModel(problem, mode, s.paths_per_user, s.budget, groups.substitute_ids, s.max_rows, kinds,
                      s.quality_power, exact_share=s.exact_share)
    search = LatencySearch(problem, model, empty_hosts(problem), fillable, s.max_evals, s.exchange_neighbours)
    sets = frequent_sets(model, s.sets_per_layer)
    L, E = problem.expert_bytes.shape
    singles = [(layer, (e,)) for layer in range(L) for e in range(E)]
    cands = singles + [(layer, c) for layer in range(L) for c in sets[layer]]
    start = search.objective_s
    edge = np.array([k == "edge" for k in problem.node_kind])
    cover = not problem.is_cloud.any()
    nodes = np.flatnonzero(fillable)
    if s.init == "successive":
        search.hosts = _successive_start(problem, fillable, s.start_neighbours)
        if mode == "migrate":
            search.hosts = _relocated_start(problem, model, search.hosts, fillable, s.relocate_rounds,
                                            s.start_neighbours)
        used = (search.hosts * search.sizes[None]).sum(axis=(1, 2))
        search.free = np.where(fillable, np.asarray(problem.capacity_bytes, dtype=np.int64) - used, 0)
        search.state = model.replay(search.hosts)
        search.greedy(cands, nodes, refreshes=1)
    elif cover:  # every expert once first: unused ones parked, the rest placed where they pay most
        demand = np.zeros((L, E))
        for layer in range(L):
            np.add.at(demand[layer], model.topk[:, layer].ravel(), np.repeat(model.weight, model.topk.shape[2]))
        search.park_unused(edge, demand)
        search.greedy(singles, np.flatnonzero(fillable & edge), refreshes=2, cover=edge)
    if s.init == "greedy":
        search.greedy(cands, nodes)
    greedy_s = search.objective_s
    search.swaps(edge if cover else None, s.swap_rounds)
    policy_s, exact_s = model.expected_parts(search.state)
    info = {"mode": mode, "budget": s.budget, "substitutes": ",".join(kinds), "quality_power": s.quality_power,
            "exact_share": model.exact_share, "paths_per_user": s.paths_per_user, "max_rows": s.max_rows,
            "rows": model.num_rows, "sets_per_layer": s.sets_per_layer, "init": s.init,
            "relocate_rounds": s.relocate_rounds, "exchange_neighbours": s.exchange_neighbours,
            "start_neighbours": s.start_neighbours, "max_evals": s.max_evals, "swap_rounds": s.swap_rounds,
            "fill": s.fill, "coverage": cover, "evaluations": search.evals, "moves": search.accepted,
            "expected_latency_ms": 1e3 * search.objective_s, "dense_ms": 1e3 * model.dense_token_s,
            "expected_policy_ms": 1e3 * policy_s, "expected_exact_ms": 1e3 * exact_s,
            "greedy_latency_ms": 1e3 * greedy_s, "empty_latency_ms": 1e3 * start}
    return search.hosts, info


def _successive_start(problem: PlanProblem, fillable: np.ndarray, near: int | None = None) -> np.ndarray:
    """[N, L, E] start of the search: the per-node successive decomposition (`slimcaching.successive`, 3 passes,
    no refinement), which places co-activated experts together exactly for the home-mode latency. near: each
    node's block weighs only the users that have it among their `near` nearest cache nodes (None: all)."""
    from ..nodes import cover_edges
    from ..objective import slim_model
    from ..slimcaching.planner import successive

    hosts, _ = successive(problem, slim_model(problem), passes=3, coverage=not problem.is_cloud.any(), near=near)
    if not problem.is_cloud.any():
        cover_edges(problem, hosts)
    hosts[~fillable & ~problem.is_cloud] = False
    return hosts


def location_problem(problem: PlanProblem, model: PathModel, hosts: np.ndarray) -> PlanProblem:
    """The home-mode problem of where tokens actually are (migrate mode): one pseudo-user per (node c, domain d)
    with the share of token-layers that start at c (replayed under hosts [N, L, E]) as its weight, homed at c.

    The successive decomposition then places co-activated experts where the migrating tokens sit, not only at
    their users' homes.
    """
    replay = model.replay(hosts)
    D = max(int(problem.user_domain.max()) + 1, 1)
    mass = np.zeros((problem.num_nodes, D))
    domain = np.asarray(problem.user_domain)[model.user]
    for layer in range(model.L):
        np.add.at(mass, (replay.location[:, layer], domain), model.weight / model.L)
    node, dom = np.nonzero(mass > 0)
    return replace(problem, user_names=tuple(f"at-{problem.node_names[c]}-d{d}" for c, d in zip(node, dom, strict=True)),
                   user_home=node.astype(np.int64), user_weight=mass[node, dom] / mass[node, dom].sum(),
                   user_domain=dom.astype(np.int64), comm_s=model.rt[node])


def _relocated_start(problem: PlanProblem, model: PathModel, hosts: np.ndarray, fillable: np.ndarray,
                     rounds: int, near: int | None = None) -> np.ndarray:
    """Re-solve the successive decomposition for where tokens are (`location_problem`) while that lowers the
    objective, at most `rounds` times."""
    best, best_s = hosts, model.expected_latency(hosts)
    for _ in range(rounds):
        cand = _successive_start(location_problem(problem, model, best), fillable, near)
        cand_s = model.expected_latency(cand)
        if cand_s >= best_s * (1 - 1e-9):
            break
        best, best_s = cand, cand_s
    return best


def _two_stage(problem: PlanProblem, groups: SimilarityGroups, s: OrderMoESettings) -> tuple[np.ndarray, str]:
    """The two-stage ablation: representative coverage, then redundant deployment (settings `s`, fill resolved)."""
    cover, eta, gamma, rep_weight = s.cover, s.eta, s.gamma, s.rep_weight
    if cover is None:
        cover = "dominants" if problem.is_cloud.any() else "all"
    if cover not in {"all", "dominants", "none"}:
        raise EdgeMoEError(f"ordermoe: cover={cover!r}; expected 'all', 'dominants' or 'none'")
    fillable = fillable_nodes(problem, s.fill)
    load = node_load(problem, fillable)
    freq = np.einsum("u,ule->le", problem.user_weight, problem.user_freq())
    rep = representativeness(groups, freq, problem.profile.sim)
    weight = freq * (1.0 + rep)
    hosts = representative_coverage(problem, groups, weight, fillable, load, eta, cover)
    if s.redundancy:
        redundant_deployment(problem, groups, hosts, fillable, load, weight, 1.0 + rep_weight * rep, gamma)
    return hosts, cover


def _make_groups(problem: PlanProblem, s: OrderMoESettings) -> SimilarityGroups:
    """The similarity groups of settings `s` (grouping and its thresholds)."""
    grouping, theta_hi, theta_lo, theta = s.grouping, s.theta_hi, s.theta_lo, s.theta
    groups_per_layer, max_group_size, max_err = s.groups_per_layer, s.max_group_size, s.max_err
    if grouping == "layer-aware":
        return groups_for(problem.profile, "layer-aware", theta_hi=theta_hi, theta_lo=theta_lo,
                          max_group_size=max_group_size)
    if grouping == "uniform":
        return groups_for(problem.profile, "uniform", theta=0.5 * (theta_hi + theta_lo) if theta is None else theta,
                          max_group_size=max_group_size)
    if grouping == "fixed":
        count = max(1, problem.profile.E // 2) if groups_per_layer is None else groups_per_layer
        return groups_for(problem.profile, "fixed", groups_per_layer=count, max_group_size=max_group_size)
    if grouping == "error":
        return groups_for(problem.profile, "error", max_err=max_err, max_group_size=max_group_size)
    raise EdgeMoEError(f"ordermoe: grouping={grouping!r}; expected 'layer-aware', 'uniform', 'fixed' or 'error'")
