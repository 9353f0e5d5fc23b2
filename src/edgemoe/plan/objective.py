"""SlimCaching's expected per-token latency of a placement (home mode), the objective every planner is
compared on.

Model (ALGORITHMS.md §2.3, §6 note 2; decisions in docs/planners-slimcaching.md):
- the token stays at its user's home node; every routed expert is a round trip from home;
- expert (l, e) is served by the fastest node that holds it and that the user may use: the user's own
  device (if its home is a device; no communication), any edge server it can reach (finite `comm_s`), or
  the cloud, which holds everything. Other users' devices serve nobody else;
- without a cloud, an expert held nowhere reachable costs a miss penalty (10x the slowest finite call);
- a layer costs the max over its K parallel calls; a token costs the sum over layers;
- the expectation runs over each user's observed Top-K sets: tokens of the user's domain in
  `profile.topk`, weighted by `user_weight`. Expert id -1 in `topk` means "no expert" (used when several
  models share a problem, see `slimcaching.multimodel`); it costs nothing.

Load-aware variant (`charged_model`, SlimCaching's `remote_charge` option; docs/planners-slimcaching.md,
"Remote-call charge"): each call served by an edge server n other than the user's home also costs
factor_n x its service time (compute_s) there, summed over the K calls (not maxed). The paper's max-over-K
objective values a local copy only when it completes a whole Top-K set, so it is indifferent to how many
remote calls a set makes; every remote call, though, occupies a shared server's FIFO and delays the jobs
behind it, in an M/M/1 queue at utilisation rho by about its service time x rho / (1 - rho): the factor.
"home-load" estimates rho per node from the demand homed there (`home_load_factor`). Devices, the cloud
(elastic) and the miss penalty carry no charge. With remote_charge 0 (the default) the objective is the
paper's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from edgemoe.errors import EdgeMoEError

from .base import PlanProblem

MISS_PENALTY_FACTOR = 10.0  # no cloud: a missing expert costs 10x the slowest finite call (our choice)


def require_servable(problem: PlanProblem, method: str, coverage: bool) -> None:
    """Raise EdgeMoEError when, without a cloud, some expert could be served by no one.

    Checked before planning, so an infeasible instance is an error rather than a placement that quietly
    pays the miss penalty: every expert must fit on at least one edge server (a device copy serves only its
    owner), and with `coverage` the edge servers together must hold at least one copy of every expert.
    """
    if problem.is_cloud.any():
        return
    edge = np.array([k == "edge" for k in problem.node_kind], dtype=bool)
    caps = np.asarray(problem.capacity_bytes, dtype=np.int64)[edge]
    sizes = np.asarray(problem.expert_bytes, dtype=np.int64)
    largest = int(caps.max()) if caps.size else 0
    too_big = np.argwhere(sizes > largest)
    if too_big.size:
        layer, expert = (int(v) for v in too_big[0])
        raise EdgeMoEError(
            f"{method}: infeasible: no cloud, and expert (layer {layer}, expert {expert}) of "
            f"{int(sizes[layer, expert])} bytes fits on no edge server (largest edge capacity_bytes {largest}; "
            f"{len(too_big)} experts do not fit); add a cloud node or edge memory")
    if coverage and int(caps.sum()) < int(sizes.sum()):
        raise EdgeMoEError(
            f"{method}: infeasible: no cloud, and the edge servers' capacity_bytes ({int(caps.sum())} in all) "
            f"cannot hold one copy of every expert ({int(sizes.sum())} bytes); add a cloud node or edge memory")


def require_covered(problem: PlanProblem, hosts: np.ndarray, method: str) -> None:
    """Raise EdgeMoEError if some expert has no edge-server copy in hosts [N, L, E] (coverage required)."""
    edge = np.array([k == "edge" for k in problem.node_kind], dtype=bool)
    missing = np.argwhere(~hosts[edge].any(axis=0))
    if missing.size:
        layer, expert = (int(v) for v in missing[0])
        raise EdgeMoEError(
            f"{method}: infeasible: no cloud, and {len(missing)} experts (first: layer {layer}, expert {expert}) "
            "could not be packed onto the edge servers' memory (capacity_bytes); add a cloud node or edge memory")


@dataclass(frozen=True)
class LayerSets:
    """Distinct Top-K sets observed at one layer. M sets; D domains; column id E means "no expert"."""

    sets: np.ndarray  # [M, K] int64 expert ids, sorted within a row
    prob: np.ndarray  # [D, M] probability that a token of domain d picks set m


@dataclass(frozen=True)
class SlimModel:
    """Precomputed tables for fast evaluation. U users, S edge servers, L layers, E experts."""

    edge_nodes: np.ndarray  # [S] node index of every edge server (shared caches)
    edge_call: np.ndarray  # [U, S, L, E] seconds for user u to run (l, e) on edge server s; inf: unreachable
    device_node: np.ndarray  # [U] node index of the user's own device, -1 when its home is not a device
    device_call: np.ndarray  # [U, L, E] seconds on the user's own device (inf: no device)
    base_call: np.ndarray  # [U, L, E] seconds when no cache helps: cloud, else the miss penalty
    weight: np.ndarray  # [U] user_weight
    domain: np.ndarray  # [U] user_domain
    layers: tuple[LayerSets, ...]  # [L]
    edge_charge: np.ndarray | None = None  # [U, S, L, E] remote-call charge on each edge server (None: paper)
    marginal: np.ndarray | None = None  # [U, L, E] expected calls per token (`marginal_prob`), with edge_charge

    @property
    def num_users(self) -> int:
        return int(self.weight.shape[0])

    def user_set_prob(self, layer: int) -> np.ndarray:
        """[U, M] probability of each of layer's distinct sets for each user."""
        return self.layers[layer].prob[self.domain]

    def node_call(self, node: int) -> np.ndarray:
        """[U, L, E] seconds for each user to run each expert on `node` (inf where the user may not)."""
        hit = np.flatnonzero(self.edge_nodes == node)
        if hit.size:
            return self.edge_call[:, hit[0]]
        out = np.full(self.device_call.shape, np.inf)
        owners = self.device_node == node
        out[owners] = self.device_call[owners]
        return out

    def node_users(self, node: int) -> np.ndarray:
        """[U_n] users that can use `node` for at least one expert."""
        return np.flatnonzero(np.isfinite(self.node_call(node)).any(axis=(1, 2)))


HOME_LOAD_RHO_MAX = 0.9  # "home-load" charge: cap of the estimated utilisation (rho / (1 - rho) <= 9)


def home_load_factor(problem: PlanProblem) -> np.ndarray:
    """[N] remote-call charge factor rho_n / (1 - rho_n) of the "home-load" estimate.

    rho_n = min(HOME_LOAD_RHO_MAX, D_n / max D) with D_n the user_weight of the users homed at node n: in
    a closed loop every user keeps a request in flight and its home runs its dense work and local experts,
    so a node's load grows with the demand homed there and the node with the most demand is taken as
    saturated (capped at 0.9). A node nobody lives on gets no charge.
    """
    demand = np.bincount(np.asarray(problem.user_home, dtype=np.int64), np.asarray(problem.user_weight, float),
                         minlength=len(problem.node_kind))
    rho = np.minimum(HOME_LOAD_RHO_MAX, demand / demand.max()) if demand.max() > 0 else demand
    return rho / (1.0 - rho)


def charged_model(model: SlimModel, problem: PlanProblem, remote_charge) -> SlimModel:
    """`model` with the remote-call charge (module docstring): factor_n x compute_s of every call a user
    sends to an edge server n other than its home. remote_charge: one factor for every node, [N] factors,
    or "home-load" (`home_load_factor`); 0 returns `model` itself (the paper's objective)."""
    if isinstance(remote_charge, str):
        if remote_charge != "home-load":
            raise EdgeMoEError(f"slimcaching: remote_charge={remote_charge!r}; expected a number >= 0, one per "
                               "node, or 'home-load'")
        remote_charge = home_load_factor(problem)
    try:
        factor = np.broadcast_to(np.asarray(remote_charge, dtype=np.float64), (len(problem.node_kind),))
    except (ValueError, TypeError):
        factor = np.array([np.nan])
    if not (np.isfinite(factor) & (factor >= 0)).all():
        raise EdgeMoEError(f"slimcaching: remote_charge must be finite numbers >= 0 (one, or one per node), "
                           f"or 'home-load'; got {remote_charge!r}")
    if not factor.any():
        return model
    compute = np.asarray(problem.compute_s, dtype=np.float64)[model.edge_nodes]  # [S, L, E]
    home = np.asarray(problem.user_home, dtype=np.int64)
    remote = home[:, None] != model.edge_nodes[None, :]  # [U, S]
    charge = (remote * factor[model.edge_nodes][None, :])[:, :, None, None] * compute[None]
    return replace(model, edge_charge=charge, marginal=marginal_prob(model, compute.shape[2]))


def serving_charge(model: SlimModel, hosts: np.ndarray, users: np.ndarray | None = None) -> np.ndarray | None:
    """[U', L, E] remote-call charge of each user's call of each expert under `hosts` [N, L, E]: the charge of
    the server `expert_latency` picks (the fastest holder; ties go to the base, then edge servers in
    order, then the device, as np.minimum keeps the earlier). None for a model without a charge."""
    if model.edge_charge is None:
        return None
    users = np.arange(model.num_users) if users is None else np.asarray(users, dtype=np.int64)
    tau = model.base_call[users].copy()
    chg = np.zeros_like(tau)
    for j, node in enumerate(model.edge_nodes):
        call = np.where(hosts[node].astype(bool)[None], model.edge_call[users, j], np.inf)
        better = call < tau
        tau = np.where(better, call, tau)
        chg = np.where(better, model.edge_charge[users, j], chg)
    rows = np.flatnonzero(model.device_node[users] >= 0)
    if rows.size:
        owners = users[rows]
        held = hosts[model.device_node[owners]].astype(bool)
        better = np.where(held, model.device_call[owners], np.inf) < tau[rows]
        chg[rows] = np.where(better, 0.0, chg[rows])
    return chg


def node_charge(model: SlimModel, node: int, users: np.ndarray) -> np.ndarray | None:
    """[U', L, E] charge of `users`' calls served on `node` (zeros on a device). None without a charge."""
    if model.edge_charge is None:
        return None
    hit = np.flatnonzero(model.edge_nodes == node)
    if hit.size:
        return model.edge_charge[users, hit[0]]
    return np.zeros((len(users),) + model.edge_charge.shape[2:])


def charge_per_user(model: SlimModel, chg: np.ndarray | None, users: np.ndarray | None = None,
                    layers: np.ndarray | None = None) -> np.ndarray:
    """[U'] expected remote-call charge per token (sum over calls) from chg [U', L, E]; zeros when None.
    layers: only those layers (chg still [U', L, E])."""
    if chg is None:
        return np.zeros(model.num_users if users is None else len(users))
    marginal = model.marginal if users is None else model.marginal[np.asarray(users, dtype=np.int64)]
    if layers is not None:
        marginal, chg = marginal[:, layers], chg[:, layers]
    return (marginal * chg).sum(axis=(1, 2))


def charged_objective(model: SlimModel, tau: np.ndarray, chg: np.ndarray | None) -> float:
    """User-weighted expected per-token latency plus the remote-call charge (the paper's when chg is None)."""
    return float(model.weight @ (latency_per_user_from_tau(model, tau) + charge_per_user(model, chg)))


def layer_sets(topk: np.ndarray, domain: np.ndarray, num_domains: int, num_experts: int) -> tuple[LayerSets, ...]:
    """Distinct Top-K sets per layer and their probability per domain.

    topk: [T, L, K] (-1 = no expert); domain: [T]. A domain without tokens falls back to all tokens.
    """
    T, L, K = topk.shape
    domain = np.asarray(domain, dtype=np.int64)
    tokens_per_domain = np.bincount(domain, minlength=num_domains).astype(np.float64)
    out = []
    for layer in range(L):
        rows = np.sort(np.where(topk[:, layer] < 0, num_experts, topk[:, layer]).astype(np.int64), axis=1)
        sets, inverse = np.unique(rows, axis=0, return_inverse=True)
        inverse = inverse.ravel()
        M = sets.shape[0]
        counts = np.bincount(domain * M + inverse, minlength=num_domains * M).reshape(num_domains, M)
        overall = np.bincount(inverse, minlength=M) / max(T, 1)
        prob = np.where(tokens_per_domain[:, None] > 0, counts / np.maximum(tokens_per_domain[:, None], 1), overall)
        out.append(LayerSets(sets=sets, prob=prob))
    return tuple(out)


def build_model(problem: PlanProblem) -> SlimModel:
    """Precompute the call-time tables and Top-K set statistics of `problem`."""
    kinds = np.array(problem.node_kind)
    comm = np.asarray(problem.comm_s, dtype=np.float64)  # [U, N]
    compute = np.asarray(problem.compute_s, dtype=np.float64)  # [N, L, E]
    U = comm.shape[0]
    L, E = problem.expert_bytes.shape
    edge_nodes = np.flatnonzero(kinds == "edge")
    edge_call = comm[:, edge_nodes, None, None] + compute[None, edge_nodes]  # [U, S, L, E]
    home = np.asarray(problem.user_home, dtype=np.int64)
    has_device = kinds[home] == "device"
    device_node = np.where(has_device, home, -1)
    device_call = np.full((U, L, E), np.inf)
    device_call[has_device] = comm[has_device, home[has_device], None, None] + compute[home[has_device]]
    cloud_nodes = np.flatnonzero(kinds == "cloud")
    if cloud_nodes.size:
        base_call = (comm[:, cloud_nodes, None, None] + compute[None, cloud_nodes]).min(axis=1)
    else:
        base_call = np.full((U, L, E), np.inf)
    if not np.isfinite(base_call).all():
        finite = np.concatenate([edge_call[np.isfinite(edge_call)], device_call[np.isfinite(device_call)]])
        penalty = MISS_PENALTY_FACTOR * (finite.max() if finite.size else 0.1)
        base_call = np.where(np.isfinite(base_call), base_call, penalty)
    profile = problem.profile
    layers = layer_sets(np.asarray(profile.topk), np.asarray(profile.domain), len(profile.meta.domains), E)
    return SlimModel(
        edge_nodes=edge_nodes, edge_call=edge_call, device_node=device_node, device_call=device_call,
        base_call=base_call, weight=np.asarray(problem.user_weight, dtype=np.float64),
        domain=np.asarray(problem.user_domain, dtype=np.int64), layers=layers,
    )


_CACHE: list[tuple[PlanProblem, SlimModel]] = []  # identity cache: PlanProblem holds arrays, so it is unhashable


def slim_model(problem: PlanProblem) -> SlimModel:
    """The SlimModel of `problem`, built once per problem object (a few most recent are kept)."""
    for cached_problem, model in _CACHE:
        if cached_problem is problem:
            return model
    model = build_model(problem)
    _CACHE.append((problem, model))
    del _CACHE[:-4]
    return model


def expert_latency(model: SlimModel, hosts: np.ndarray, users: np.ndarray | None = None) -> np.ndarray:
    """[U, L, E] seconds for each user's call of each expert under `hosts` [N, L, E] (fastest holder).

    With `users` [U'] only those rows are computed ([U', L, E]).
    """
    users = np.arange(model.num_users) if users is None else np.asarray(users, dtype=np.int64)
    tau = model.base_call[users].copy()
    if model.edge_nodes.size:
        held = hosts[model.edge_nodes].astype(bool)  # [S, L, E]
        tau = np.minimum(tau, np.where(held[None], model.edge_call[users], np.inf).min(axis=1))
    rows = np.flatnonzero(model.device_node[users] >= 0)
    if rows.size:
        owners = users[rows]
        held = hosts[model.device_node[owners]].astype(bool)  # [U_d, L, E]
        tau[rows] = np.minimum(tau[rows], np.where(held, model.device_call[owners], np.inf))
    return tau


def layer_latency_from_tau(model: SlimModel, layer: int, tau_layer: np.ndarray) -> np.ndarray:
    """[U] expected latency of `layer` per user given per-expert latencies tau_layer [U, E]."""
    sets = model.layers[layer].sets
    padded = np.concatenate([tau_layer, np.zeros((tau_layer.shape[0], 1))], axis=1)  # column E = no expert
    worst = padded[:, sets].max(axis=2)  # [U, M]: slowest of the K parallel calls
    return (worst * model.user_set_prob(layer)).sum(axis=1)


def latency_per_user_from_tau(model: SlimModel, tau: np.ndarray) -> np.ndarray:
    """[U] expected per-token latency (seconds, MoE calls only) from tau [U, L, E]."""
    return sum(layer_latency_from_tau(model, layer, tau[:, layer]) for layer in range(tau.shape[1]))


def expected_latency_per_user(problem: PlanProblem, hosts: np.ndarray) -> np.ndarray:
    """[U] expected per-token MoE latency (seconds) of each user under `hosts` [N, L, E]."""
    model = slim_model(problem)
    return latency_per_user_from_tau(model, expert_latency(model, hosts))


def expected_latency(problem: PlanProblem, hosts: np.ndarray) -> float:
    """User-weighted expected per-token MoE latency (seconds) under `hosts` [N, L, E]."""
    model = slim_model(problem)
    return float(model.weight @ expected_latency_per_user(problem, hosts))


def latency_reduction(problem: PlanProblem, hosts: np.ndarray) -> float:
    """F(S) of ALGORITHMS.md §2.4: seconds saved per token against serving everything from the base."""
    empty = np.zeros_like(hosts, dtype=bool)
    return expected_latency(problem, empty) - expected_latency(problem, hosts)


def marginal_prob(model: SlimModel, num_experts: int) -> np.ndarray:
    """[U, L, E] expected activations per token of each expert for each user (sum over set members)."""
    L = len(model.layers)
    out = np.zeros((model.num_users, L, num_experts + 1))
    for layer, ls in enumerate(model.layers):
        prob = model.user_set_prob(layer)  # [U, M]
        for k in range(ls.sets.shape[1]):
            np.add.at(out[:, layer].T, ls.sets[:, k], prob.T)
    return out[:, :, :num_experts]
