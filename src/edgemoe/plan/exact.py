"""Exact placement by integer linear programming (scipy.optimize.milp / HiGHS), for small instances.

Variables: x[n, l, e] in {0, 1} for every cache node (edge server or device); for each (user u, expert
(l, e)) that u activates, assignment fractions y[u, l, e, o] over the options o = cache nodes u may use
(and that beat the base) plus the base (cloud, or the miss penalty): sum_o y = 1, y[.., n] <= x[n, l, e].
The call latency is z[u, l, e] = sum_o t_o y_o; at an optimum y picks the fastest cached option.

Objectives:
- "slimcaching" (default): SlimCaching's expected latency with the max over the K parallel calls,
  linearised by one variable T[u, l, m] per (user, observed Top-K set, layer) with T >= z[u, l, e] for
  each member e, minimising sum w_u P_u(m) T.
- coverage (default: exactly when there is no cloud): every expert on at least one edge server,
  sum_n x[n, l, e] >= 1 over edge servers (a device copy serves only its owner).
- "sum": expected total call latency, sum_u w_u sum_{l,e} p_u(l, e) z[u, l, e] (each remote call counts;
  the coverage / OrderMoE-style objective, and equal to "slimcaching" when K = 1).

Solvers (`solver`; "auto" chooses by the program's size, never by a clock):
- "milp" (programs up to `milp_max_nonzeros` constraint nonzeros under "auto"): HiGHS's branch and bound.
  It stops when the relative MIP gap is <= `mip_rel_gap` (proven optimal within it) or after `node_limit`
  branch-and-bound nodes, whichever comes first; HiGHS's MIP search is deterministic, so the same problem
  and limits give the same placement, bound and gap on any machine at any load.
- "lp-round" (larger programs): the LP relaxation by interior point (HiGHS IPM with crossover, a fixed
  sequence of steps), its optimum reported as the lower bound, and its x rounded to a placement
  (`round_fractional`: each node keeps its experts in decreasing x while they fit; then the edge coverage
  repair when coverage is on). The gap is (rounded objective - LP bound) / rounded objective. At paper scale
  HiGHS does not finish the MILP's root node in 120 s (bench/results/exact_stop.json) while the IPM solves
  the LP in ~18 s of CPU, so a node limit would not stop the MILP deterministically there.
`time_limit` (wall-clock seconds) is only a safety cap against runaway solves. "milp": when it is what
stopped the solver, the result depends on machine speed and load, and `params["stopped_by"] ==
"time_limit"`, `params["deterministic"] is False` say so. "lp-round": hitting it is an error (nothing is
returned that a slower machine would have answered differently).
"""

from __future__ import annotations

import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_matrix, vstack

from edgemoe.errors import EdgeMoEError

from .base import Placement, PlanProblem, empty_hosts, make_placement, register
from .nodes import cache_nodes, cover_edges, resolve_coverage
from .objective import expected_latency, expert_latency, marginal_prob, require_servable, slim_model

OBJECTIVES = ("slimcaching", "sum")
SOLVERS = ("auto", "milp", "lp-round")
# "auto" solves programs above this many constraint nonzeros as LP bound + rounding. Measured on both sides:
# HiGHS did not finish the root node of Mixtral-8x7B's program on device-edge-cloud (280k nonzeros) in 1800 s
# (bench/results/out_of_sample.json) nor on testbed8 (393k) in 120 s (bench/results/exact_stop.json), so no
# node budget stops branch and bound there; the device-edge-cloud preset (113k) and the tests' programs
# (thousands) stay on the MILP, which proves them optimal.
MILP_MAX_NONZEROS = 250_000
NODE_LIMIT = 10_000  # default branch-and-bound node budget (deterministic)
MAX_NONZEROS = 20_000_000  # `exact`'s cap on the program's constraint nonzeros (~2 GB to build; see program_size)
LP_MAX_NONZEROS = 1_000_000  # the LP start's cap: it is meant to cost seconds to a minute (280k nonzeros: 27 s)
TIME_LIMIT_S = 600.0  # default wall-clock safety cap (seconds); not meant to bind


class _Builder:
    """Collects variables, sparse rows and the cost vector of a MILP."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def var(self, cost: float = 0.0, upper: float = 1.0, integer: bool = False) -> int:
        self.cost.append(cost)
        self.upper.append(upper)
        self.integer.append(int(integer))
        return len(self.cost) - 1

    def row(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        r = len(self.lo)
        for col, val in coefs.items():
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lo.append(lo)
        self.hi.append(hi)

    def matrix(self):
        """The constraint rows as a CSR matrix [rows, columns]."""
        return coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), len(self.cost))).tocsr()

    def solve(self, node_limit: int, mip_rel_gap: float, time_limit: float):
        A = self.matrix()
        return milp(
            c=np.array(self.cost), integrality=np.array(self.integer),
            bounds=Bounds(np.zeros(len(self.cost)), np.array(self.upper)),
            constraints=LinearConstraint(A, np.array(self.lo), np.array(self.hi)),
            options={"node_limit": int(node_limit), "mip_rel_gap": float(mip_rel_gap), "time_limit": float(time_limit)},
        )

    def solve_lp(self, time_limit: float):
        """The program with every variable continuous, by HiGHS's interior point method (with crossover to a
        vertex): about twice as fast as dual simplex here (4.5 vs 8.3 s on the device-edge-cloud preset)."""
        A = self.matrix()
        lo, hi = np.array(self.lo), np.array(self.hi)
        eq = lo == hi
        upper, lower = ~eq & np.isfinite(hi), ~eq & np.isfinite(lo)
        return linprog(np.array(self.cost), A_ub=vstack([A[upper], -A[lower]]), b_ub=np.concatenate([hi[upper], -lo[lower]]),
                       A_eq=A[eq], b_eq=lo[eq], bounds=np.column_stack([np.zeros(len(self.cost)), self.upper]),
                       method="highs-ipm", options={"time_limit": float(time_limit)})


@register("exact")
def exact(problem: PlanProblem, *, objective: str = "slimcaching", solver: str = "auto", node_limit: int = NODE_LIMIT,
          mip_rel_gap: float = 1e-6, time_limit: float = TIME_LIMIT_S, coverage: bool | None = None,
          max_nonzeros: float = MAX_NONZEROS, milp_max_nonzeros: float = MILP_MAX_NONZEROS,
          lp_max_nonzeros: float = LP_MAX_NONZEROS) -> Placement:
    """Optimal placement for `objective` in OBJECTIVES, or the best found within `node_limit` nodes, or (large
    programs) the rounded LP relaxation with the LP bound.

    solver: "milp", "lp-round" or "auto" (programs over `milp_max_nonzeros` constraint nonzeros take
    "lp-round", the others "milp"; module docstring). mip_rel_gap: stop once proven optimal within this
    relative gap. node_limit: branch-and-bound nodes (deterministic). time_limit: wall-clock safety cap in
    seconds only (module docstring). coverage: require an edge-server copy of every expert; default (None)
    exactly when there is no cloud. max_nonzeros: refuse (EdgeMoEError) a program with more constraint
    nonzeros than this (`program_size`); lp_max_nonzeros: the same for "lp-round" (its LP is meant to cost
    seconds to a minute; Qwen1.5-MoE on testbed8, 15.6M nonzeros, is refused).

    Placement.params reports the solver used, the solver status, `stopped_by` ("optimal", "node_limit",
    "time_limit", "lp_rounding" or "other"), `proven_optimal` (optimality proven within mip_rel_gap),
    `deterministic`, the gap, the dual bound (`mip_dual_bound`, a lower bound on the ILP objective, same
    units; the LP optimum for "lp-round") and the objective value.
    """
    if objective not in OBJECTIVES:
        raise EdgeMoEError(f"exact: objective={objective!r}; expected one of {OBJECTIVES}")
    if solver not in SOLVERS:
        raise EdgeMoEError(f"exact: solver={solver!r}; expected one of {SOLVERS}")
    start = time.perf_counter()
    cover = resolve_coverage(problem, coverage)
    _, nnz = check_program_size(problem, objective, cover, max_nonzeros, "exact")
    if solver == "auto":
        solver = "lp-round" if nnz > milp_max_nonzeros else "milp"
    if solver == "lp-round":
        check_program_size(problem, objective, cover, lp_max_nonzeros, "exact solver='lp-round'", "lp_max_nonzeros")
    b, x = build_program(problem, objective, cover)
    if solver == "lp-round":
        return _lp_round(problem, b, x, objective, cover, mip_rel_gap, time_limit, start)
    res = b.solve(node_limit, mip_rel_gap, time_limit)
    stopped_by = stop_reason(res)
    if res.x is None:
        raise EdgeMoEError(f"exact: no feasible placement found (stopped by {stopped_by}: node_limit={node_limit}, "
                           f"time_limit={time_limit}s safety cap; {res.message})")
    hosts = empty_hosts(problem)
    for (n, layer, e), col in x.items():
        hosts[n, layer, e] = res.x[col] > 0.5
    return make_placement(
        problem, "exact", hosts, objective=objective, solver="milp", node_limit=node_limit, mip_rel_gap=mip_rel_gap,
        time_limit=time_limit, coverage=cover, status=int(res.status), stopped_by=stopped_by,
        optimal=bool(res.status == 0), proven_optimal=bool(res.status == 0), deterministic=stopped_by != "time_limit",
        mip_node_count=None if getattr(res, "mip_node_count", None) is None else int(res.mip_node_count),
        message=str(res.message),
        mip_gap=None if getattr(res, "mip_gap", None) is None else float(res.mip_gap),
        mip_dual_bound=None if getattr(res, "mip_dual_bound", None) is None else float(res.mip_dual_bound),
        ilp_objective=float(res.fun), objective_s=expected_latency(problem, hosts),
        num_variables=len(b.cost), num_constraints=len(b.lo), plan_seconds=time.perf_counter() - start,
    )


def program_size(problem: PlanProblem, objective: str = "slimcaching", cover: bool = False) -> tuple[int, int]:
    """(columns, constraint nonzeros) of `build_program`'s MILP, counted from the problem without building it:
    an x column per (cache node, layer, expert) and its capacity row entry (coverage: one more per edge
    server); per (user, layer, expert) the user activates, a base column and one per cache node faster than
    the base (each with a 2-entry link row), and their sum row; with the "slimcaching" objective, per (user,
    layer, observed Top-K set) one T column and a row per member over that member's columns."""
    model = slim_model(problem)
    L, E = problem.expert_bytes.shape
    nodes = cache_nodes(problem)
    edges = sum(1 for n in nodes if problem.node_kind[n] == "edge")
    faster = sum((model.node_call(n) < model.base_call).astype(np.int64) for n in nodes)  # [U, L, E]
    active = marginal_prob(model, E) > 0
    cols = int((active * (1 + faster)).sum()) + len(nodes) * L * E
    nnz = int((active * (1 + 3 * faster)).sum()) + (len(nodes) + (edges if cover else 0)) * L * E
    if objective == "slimcaching":
        for layer, ls in enumerate(model.layers):
            prob = ls.prob[model.domain] > 0  # [U, M]
            per_slot = np.concatenate([2 + faster[:, layer], np.zeros((faster.shape[0], 1), np.int64)], axis=1)
            per_set = per_slot[:, ls.sets].sum(axis=2)  # [U, M] (padding slots: 0)
            cols += int(prob.sum())
            nnz += int((prob * per_set).sum())
    return cols, nnz


def _lp_round(problem: PlanProblem, b: _Builder, x: dict, objective: str, cover: bool, mip_rel_gap: float,
              time_limit: float, start: float) -> Placement:
    """`exact`'s "lp-round" solver on the built program (b, x): LP bound, rounded placement, gap."""
    res = b.solve_lp(time_limit)
    if res.status == 1 or "time limit" in str(res.message).lower():
        raise EdgeMoEError(f"exact: the LP relaxation did not finish within the time_limit={time_limit} s safety cap "
                           "(a guard, not a stopping rule: raise time_limit; the answer never depends on it)")
    if res.status != 0 or res.x is None:
        raise EdgeMoEError(f"exact: HiGHS did not solve the LP relaxation (status {res.status}: {res.message})")
    frac = np.zeros(problem.capacity_bytes.shape + problem.expert_bytes.shape)
    for (n, layer, e), col in x.items():
        frac[n, layer, e] = min(max(res.x[col], 0.0), 1.0)
    hosts = round_fractional(problem, frac)
    if cover:
        cover_edges(problem, hosts)
    value = program_objective(problem, objective, hosts)
    bound = float(res.fun)
    gap = max(value - bound, 0.0) / value if value > 0 else 0.0
    proven = bool(gap <= mip_rel_gap)
    return make_placement(
        problem, "exact", hosts, objective=objective, solver="lp-round", mip_rel_gap=mip_rel_gap,
        time_limit=time_limit, coverage=cover, status=int(res.status), stopped_by="lp_rounding",
        optimal=proven, proven_optimal=proven, deterministic=True, mip_node_count=0, message=str(res.message),
        mip_gap=gap, mip_dual_bound=bound, lp_bound=bound, ilp_objective=value,
        objective_s=expected_latency(problem, hosts), num_variables=len(b.cost), num_constraints=len(b.lo),
        plan_seconds=time.perf_counter() - start,
    )


def program_objective(problem: PlanProblem, objective: str, hosts: np.ndarray) -> float:
    """The ILP's objective value of integral hosts [N, L, E]: SlimCaching's expected latency ("slimcaching")
    or the expected total call latency ("sum")."""
    if objective == "slimcaching":
        return expected_latency(problem, hosts)
    model = slim_model(problem)
    tau = expert_latency(model, hosts)  # [U, L, E]
    return float(np.einsum("u,ule,ule->", model.weight, marginal_prob(model, tau.shape[2]), tau))


def round_fractional(problem: PlanProblem, frac: np.ndarray) -> np.ndarray:
    """hosts [N, L, E] from a fractional placement frac [N, L, E] (e.g. the LP relaxation's x): each cache node
    takes its experts in decreasing frac (ties: lower layer, then expert, first), skipping those that no longer
    fit, and none with frac 0."""
    hosts = empty_hosts(problem)
    sizes = np.asarray(problem.expert_bytes, dtype=np.int64).ravel()
    for n in cache_nodes(problem):
        free = int(problem.capacity_bytes[n])
        row = frac[n].ravel()
        for i in np.argsort(-row, kind="stable"):
            if row[i] <= 0:
                break
            if sizes[i] <= free:
                hosts[n].flat[i] = True
                free -= int(sizes[i])
    return hosts


def check_program_size(problem: PlanProblem, objective: str, cover: bool, max_nonzeros: float, method: str,
                       knob: str = "max_nonzeros") -> tuple[int, int]:
    """Raise EdgeMoEError when the MILP would have more than max_nonzeros constraint nonzeros: it is built in
    Python lists first (~100 bytes a nonzero) and HiGHS's root LP grows faster than its size. Returns
    `program_size`'s (columns, nonzeros)."""
    cols, nnz = program_size(problem, objective, cover)
    if nnz > max_nonzeros:
        raise EdgeMoEError(
            f"{method}: the program would have {nnz:,} constraint nonzeros and {cols:,} columns, over {knob}="
            f"{max_nonzeros:,.0f} ({problem.profile.L} layers x {problem.profile.E} experts, top-{problem.profile.K}, "
            f"{len(problem.user_names)} users: one column per user, layer and observed Top-K set); use slimcaching "
            f"(default warm start) at this size, or raise {knob} if the memory and time are there")
    return cols, nnz


def build_program(problem: PlanProblem, objective: str, cover: bool) -> tuple[_Builder, dict]:
    """(the MILP of the module docstring, x: (node, layer, expert) -> its column)."""
    model = slim_model(problem)
    L, E = problem.expert_bytes.shape
    nodes = cache_nodes(problem)
    b = _Builder()
    x = {(int(n), layer, e): b.var(integer=True) for n in nodes for layer in range(L) for e in range(E)}
    # Per-node storage in units of the gcd of the expert sizes (one unit per expert when sizes are equal):
    # exactly the byte constraint (integer sizes, capacity rounded down to whole units), without the
    # coefficients ~3e7 and right-hand sides ~2e9 of bytes that HiGHS flags as badly scaled.
    unit = max(int(np.gcd.reduce(problem.expert_bytes.ravel().astype(np.int64))), 1)
    for n in nodes:
        b.row({x[int(n), layer, e]: float(problem.expert_bytes[layer, e] // unit) for layer in range(L) for e in range(E)},
              -np.inf, float(int(problem.capacity_bytes[n]) // unit))
    require_servable(problem, "exact", cover)
    edge_nodes = [int(n) for n in nodes if problem.node_kind[n] == "edge"]
    if cover and edge_nodes:  # every expert reachable: at least one edge copy
        for layer in range(L):
            for e in range(E):
                b.row({x[n, layer, e]: 1.0 for n in edge_nodes}, 1.0, np.inf)
    calls = {int(n): model.node_call(n) for n in nodes}
    marginal = marginal_prob(model, E)  # [U, L, E]
    z: dict[tuple[int, int, int], dict[int, float]] = {}  # (u, l, e) -> {y column: seconds}
    for u in range(model.num_users):
        for layer in range(L):
            for e in np.flatnonzero(marginal[u, layer] > 0):
                base = float(model.base_call[u, layer, e])
                terms = {b.var(): base}
                for n in nodes:
                    t = float(calls[int(n)][u, layer, e])
                    if t < base:
                        col = b.var()
                        terms[col] = t
                        b.row({col: 1.0, x[int(n), layer, int(e)]: -1.0}, -np.inf, 0.0)
                b.row(dict.fromkeys(terms, 1.0), 1.0, 1.0)
                z[u, layer, int(e)] = terms
    for (u, layer, e), terms in z.items():
        if objective == "sum":
            mass = float(model.weight[u] * marginal[u, layer, e])
            for col, t in terms.items():
                b.cost[col] += mass * t
    if objective == "slimcaching":
        for u in range(model.num_users):
            for layer, ls in enumerate(model.layers):
                prob = ls.prob[model.domain[u]]
                for m in np.flatnonzero(prob > 0):
                    members = [int(e) for e in ls.sets[m] if e < E]
                    if not members:
                        continue
                    top = b.var(cost=float(model.weight[u] * prob[m]), upper=np.inf)
                    for e in members:
                        b.row({top: 1.0, **{col: -t for col, t in z[u, layer, e].items()}}, 0.0, np.inf)
    return b, x


def lp_relaxation(problem: PlanProblem, *, objective: str = "slimcaching", coverage: bool | None = None,
                  time_limit: float = TIME_LIMIT_S, max_nonzeros: float = LP_MAX_NONZEROS) -> tuple[np.ndarray, float]:
    """(x [N, L, E] in [0, 1], bound): the ILP with x relaxed to [0, 1], solved by HiGHS (deterministic).

    bound: the LP optimum, a lower bound on every placement's `objective` (expected latency for
    "slimcaching"). Rows of nodes that cache nothing (the cloud) are 0. time_limit: wall-clock safety cap.
    max_nonzeros: refuse (EdgeMoEError) a program larger than this (`program_size`).
    """
    if objective not in OBJECTIVES:
        raise EdgeMoEError(f"lp_relaxation: objective={objective!r}; expected one of {OBJECTIVES}")
    cover = resolve_coverage(problem, coverage)
    check_program_size(problem, objective, cover, max_nonzeros, "slimcaching warm_start='lp'", "lp_max_nonzeros")
    b, x = build_program(problem, objective, cover)
    res = b.solve_lp(time_limit)
    if res.status != 0 or res.x is None:
        raise EdgeMoEError(f"lp_relaxation: HiGHS did not solve the LP (status {res.status}: {res.message})")
    frac = np.zeros(problem.capacity_bytes.shape + problem.expert_bytes.shape)
    for (n, layer, e), col in x.items():
        frac[n, layer, e] = min(max(res.x[col], 0.0), 1.0)
    return frac, float(res.fun)


def stop_reason(res) -> str:
    """Why HiGHS stopped: "optimal" (within mip_rel_gap), "node_limit", "time_limit" or "other".

    scipy reports HiGHS's node limit as status 4 with HiGHS status 16 ("Solution limit reached") in the
    message, and the time limit as status 1.
    """
    if res.status == 0:
        return "optimal"
    message = str(res.message).lower()
    if "time limit" in message:
        return "time_limit"
    if "solution limit" in message or "node limit" in message:
        return "node_limit"
    return "other"
