"""SlimCaching: latency-optimal expert caching on user devices and edge servers (ALGORITHMS.md §2).

K = 1: lazy greedy, best of ratio and plain rules (`slimcaching.k1`).
K >= 1: successive per-node decomposition (§2.5.2). Every cache node is one block: by default first the
edge servers by descending covered weight (sum of the weights of users that can reach them), then each
user's device (users by descending weight), so devices add the user's most-needed experts on top of
what the edge already serves (devices first loses: with K >= 2 a lone device expert saves nothing while
its partner still comes from the cloud; measured in docs/planners-slimcaching.md). Each block is solved with every other cache held fixed: per-layer
subset values (`slimcaching.values`), combined across layers by max-convolution (`maxconv`). Devices and edge
servers are therefore decided together, each seeing the others' caches; `passes > 1` revisits every block
(block-coordinate ascent) until the objective stops improving. One pass is the paper-faithful setting
(`refine=False`); by default the passes are followed by `slimcaching.refine`'s settle-and-kick local search.
Without a cloud every expert keeps an edge-server copy (`cover_edges`, sole copies fixed in later blocks).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from edgemoe.errors import EdgeMoEError

from ..base import Placement, PlanProblem, empty_hosts, make_placement, register
from ..exact import LP_MAX_NONZEROS, lp_relaxation, round_fractional  # noqa: F401 (round_fractional re-exported)
from ..nodes import cache_nodes, cover_edges, resolve_coverage
from ..objective import (
    SlimModel,
    charged_model,
    charged_objective,
    expected_latency,
    expert_latency,
    latency_per_user_from_tau,
    node_charge,
    require_covered,
    require_servable,
    serving_charge,
    slim_model,
)
from .k1 import greedy_k1, slimcaching_k1
from .maxconv import solve_layers
from .refine import SolverSettings, dp_work, sole_copies
from .refine import refine as refine_hosts
from .values import capacity_grid, capacity_units, free_units, gain_pairs, set_gains, value_table  # noqa: F401 (capacity_units re-exported)

ORDERS = ("edge-first", "devices-first", "covered-weight")
REFINE_WORK_PASSES = 0.25  # default refinement work cap: a quarter of one pass's work ...
MAX_UNITS = 1024  # finest capacity grid: rounding each expert up to a unit wastes < 0.1% of a node per expert
REFINE_MIN_WORK = 200_000  # ... but at least this many user-set cells (small instances run all their kicks)


def block_order(problem: PlanProblem, model: SlimModel, order: str) -> list[int]:
    """Cache nodes in the order the decomposition visits them (see module docstring and docs)."""
    if order not in ORDERS:
        raise EdgeMoEError(f"slimcaching: order={order!r}; expected one of {ORDERS}")
    nodes = cache_nodes(problem)
    covered = {int(n): float(model.weight[model.node_users(n)].sum()) for n in nodes}
    kinds = problem.node_kind
    by_weight = sorted(nodes.tolist(), key=lambda n: (-covered[n], n))
    if order == "covered-weight":
        return by_weight
    devices = [n for n in by_weight if kinds[n] == "device"]
    edges = [n for n in by_weight if kinds[n] == "edge"]
    return devices + edges if order == "devices-first" else edges + devices


def _layer_key(layer: int, users: np.ndarray, capacity: int, *arrays) -> tuple:
    """Memo key of one layer's value table: the layer, the users, the capacity and a digest of the arrays it is
    computed from (blake2b, 32 bytes: the arrays themselves would hold megabytes per block)."""
    h = hashlib.blake2b(digest_size=32)
    for a in arrays:
        h.update(b"-" if a is None else np.ascontiguousarray(a).tobytes())
    return layer, users.tobytes(), capacity, h.digest()


def solve_block(model: SlimModel, tau: np.ndarray, call: np.ndarray, users: np.ndarray, capacity: int,
                units: np.ndarray, maxconv: str, epsilon: float, enum_max: int, beam_width: int,
                chg: np.ndarray | None = None, call_chg: np.ndarray | None = None, pairs: dict | None = None,
                memo: dict | None = None):
    """Best cache [L, E] bool of one node with the others fixed.

    tau, call: [U_n, L, E] seconds for the node's users without it / on it; chg, call_chg: [U_n, L, E] their
    remote-call charges (None: the paper's objective). pairs: a dict kept across calls for each layer's
    `gain_pairs` of these users (they depend on nothing else). memo: a dict kept across calls of each layer's
    value table by its inputs (`_layer_key`): a later pass re-solves a block whose layer saw no change in the
    other nodes' caches with the same inputs, and a table is a pure function of them. Returns (held, info).
    """
    L, E = units.shape
    tables = np.zeros((L, capacity + 1))
    picks = []
    exact = True
    for layer in range(L):
        sets = model.layers[layer].sets
        lc, cc = (None, None) if chg is None else (chg[:, layer], call_chg[:, layer])
        memo_key = None if memo is None else _layer_key(layer, users, capacity, tau[:, layer], call[:, layer], lc,
                                                          cc, units[layer])
        if memo_key is not None and memo_key in memo:
            candidates, table, pick, table_exact = memo[memo_key]
        else:
            key = (layer, users.tobytes())
            if pairs is None or key not in pairs:
                found = gain_pairs(model.user_set_prob(layer)[users], model.weight[users], sets, E)
                if pairs is not None:
                    pairs[key] = found
            else:
                found = pairs[key]
            g = set_gains(tau[:, layer], call[:, layer], None, None, sets, lc, cc, pairs=found)
            table, pick, table_exact = value_table(g, units[layer, g.candidates], capacity, enum_max, beam_width)
            candidates = g.candidates
            if memo_key is not None:
                memo[memo_key] = (candidates, table, pick, table_exact)
        tables[layer] = table
        picks.append((candidates, pick))
        exact &= table_exact
    budgets, method = solve_layers(tables, maxconv, epsilon)
    held = np.zeros((L, E), bool)
    for layer, (cands, pick) in enumerate(picks):
        held[layer, cands[pick[budgets[layer]]]] = True
    return held, {"method": method, "exact_tables": exact, "value": float(tables[np.arange(L), budgets].sum())}


def successive(problem: PlanProblem, model: SlimModel, passes: int = 1, order: str = "edge-first",
               maxconv: str = "auto", epsilon: float = 0.1, enum_max: int = 12, beam_width: int = 8,
               max_units: int = MAX_UNITS, start: np.ndarray | None = None,
               coverage: bool = False, near: int | None = None) -> tuple[np.ndarray, dict]:
    """Successive per-node decomposition from `start` hosts [N, L, E] (default: empty caches).

    With `coverage`, every pass ends with `cover_edges`, and later passes keep each edge server's sole
    copies (they are fixed in its block and its capacity shrinks by their size).
    near: when set, a node's block weighs only the users that have it among their `near` nearest cache nodes
    (`nearest_users`): each block then costs about the same whatever the cluster's size, so a pass is
    linear in the number of nodes instead of quadratic (None: every user that may use the node, the paper's).
    Returns (hosts [N, L, E], info).
    """
    hosts = empty_hosts(problem) if start is None else start.copy()
    tau = expert_latency(model, hosts)  # [U, L, E]
    chg = serving_charge(model, hosts)  # [U, L, E] or None (paper objective)
    blocks = block_order(problem, model, order)
    users_of = {n: model.node_users(n) for n in blocks}
    if near is not None:
        users_of = nearest_users(problem, users_of, near)
    calls = {n: model.node_call(n)[users_of[n]] for n in blocks}
    call_chg = {n: node_charge(model, n, users_of[n]) for n in blocks}
    methods: dict[str, int] = {}
    all_exact = True
    pairs: dict = {}  # each block's (user, set) pairs per layer, the same in every pass
    memo: dict = {}  # each block's value tables by their inputs: a pass repeats many of the last one's
    history = [charged_objective(model, tau, chg)]
    best_hosts = hosts.copy()
    for _ in range(passes):
        for n in blocks:
            users = users_of[n]
            if users.size == 0:
                continue
            fixed = (sole_copies(hosts, model.edge_nodes, n) if coverage and n in model.edge_nodes \
                else np.zeros_like(hosts[n]))
            if hosts[n].any():  # a later pass: take the node's own cache out before re-solving it
                hosts[n] = fixed
                tau[users] = expert_latency(model, hosts, users)
                if chg is not None:
                    chg[users] = serving_charge(model, hosts, users)
            unit, grid, units = capacity_grid(problem.expert_bytes, int(problem.capacity_bytes[n]), max_units)
            room = min(free_units(problem.capacity_bytes[n], problem.expert_bytes[fixed].sum(), unit), grid)
            held, info = solve_block(model, tau[users], calls[n], users, room, units, maxconv, epsilon, enum_max,
                                     beam_width, None if chg is None else chg[users], call_chg[n], pairs, memo)
            methods[info["method"]] = methods.get(info["method"], 0) + 1
            all_exact &= info["exact_tables"]
            hosts[n] = held | fixed
            served = np.where(held[None], calls[n], np.inf)
            if chg is not None:
                chg[users] = np.where(served < tau[users], call_chg[n], chg[users])
            tau[users] = np.minimum(tau[users], served)
        if coverage:
            cover_edges(problem, hosts)
            tau, chg = expert_latency(model, hosts), serving_charge(model, hosts)
        history.append(charged_objective(model, tau, chg))
        if history[-1] <= min(history[:-1]):
            best_hosts = hosts.copy()
        if history[-1] >= history[-2] * (1 - 1e-9):
            break  # no further improvement: later passes would repeat the same solutions
    info = {"algorithm": "successive", "order": order, "passes": passes, "passes_run": len(history) - 1,
            "objective_by_pass_s": history, "maxconv_used": methods, "exact_tables": all_exact}
    return best_hosts, info


def nearest_users(problem: PlanProblem, users_of: dict[int, np.ndarray], near: int) -> dict[int, np.ndarray]:
    """{node: users} kept to the users that have the node among their `near` nearest cache nodes by round
    trip (comm_s; ties by index), out of users_of {node: [U_n] users that may use it}."""
    nodes = np.array(sorted(users_of), dtype=np.int64)
    comm = np.asarray(problem.comm_s, dtype=np.float64)[:, nodes]  # [U, N']
    may = np.zeros(comm.shape, bool)
    for j, n in enumerate(nodes):
        may[users_of[int(n)], j] = True
    rank = np.argsort(np.where(may, comm, np.inf), axis=1, kind="stable")[:, :max(1, int(near))]
    chosen = np.zeros(comm.shape, bool)
    np.put_along_axis(chosen, rank, True, axis=1)
    chosen &= may
    return {int(n): np.flatnonzero(chosen[:, j]) for j, n in enumerate(nodes)}


def refine_blocks(problem: PlanProblem, model: SlimModel, hosts: np.ndarray, order: str, settings: SolverSettings,
                  cover: bool, kicks: int, forced: int, seed: int, refine_work: float,
                  max_units: int) -> tuple[np.ndarray, dict]:
    """`slimcaching.refine.refine` with the work cap max(refine_work x one pass's work, REFINE_MIN_WORK)."""

    def units_of(node: int):
        return capacity_grid(problem.expert_bytes, int(problem.capacity_bytes[node]), max_units)

    blocks = block_order(problem, model, order)
    L = problem.expert_bytes.shape[0]
    pass_work = sum(model.node_users(n).size for n in blocks) * sum(ls.sets.shape[0] for ls in model.layers) \
        + sum(dp_work(L, units_of(n)[1]) for n in blocks)
    max_work = max(refine_work * pass_work, REFINE_MIN_WORK) if refine_work > 0 else 0.0
    return refine_hosts(problem, model, cover_edges(problem, hosts) if cover else hosts, blocks, units_of, settings,
                        cover, kicks, forced, seed, max_work)


WARM_STARTS = ("empty", "sum-greedy", "lp")


def placement_objective(model: SlimModel, hosts: np.ndarray) -> float:
    """The (charged) objective of hosts [N, L, E]: what the passes and the refinement minimise."""
    return charged_objective(model, expert_latency(model, hosts), serving_charge(model, hosts))


def warm_start_hosts(problem: PlanProblem, model: SlimModel, warm_start: str, cover: bool,
                     lp_max_nonzeros: float = LP_MAX_NONZEROS) -> tuple[np.ndarray | None, dict]:
    """(start hosts or None for empty, facts for the params) of a `warm_start` in WARM_STARTS."""
    if warm_start == "sum-greedy":
        return greedy_k1(problem, model, "ratio"), {}
    if warm_start == "lp":
        frac, bound = lp_relaxation(problem, coverage=cover, max_nonzeros=lp_max_nonzeros)
        start = round_fractional(problem, frac)
        return start, {"lp_bound_s": bound, "lp_rounded_objective_s": expected_latency(problem, start)}
    return None, {}


@dataclass(frozen=True)
class SlimCachingSettings:
    """The knobs of `slimcaching` (every one has the default `plan(problem, "slimcaching")` uses).

    Parameters:
        algorithm: "auto" (K = 1 -> "greedy-k1", then with `refine` the block passes and the refinement started
            from its result, the better kept; else "successive"), "greedy-k1" or "successive"
        passes: rounds over all blocks (1 = paper-faithful)
        order: block order, one of `ORDERS`
        maxconv: "auto" | "naive" | "concave" | "fptas" (with `epsilon`), how layers' value tables are combined
        epsilon: the FPTAS's accuracy
        enum_max: largest number of useful experts per layer whose subsets are enumerated exactly; above it a
            beam of `beam_width` is used
        beam_width: the beam's width
        max_units: finest capacity grid per node
        warm_start: (successive) "empty" (the paper's), "sum-greedy" (K = 1 greedy on the calls' additive
            saving), or "lp": the passes start from the rounded LP relaxation of the exact ILP
            (`exact.lp_relaxation`, HiGHS; `round_fractional`), and the empty start is run too and the better
            kept. The LP couples every node's choice through the users' max over K calls, which the
            block-by-block passes cannot; it costs an LP the size of the ILP (seconds at 32 x 8 with 20 users;
            out of reach at 60 x top-4), so it is not the default. Adds `lp_bound_s` (a lower bound) to the params
        refine: (successive) after the passes, settle the blocks and run `kicks` seeded kicks of `forced` experts
            each (`slimcaching.refine`); refine=False with passes=1 is the paper-faithful variant
        kicks: the refinement's kicks
        forced: experts forced out per kick (>= 1)
        seed: the kicks' seed
        refine_work: caps the refinement's work in deterministic units: the value tables it builds may cover at
            most max(refine_work x one pass's, REFINE_MIN_WORK) user-set cells (a node with U_n users at a layer
            with M distinct Top-K sets is U_n x M cells); inf: kicks only. Whichever budget runs out first stops
            it, with the best placement so far: the result depends on input and seed only
        k1_seeds: (greedy-k1, unequal sizes) partial enumeration with seeds of up to k1_seeds items per node ...
        k1_max_seeds: ... fewer when a node would need more than k1_max_seeds seeds (`slimcaching.k1`)
        coverage: give every expert an edge-server copy; None: exactly when there is no cloud
        remote_charge: the load-aware variant (objective.charged_model): every call sent to an edge server n other
            than the user's home also costs factor_n x its service time there; a number (every node), one per
            node, or "home-load" (rho / (1 - rho) from the demand homed at each node). The passes and the
            refinement optimise that charged objective (K = 1: the greedy start stays the paper's); 0 is the
            paper's objective. It needs passes > 1 to act on blocks solved before the nodes their misses go to
            (docs/planners-slimcaching.md, "Remote-call charge")
        lp_max_nonzeros: a larger LP (warm_start="lp") is refused with an error (`exact.check_program_size`)
    """

    algorithm: str = "auto"
    passes: int = 1
    order: str = "edge-first"
    maxconv: str = "auto"
    epsilon: float = 0.1
    enum_max: int = 12
    beam_width: int = 8
    max_units: int = MAX_UNITS
    warm_start: str = "empty"
    refine: bool = True
    kicks: int = 256
    forced: int = 2
    seed: int = 0
    refine_work: float = REFINE_WORK_PASSES
    k1_seeds: int = 3
    k1_max_seeds: int = 5000
    coverage: bool | None = None
    remote_charge: float | str | list = 0.0
    lp_max_nonzeros: float = LP_MAX_NONZEROS


@register("slimcaching")
def slimcaching(problem: PlanProblem, settings: SlimCachingSettings | None = None, **params) -> Placement:
    """SlimCaching placement of `problem` (devices and edge servers).

    Parameters:
        problem: the planning problem
        settings: the planner's knobs (default SlimCachingSettings())
        params: SlimCachingSettings fields to override, by name (what `plan(problem, "slimcaching", **params)`
            and `edgemoe plan --param` pass)

    Returns:
        placement: the hosts [N, L, E]; its params hold the settings used, the objective (`objective_s`, always
            the paper's; `charged_objective_s` beside it), the passes' and refinement's facts and plan_seconds
    """
    try:
        s = replace(settings or SlimCachingSettings(), **params)
    except TypeError:
        unknown = sorted(set(params) - {f.name for f in fields(SlimCachingSettings)})
        raise EdgeMoEError(f"slimcaching: unknown parameters {unknown}; it takes "
                           f"{[f.name for f in fields(SlimCachingSettings)]}") from None
    algorithm, passes, order, maxconv, epsilon = s.algorithm, s.passes, s.order, s.maxconv, s.epsilon
    enum_max, beam_width, max_units, warm_start, refine = s.enum_max, s.beam_width, s.max_units, s.warm_start, s.refine
    kicks, forced, seed, refine_work = s.kicks, s.forced, s.seed, s.refine_work
    coverage, remote_charge, lp_max_nonzeros = s.coverage, s.remote_charge, s.lp_max_nonzeros
    start = time.perf_counter()
    cover = resolve_coverage(problem, coverage)
    require_servable(problem, "slimcaching", cover)
    model = charged_model(slim_model(problem), problem, remote_charge)
    if warm_start not in WARM_STARTS:
        raise EdgeMoEError(f"slimcaching: warm_start={warm_start!r}; expected one of {WARM_STARTS}")
    if kicks < 0 or forced < 1 or not refine_work >= 0:
        raise EdgeMoEError(f"slimcaching: kicks and refine_work must be >= 0 and forced >= 1, got kicks={kicks}, "
                           f"refine_work={refine_work}, forced={forced}")
    polish = False
    if algorithm == "auto":
        algorithm = "greedy-k1" if problem.profile.K == 1 else "successive"
        polish = algorithm == "greedy-k1" and refine
    if algorithm in ("greedy-k1", "successive") and passes < 1:
        raise EdgeMoEError(f"slimcaching: passes must be >= 1, got {passes}")
    settings = SolverSettings(maxconv=maxconv, epsilon=epsilon, enum_max=enum_max, beam_width=beam_width)

    def improve(start_hosts: np.ndarray | None) -> tuple[np.ndarray, dict]:
        """The successive passes from start_hosts (None: empty), then the refinement if asked."""
        found, found_info = successive(problem, model, passes, order, maxconv, epsilon, enum_max, beam_width,
                                       max_units, start_hosts, cover)
        if refine:
            found, refine_info = refine_blocks(problem, model, found, order, settings, cover, kicks, forced, seed,
                                               refine_work, max_units)
            found_info.update(refine_info)
        return found, found_info

    if algorithm == "greedy-k1":
        hosts, info = slimcaching_k1(problem, model, s.k1_seeds, s.k1_max_seeds)
        if polish:
            # K = 1 blocks have modular, exact tables, so block passes from the greedy result only improve
            # it; the better of the two is kept, so the guarantee of the greedy result still holds.
            polished, polish_info = improve(hosts)
            before, after = (placement_objective(model, h) for h in (hosts, polished))
            info.update(polish_objective_s=after, greedy_objective_s=before, polished=after < before)
            if after < before:
                hosts = polished
                info.update({k: v for k, v in polish_info.items() if k.startswith(("refine", "kicks"))})
    elif algorithm == "successive":
        warm, lp_info = warm_start_hosts(problem, model, warm_start, cover, lp_max_nonzeros)
        hosts, info = improve(warm)
        if warm_start == "lp":
            # the LP start is a different basin, not a better one everywhere: the empty start's result is
            # computed too and the better kept, so the option never does worse than the default
            plain, plain_info = improve(None)
            scores = [placement_objective(model, h) for h in (hosts, plain)]
            lp_info.update(lp_start_objective_s=scores[0], empty_start_objective_s=scores[1], lp_start_kept=scores[0] <= scores[1])
            if scores[1] < scores[0]:
                hosts, info = plain, plain_info
        info.update(lp_info)
    else:
        raise EdgeMoEError(f"slimcaching: algorithm={algorithm!r}; expected auto, greedy-k1 or successive")
    if cover:
        cover_edges(problem, hosts)
        require_covered(problem, hosts, "slimcaching")
    tau = expert_latency(model, hosts)
    objective = float(model.weight @ latency_per_user_from_tau(model, tau))
    info.update(objective_s=objective, remote_charge=remote_charge if isinstance(remote_charge, (int, float, str))
                else [float(v) for v in remote_charge],
                charged_objective_s=charged_objective(model, tau, serving_charge(model, hosts)), epsilon=epsilon, maxconv=maxconv, enum_max=enum_max, beam_width=beam_width,
                refine=refine and (algorithm == "successive" or polish), coverage=cover, plan_seconds=time.perf_counter() - start)
    return make_placement(problem, "slimcaching", hosts, **info)


slimcaching.settings_class = SlimCachingSettings  # what `plan`'s parameters are checked against (plan.cli, plan.base)
