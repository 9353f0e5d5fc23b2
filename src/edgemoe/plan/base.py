"""The planner interface: a planning problem of arrays in, a placement out (pure numpy).

`PlanProblem` is what every planner sees: the routing profile plus the cost tables that the cluster's
cost model derived (`edgemoe.cluster.cost.cost_tables`, joined with the profile by
`edgemoe.plan.problem.plan_problem`). `Placement` is what every planner returns. Planners register by
name with `@register("name")` and are called through `plan(...)`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.io import atomic_write_json, read_json
from edgemoe.profile import Profile

PLACEMENT_SCHEMA = "edgemoe.placement/1"


@dataclass(frozen=True)
class PlanProblem:
    """Everything a planner needs, as arrays. N nodes, U users, L MoE layers, E experts per layer.

    Nodes include every place that can hold experts: user devices, edge servers and the cloud (a cloud
    node has `is_cloud` True and holds every expert by definition; planners never fill it).
    """

    profile: Profile  # routing statistics (freq_by_domain, topk, domain, coact, trans, sim, subst_err, ...)
    node_names: tuple[str, ...]  # [N]
    node_kind: tuple[str, ...]  # [N] "device" | "edge" | "cloud"
    capacity_bytes: np.ndarray  # [N] int64 bytes available for experts (cloud: ignored)
    user_names: tuple[str, ...]  # [U]
    user_home: np.ndarray  # [U] int node index where the user's dense part runs (device or edge server)
    user_weight: np.ndarray  # [U] float, sums to 1: share of tokens from each user
    user_domain: np.ndarray  # [U] int index into profile.meta.domains: whose routing the user follows
    comm_s: np.ndarray  # [U, N] seconds to ship one token's hidden state from the user's home to node n and back
    compute_s: np.ndarray  # [N, L, E] seconds for node n to run expert (l, e) on one token
    expert_bytes: np.ndarray  # [L, E] int64
    params: dict = field(default_factory=dict)  # free-form facts about how the tables were made
    xfer_s: np.ndarray | None = None  # [N, N] one-way seconds of one hidden state (no queue); None: unknown
    # [N] seconds of one MoE layer's dense work for one token on each node (the runtime's default estimate,
    # charged on the token's home whatever the placement); None: unknown (counted as 0)
    dense_s: np.ndarray | None = None
    # the edgemoe.cluster.schema.Cluster the tables were derived from (`plan_problem`), from which the runtime's
    # context takes the links and hardware (`runtime.context.context_from_problem`); None for a problem built
    # from arrays alone (plan.synthetic), which plans but cannot be served
    cluster: object | None = None

    @property
    def is_cloud(self) -> np.ndarray:
        """[N] bool."""
        return np.array([k == "cloud" for k in self.node_kind])

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    def call_s(self) -> np.ndarray:
        """[U, N, L, E] seconds for user u to have expert (l, e) run on node n (transfer + compute)."""
        return self.comm_s[:, :, None, None] + self.compute_s[None]

    def user_freq(self) -> np.ndarray:
        """[U, L, E] expected activations per token of each expert for each user."""
        return self.profile.freq_by_domain[self.user_domain]


@dataclass(frozen=True)
class Placement:
    """Which node holds a copy of which expert. `hosts` is [N, L, E] bool."""

    method: str
    params: dict
    node_names: tuple[str, ...]
    capacity_bytes: np.ndarray  # [N] int64
    hosts: np.ndarray  # [N, L, E] bool
    expert_bytes: np.ndarray  # [L, E] int64
    node_kind: tuple[str, ...] = ()
    # What the planner decided with, so that the runtime serves the placement the way it was planned
    # (`plan` fills both from the planner's arguments; None: the planner has no such knob, or an old file):
    # grouping {"kind": ..., "params": {...}} rebuilds the planner's groups by
    # `edgemoe.profile.groups.groups_for(profile, kind, **params)`; budget: the per-token-layer quality
    # allowance it planned for, the default budget of the policies that spend one (`runtime.make_policy`).
    grouping: dict | None = None
    budget: float | None = None

    def bytes_used(self) -> np.ndarray:
        """[N] int64 bytes of experts held by each node."""
        return (self.hosts * self.expert_bytes[None]).sum(axis=(1, 2)).astype(np.int64)

    def check_capacity(self) -> None:
        """Raise EdgeMoEError if any non-cloud node holds more bytes than its capacity."""
        used = self.bytes_used()
        for n, name in enumerate(self.node_names):
            kind = self.node_kind[n] if self.node_kind else "edge"
            if kind != "cloud" and used[n] > self.capacity_bytes[n]:
                raise EdgeMoEError(
                    f"placement {self.method!r}: node {name!r} holds {used[n]} bytes > capacity {self.capacity_bytes[n]}"
                )

    def replicas(self) -> np.ndarray:
        """[L, E] number of non-cloud copies of each expert."""
        keep = np.array([k != "cloud" for k in self.node_kind]) if self.node_kind else np.ones(len(self.node_names), bool)
        return self.hosts[keep].sum(axis=0)

    def to_json(self) -> dict:
        used = self.bytes_used()
        return {
            "schema": PLACEMENT_SCHEMA,
            "method": self.method,
            "params": self.params,
            "nodes": list(self.node_names),
            "node_kind": {n: k for n, k in zip(self.node_names, self.node_kind, strict=False)},
            "capacity_bytes": {n: int(c) for n, c in zip(self.node_names, self.capacity_bytes, strict=True)},
            "bytes_used": {n: int(u) for n, u in zip(self.node_names, used, strict=True)},
            "expert_bytes": self.expert_bytes.tolist(),
            "grouping": self.grouping,
            "budget": self.budget,
            "hosts": {
                n: [np.flatnonzero(self.hosts[i, layer]).tolist() for layer in range(self.hosts.shape[1])]
                for i, n in enumerate(self.node_names)
            },
        }

    def save(self, path: str | Path) -> Path:
        return atomic_write_json(path, self.to_json())

    def expert_map(self) -> list[dict[str, list[str]]]:
        """vLLM/SGLang-style per-layer map: for each layer, expert id -> node names holding it."""
        N, L, E = self.hosts.shape
        return [
            {str(e): [self.node_names[n] for n in range(N) if self.hosts[n, layer, e]] for e in range(E)}
            for layer in range(L)
        ]


def load_placement(path: str | Path) -> Placement:
    """Read a placement JSON written by `Placement.save`, checking schema, fields, ids and memory.

    Every problem is an EdgeMoEError naming the file and the field. `check_placement_fits` then checks
    a loaded placement against the profile and cluster it is used with.
    """
    path = Path(path)
    d = read_json(path, "placement file")
    if not isinstance(d, dict) or d.get("schema") != PLACEMENT_SCHEMA:
        got = d.get("schema") if isinstance(d, dict) else type(d).__name__
        raise EdgeMoEError(f"{path}: schema is {got!r}, expected {PLACEMENT_SCHEMA!r}")
    missing = [k for k in ("method", "nodes", "capacity_bytes", "expert_bytes", "hosts") if k not in d]
    if missing:
        raise EdgeMoEError(f"{path}: missing fields {missing}")
    nodes = d["nodes"]
    if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
        raise EdgeMoEError(f"{path}: nodes must be a non-empty list of node names")
    if len(set(nodes)) != len(nodes):
        raise EdgeMoEError(f"{path}: nodes {nodes} names a node twice")
    nodes = tuple(nodes)
    table = d["expert_bytes"]
    if (not isinstance(table, list) or not table or not all(isinstance(row, list) and row for row in table)
            or len({len(row) for row in table}) != 1
            or not all(_is_count(b, 1) for row in table for b in row)):
        raise EdgeMoEError(f"{path}: expert_bytes must be an [L][E] table of integers in [1, {MAX_BYTES}]")
    expert_bytes = np.asarray(table, dtype=np.int64)
    L, E = expert_bytes.shape
    for key in ("hosts", "capacity_bytes"):
        if not isinstance(d[key], dict) or set(d[key]) != set(nodes):
            raise EdgeMoEError(f"{path}: {key} must map exactly the nodes {list(nodes)}")
    hosts = np.zeros((len(nodes), L, E), dtype=bool)
    for i, n in enumerate(nodes):
        layers = d["hosts"][n]
        if not isinstance(layers, list) or len(layers) != L:
            raise EdgeMoEError(f"{path}: hosts[{n!r}] must list {L} layers of expert ids")
        for layer, ids in enumerate(layers):
            if not isinstance(ids, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
                raise EdgeMoEError(f"{path}: hosts[{n!r}][{layer}] must be a list of integer expert ids")
            if any(not 0 <= e < E for e in ids):
                raise EdgeMoEError(f"{path}: hosts[{n!r}][{layer}] has an expert id outside [0, {E})")
            hosts[i, layer, ids] = True
    capacity = []
    for n in nodes:
        c = d["capacity_bytes"][n]
        if not _is_count(c, 0):
            raise EdgeMoEError(f"{path}: capacity_bytes[{n!r}] is {c!r}, expected an integer in [0, {MAX_BYTES}]")
        capacity.append(c)
    kinds = d.get("node_kind", {})
    if not isinstance(kinds, dict) or any(k not in ("device", "edge", "cloud") for k in kinds.values()):
        raise EdgeMoEError(f"{path}: node_kind must map node names to 'device', 'edge' or 'cloud'")
    if not isinstance(d["method"], str) or not isinstance(d.get("params", {}), dict):
        raise EdgeMoEError(f"{path}: method must be a string and params an object")
    placement = Placement(
        method=d["method"], params=d.get("params", {}), node_names=nodes,
        capacity_bytes=np.array(capacity, dtype=np.int64),
        hosts=hosts, expert_bytes=expert_bytes, node_kind=tuple(kinds.get(n, "edge") for n in nodes),
        # files written before the placement recorded them have neither: the runtime's defaults apply
        grouping=_check_grouping(d.get("grouping"), path), budget=_check_budget(d.get("budget"), path),
    )
    try:
        placement.check_capacity()
    except EdgeMoEError as exc:
        raise EdgeMoEError(f"{path}: {exc}") from None
    return placement


MAX_BYTES = 2**53  # sizes and capacities a placement file may give: exact in int64 sums and in floats

# The groupings a planner may record and the parameters each takes (edgemoe.profile.groups.groups_for's table).
GROUPING_PARAMS = {"layer-aware": ("theta_hi", "theta_lo", "max_group_size"), "uniform": ("theta", "max_group_size"),
                   "fixed": ("groups_per_layer", "max_group_size"), "error": ("max_err", "max_group_size")}


def _check_grouping(g, path) -> dict | None:
    """A placement file's `grouping` (None, or {"kind": one of GROUPING_PARAMS, "params": finite numbers of
    that kind}), or EdgeMoEError naming the file."""
    if g is None:
        return None
    ok = isinstance(g, dict) and set(g) == {"kind", "params"} and g["kind"] in GROUPING_PARAMS \
        and isinstance(g["params"], dict) and set(g["params"]) <= set(GROUPING_PARAMS[g["kind"]]) \
        and all(_is_finite_number(v) for v in g["params"].values())
    if not ok:
        raise EdgeMoEError(f"{path}: grouping must be null or {{\"kind\": one of {sorted(GROUPING_PARAMS)}, \"params\": "
                           f"{{name: number}}}} with the kind's parameters, got {g!r:.200}")
    return {"kind": g["kind"], "params": dict(g["params"])}


def _check_budget(b, path) -> float | None:
    """A placement file's `budget`: null or a finite number >= 0."""
    if b is None:
        return None
    if not _is_finite_number(b) or b < 0:
        raise EdgeMoEError(f"{path}: budget is {b!r:.50}, expected null or a finite number >= 0")
    return float(b)


def _is_finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v, lo: int) -> bool:
    """An integer (not a bool, not a float) in [lo, MAX_BYTES]."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= MAX_BYTES


def check_placement_matches(placement: Placement, node_names, shape: tuple[int, int], source: str = "placement",
                            model: str = "") -> None:
    """Raise EdgeMoEError (naming `source`) unless `placement` holds experts of `shape` = (L, E) (the profile's;
    `model` names it in the message) on exactly `node_names` (the cluster's: same names, same order).

    The part of `check_placement_fits` that needs no planning problem: the runtime's context calls it with its
    cluster and profile, the planners' side through `check_placement_fits`, so the rule is written once."""
    L, E = shape
    if placement.expert_bytes.shape != (L, E) or placement.hosts.shape[1:] != (L, E):
        got = placement.expert_bytes.shape if placement.expert_bytes.shape != (L, E) else placement.hosts.shape[1:]
        raise EdgeMoEError(f"{source}: planned for a model with (L, E) = {got}, but the "
                           f"profile{f' {model!r}' if model else ''} has ({L}, {E}); plan again for this model")
    if tuple(placement.node_names) != tuple(node_names):
        raise EdgeMoEError(f"{source}: nodes {list(placement.node_names)} do not match the cluster's "
                           f"{list(node_names)} (same names, same order)")
    if placement.hosts.shape[0] != len(node_names):
        raise EdgeMoEError(f"{source}: hosts has shape {placement.hosts.shape}, expected {(len(node_names), L, E)}")


def check_placement_fits(placement: Placement, problem: PlanProblem, source: str = "placement") -> None:
    """Raise EdgeMoEError (naming `source`) unless `placement` was made for this model and cluster:
    the same (L, E) and expert sizes as the profile, the cluster's nodes in order (`check_placement_matches`),
    and every non-cloud node's experts within the memory the cluster gives it now."""
    prof = problem.profile
    if placement.expert_bytes.shape == (prof.L, prof.E) and not np.array_equal(placement.expert_bytes,
                                                                               problem.expert_bytes):
        raise EdgeMoEError(f"{source}: expert sizes differ from the profile's ({prof.meta.model!r}): it was planned "
                           "for another model; plan again for this model")
    check_placement_matches(placement, problem.node_names, (prof.L, prof.E), source, prof.meta.model)
    used = placement.bytes_used()
    for n, name in enumerate(problem.node_names):
        if problem.node_kind[n] != "cloud" and used[n] > problem.capacity_bytes[n]:
            raise EdgeMoEError(f"{source}: node {name!r} holds {int(used[n]):,} bytes of experts, more than the "
                               f"{int(problem.capacity_bytes[n]):,} the cluster gives it; plan again for this cluster")


Planner = Callable[..., Placement]
_REGISTRY: dict[str, Planner] = {}


def register(name: str) -> Callable[[Planner], Planner]:
    """Decorator: make `fn(problem: PlanProblem, **params) -> Placement` available as `name`."""

    def deco(fn: Planner) -> Planner:
        if name in _REGISTRY:
            raise ValueError(f"planner {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def planners() -> dict[str, Planner]:
    """Name -> planner function, for every registered planner."""
    from edgemoe.plan import _load_all  # noqa: F401  (imports every planner module once)

    return dict(_REGISTRY)


def plan(problem: PlanProblem, method: str, **params) -> Placement:
    """Run the planner called `method`, check the result fits every node's capacity, and record on it the
    grouping and budget the planner used (`planner_choices`), which the runtime then defaults to."""
    table = planners()
    if method not in table:
        raise EdgeMoEError(f"unknown planner method {method!r}; expected one of {sorted(table)}")
    placement = table[method](problem, **params)
    placement.check_capacity()
    grouping, budget = planner_choices(table[method], params)
    return replace(placement, grouping=grouping, budget=budget)


def planner_choices(planner: Planner, params: dict) -> tuple[dict | None, float | None]:
    """(grouping, budget) a planner called with `params` decides with: read from its keyword arguments
    (`params` over the signature's defaults), so every planner is covered the same way without reporting them.

    grouping: for a planner with a `grouping` argument (a GROUPING_PARAMS kind), {"kind", "params"} with the
    arguments of that name the kind takes (None ones left to groups_for's defaults); "uniform" without a
    `theta` takes the middle of theta_hi and theta_lo, as the planners that group (plan.ordermoe) do.
    budget: its `budget` argument. None where it has no such argument."""
    # a planner whose knobs are a settings dataclass (`settings_class`) takes them by the dataclass's field names
    sig = inspect.signature(getattr(planner, "settings_class", planner)).parameters
    args = {k: p.default for k, p in sig.items() if p.default is not inspect.Parameter.empty} | dict(params)
    budget = float(args["budget"]) if "budget" in sig and args.get("budget") is not None else None
    kind = args.get("grouping") if "grouping" in sig else None
    if kind not in GROUPING_PARAMS:
        return None, budget
    if kind == "uniform" and args.get("theta") is None and {"theta_hi", "theta_lo"} <= set(args):
        args["theta"] = 0.5 * (args["theta_hi"] + args["theta_lo"])
    chosen = {k: args[k] for k in GROUPING_PARAMS[kind] if args.get(k) is not None}
    return {"kind": kind, "params": {k: v if isinstance(v, int) else float(v) for k, v in chosen.items()}}, budget


def empty_hosts(problem: PlanProblem) -> np.ndarray:
    """[N, L, E] all-False host mask, with cloud nodes holding everything."""
    N, (L, E) = problem.num_nodes, problem.expert_bytes.shape
    hosts = np.zeros((N, L, E), dtype=bool)
    hosts[problem.is_cloud] = True
    return hosts


def make_placement(problem: PlanProblem, method: str, hosts: np.ndarray, **params) -> Placement:
    """Wrap a host mask [N, L, E] into a Placement for `problem`.

    Padding experts (absent from params["experts_per_layer"], see plan.slimcaching.multimodel) are dropped.
    """
    per_layer = problem.params.get("experts_per_layer")
    if per_layer is not None:
        hosts = hosts & (np.arange(hosts.shape[2])[None, :] < np.asarray(per_layer)[:, None])[None]
    return Placement(
        method=method, params=params, node_names=problem.node_names,
        capacity_bytes=np.asarray(problem.capacity_bytes, dtype=np.int64), hosts=hosts.astype(bool),
        expert_bytes=problem.expert_bytes, node_kind=problem.node_kind,
    )
