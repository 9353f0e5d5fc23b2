"""The runtime-policy interface and the layer arithmetic every policy shares (pure numpy).

A policy decides, for T token rows at one MoE layer, which expert runs in each of the K slots and where:

    policy = make_policy("ordermoe", ctx, budget=0.05, horizon=2)   # edgemoe.runtime.registry
    state = policy.start(users)                        # users: [T] user index of each token row
    for layer in range(L):
        dec = policy.decide(layer, topk[:, layer], gates[:, layer], state, load_s)   # state updated in place

Conventions (docs/runtime.md): `experts[t, k]` is the expert actually run in slot k (the routed id = exact,
another id = local substitute, -1 = not run: dropped and renormalised, or zeroed where `Decision.zeroed`);
`node[t, k]` the node that runs it (-1 when not run). A token is at `state.location`; its K branches run in
parallel from there; the outputs meet at `next_location` (always the current node in `home` mode; in
`migrate` mode a node the policy chooses). Layer latency = the slowest branch including the transfers to
the meeting node (+ the trip home after the last layer in `migrate`).

This layer rule exists in four copies, each pinned to this one (the reference) by tests:
- compiled, `runtime.sim.rules._decide_rows`: tests/runtime/sim/test_sim_speed.py (compiled rule = policy call);
- replayed without queues, `plan.ordermoe.runtime_model.PathModel`: tests/plan/ordermoe/test_planner.py
  (replay = the exact policy, replay = the ordermoe policy's stand-ins);
- the steered ordermoe decision, `runtime.policies.ordermoe_kernel`: tests/runtime/policies/test_ordermoe_kernel.py.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

import numpy as np

from edgemoe.errors import EdgeMoEError, require_in_range
from edgemoe.io import jsonable
from edgemoe.jit import njit

from .context import RuntimeContext


@dataclass
class TokenState:
    """Per-row state of T token rows as they go through the layers (mutated by `decide`)."""

    user: np.ndarray  # [T] int user index
    home: np.ndarray  # [T] int node where the row's request lives
    location: np.ndarray  # [T] int node where the token is now
    budget_total: np.ndarray  # [T] float quality budget of the row (allowance x L)
    budget_used: np.ndarray  # [T] float spent so far
    layer: np.ndarray  # [T] int next layer to decide (decisions must come in order)
    prev_top1: np.ndarray  # [T] int top-1 expert of the previous layer (-1 before layer 0)
    row: np.ndarray  # [T] int the row's index in the `start` call that made it (per-row tables, e.g. the oracle's)

    def __len__(self) -> int:
        return int(self.user.shape[0])

    def take(self, rows: np.ndarray) -> TokenState:
        """A copy holding only `rows` ([T'] indices)."""
        return TokenState(*[getattr(self, name)[rows] for name in _STATE_FIELDS])

    def put(self, rows: np.ndarray, part: TokenState) -> None:
        """Write `part` (from `take(rows)`) back into this state."""
        for name in _STATE_FIELDS:
            getattr(self, name)[rows] = getattr(part, name)

    @property
    def budget_left(self) -> np.ndarray:
        return self.budget_total - self.budget_used


_STATE_FIELDS = tuple(f.name for f in fields(TokenState))  # in declaration order (dataclasses.fields per call is slow)
_STATE_INDICES = ("user", "home", "location", "layer", "prev_top1", "row")  # the integer fields


@njit(cache=True)
def _out_of_range(topk, E, load, user, U, home, location, N):  # pragma: no cover - compiled
    """The first of (topk, load, user, home, location) [T, K], [N], [T] x 3 holding a value out of range, as
    its index in that order, or -1: expert ids in [0, E), finite loads >= 0, users in [0, U), nodes in [0, N).
    One compiled pass: numpy's reductions took ~10 us a call, a fifth of a decision at one row."""
    for t in range(topk.shape[0]):
        for k in range(topk.shape[1]):
            if not 0 <= topk[t, k] < E:
                return 0
    for n in range(load.shape[0]):
        if not (load[n] >= 0.0 and load[n] < np.inf):  # (a NaN fails)
            return 1
    for i, (a, hi) in enumerate(((user, U), (home, N), (location, N))):
        for t in range(a.shape[0]):
            if not 0 <= a[t] < hi:
                return 2 + i
    return -1


def _state_rows(state: TokenState) -> int:
    """T, once every field of `state` is checked to be a [T] array (of integers where it indexes); else
    EdgeMoEError naming the field."""
    T = state.user.shape[0] if isinstance(state.user, np.ndarray) and state.user.ndim == 1 else -1
    for name in _STATE_FIELDS:
        a = getattr(state, name)
        if not isinstance(a, np.ndarray) or a.shape != (T,) or (name in _STATE_INDICES and a.dtype.kind not in "iu"):
            got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            rows = f"T={T}" if T >= 0 else "T"
            raise EdgeMoEError(f"state.{name} must be a [{rows}] {'integer' if name in _STATE_INDICES else 'float'} "
                               f"array (`Policy.start` makes one), got {got}")
    return T


def _load_array(load_s, N: int) -> np.ndarray:
    """load_s as a float [N] array (zeros for None), or EdgeMoEError; its values are `_check_ranges`'."""
    try:
        load = np.zeros(N) if load_s is None else np.asarray(load_s, dtype=float)
    except (TypeError, ValueError):
        raise EdgeMoEError(f"load_s must be [N={N}] seconds, got {type(load_s).__name__}") from None
    if load.shape != (N,):
        raise EdgeMoEError(f"load_s must be [N={N}] seconds (one queue wait per node), got shape {load.shape}")
    return load


def _check_ranges(state: TokenState, topk: np.ndarray, load: np.ndarray, ctx: RuntimeContext) -> None:
    """Raise EdgeMoEError naming the field unless `Policy.decide`'s values are in range (their shapes checked
    before): expert ids in topk [T, K] int64, the state's users, homes and locations, and the loads [N] finite
    and >= 0. A policy's tables are indexed by these values, in compiled code unchecked. The compiled pass
    (`_out_of_range`) finds whether any is out; only then are the messages made."""
    N = ctx.num_nodes
    idx = lambda a: a if a.dtype == np.int64 else a.astype(np.int64)  # noqa: E731 - one compiled signature
    if _out_of_range(topk, ctx.num_experts, load, idx(state.user), ctx.num_users, idx(state.home),
                     idx(state.location), N) < 0:
        return
    if not (load.min() >= 0 and load.max() < np.inf):  # (a NaN fails both)
        raise EdgeMoEError(f"load_s must hold finite seconds >= 0, got values in [{load.min()}, {load.max()}]")
    require_in_range(topk, 0, ctx.num_experts, "topk must hold expert ids")
    for name, hi in (("user", ctx.num_users), ("home", N), ("location", N)):
        require_in_range(getattr(state, name), 0, hi, f"state.{name} must hold indices")


_UNBUILT = object()  # `Policy.decide`: the policy's decode path not asked for yet
# policy -> its decode path (`Policy.decode_path`), beside the policy rather than in it: a policy stays
# picklable (the Ray backend ships policies) and a copy builds its own path on its own arrays
_DECODE_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Decision:
    """What to do at one layer for T rows with K slots."""

    experts: np.ndarray  # [T, K] int expert run in each slot (-1 dropped)
    node: np.ndarray  # [T, K] int node running it (-1 dropped)
    location: np.ndarray  # [T] int where the token was when the layer started
    next_location: np.ndarray  # [T] int where the token is after the layer
    quality_cost: np.ndarray  # [T] float budget spent at this layer
    latency_s: np.ndarray  # [T] float the policy's estimate of the layer's latency (with the load it saw)
    zeroed: np.ndarray | None = None  # [T, K] bool: among the slots not run (-1), those zeroed (the other gates
    # stay as they are) rather than dropped and renormalised; None: no slot zeroed

    @property
    def dropped(self) -> np.ndarray:
        """[T, K] bool: the slot does not run (dropped and renormalised, or zeroed)."""
        return self.experts < 0

    @property
    def zero_mask(self) -> np.ndarray:
        """[T, K] bool: the slot is zeroed (its gate's share is lost; the other gates stay)."""
        return np.zeros(self.experts.shape, bool) if self.zeroed is None else self.zeroed

    def substituted(self, topk: np.ndarray) -> np.ndarray:
        """[T, K] bool: a different expert than the routed one runs in the slot."""
        return (self.experts >= 0) & (self.experts != topk)

    @property
    def remote(self) -> np.ndarray:
        """[T, K] bool: the slot runs away from where the token was."""
        return (self.node >= 0) & (self.node != self.location[:, None])


class Policy:
    """Base class: subclasses implement `choose`; `decide` checks order and updates the state."""

    name = "policy"

    def __init__(self, ctx: RuntimeContext, budget=0.0, **params):
        self.ctx = ctx
        allowance = np.broadcast_to(np.asarray(budget, dtype=float), (ctx.num_users,)).copy()
        if (allowance < 0).any() or not np.isfinite(allowance).all():
            raise EdgeMoEError(f"budget must be finite and >= 0 (per token-layer, per user), got {budget}")
        self.allowance = allowance  # [U] quality allowance per token-layer
        # numpy to Python, NaN and tuples kept (the policy is rebuilt from these); results files go strict on write
        self.params = jsonable({"budget": budget, **params}, strict=False)

    # -- interface ------------------------------------------------------------------------------------------
    def start(self, users, tokens=None) -> TokenState:
        """Fresh state of T token rows at their users' homes. users: [T] int user index.

        tokens: [T] index of each row's token in the routing the caller replays (the simulator's trace, the
        local backend's evaluation text); only policies that know the future (`oracle`) need it."""
        users = np.asarray(users, dtype=np.int64)
        if users.ndim != 1 or ((users < 0) | (users >= self.ctx.num_users)).any():
            raise EdgeMoEError(f"users must be a [T] array of user indices in [0, {self.ctx.num_users})")
        home = self.ctx.user_home[users]
        T = users.shape[0]
        return TokenState(
            user=users, home=home.copy(), location=home.copy(),
            budget_total=self.allowance[users] * self.ctx.num_layers, budget_used=np.zeros(T),
            layer=np.zeros(T, np.int64), prev_top1=np.full(T, -1, np.int64), row=np.arange(T),
        )

    def decide(self, layer, topk, gates, state: TokenState, load_s=None, router_logits=None) -> Decision:
        """Decide layer `layer` for every row of `state`; updates state (location, budget, layer) in place.

        layer: int, or [T] ints (rows at different layers in one call, as the simulator batches them);
        topk: [T, K] int routed experts; gates: [T, K] float gate weights; load_s: [N] current queueing
        delay estimate per node (seconds) or None (no queues); router_logits: [T, E] the rows' real router
        logits at this layer or None (the `local` backend passes them to policies with `wants_router_logits`;
        `choose` reads them as `self.router_logits`, None where the backend has none).
        """
        try:
            fast = _DECODE_PATHS.get(self, _UNBUILT)
            if fast is _UNBUILT:  # built at the first call: a backend that never calls `decide` never pays for it
                fast = _DECODE_PATHS[self] = self.decode_path()
        except TypeError:  # a subclass that is not hashable (or weakly referable) decides as below
            fast = None
        if fast is not None and router_logits is None:
            dec = fast(self, layer, topk, gates, state, load_s)
            if dec is not None:
                return dec
        topk = np.asarray(topk, dtype=np.int64)
        gates = np.asarray(gates, dtype=float)
        T = _state_rows(state)
        if topk.ndim != 2 or topk.shape[0] != T or gates.shape != topk.shape:
            raise EdgeMoEError(f"topk and gates must both be [T={T}, K], got {topk.shape} and {gates.shape}")
        load = _load_array(load_s, self.ctx.num_nodes)
        _check_ranges(state, topk, load, self.ctx)
        layer = np.broadcast_to(np.asarray(layer, dtype=np.int64), (T,))
        if T and ((layer < 0) | (layer >= self.ctx.num_layers)).any():
            raise EdgeMoEError(f"layer {np.unique(layer).tolist()} outside [0, {self.ctx.num_layers})")
        if T and (state.layer != layer).any():
            raise EdgeMoEError(f"rows must be decided layer by layer in order; got layer {np.unique(layer).tolist()} "
                               f"for rows at layer {np.unique(state.layer).tolist()}")
        if router_logits is not None:
            router_logits = np.asarray(router_logits, dtype=float)
            if router_logits.shape != (T, self.ctx.num_experts):
                raise EdgeMoEError(f"router_logits must be [T={T}, E={self.ctx.num_experts}], got {router_logits.shape}")
        self.router_logits = router_logits
        try:
            dec = self.choose(layer, topk, gates, state, load)
        finally:
            self.router_logits = None
        state.location = dec.next_location.copy()
        state.budget_used = state.budget_used + dec.quality_cost
        state.layer = state.layer + 1
        state.prev_top1 = top1(topk, gates)
        return dec

    def decode_path(self):
        """A callable (policy, layer, topk, gates, state, load_s) -> Decision or None that makes exactly the decisions
        and state updates of `decide` in one compiled call (None where it does not apply: `decide` then goes
        on as usual), or None (default): `decide` always runs `choose`. OrderMoE has one
        (`edgemoe.runtime.policies.ordermoe_kernel.DecodePath`)."""
        return None

    wants_feedback = False  # backends call `observe` only when True (it costs them bookkeeping)
    router_logits: np.ndarray | None = None  # [T, E] during `choose`: the rows' real router logits, if passed

    def compiled_rule(self) -> str | None:
        """Name of a compiled rule (`edgemoe.runtime.sim.rules.RULES`) that makes exactly this policy's decisions,
        for the simulator's fast engine to run in its compiled loop instead of calling `decide` per wave; None
        (default): the engine calls `decide`. A policy returning a name must decide by that rule alone."""
        return None

    def _own_rule(self, cls, name: str) -> str | None:
        """`name` when neither `choose` nor `decide` is overridden below `cls` (a subclass deciding otherwise
        must not inherit the rule)."""
        same = type(self).choose is cls.choose and type(self).decide is Policy.decide
        return name if same else None

    def observe(self, users, latency_s, estimate_s=None, spent=None, granted=None) -> None:
        """Feedback from a backend about n finished passes (or layers): users [n] int; latency_s [n] measured
        seconds; estimate_s [n] the policy's own estimate of the same (sum of `Decision.latency_s`); spent /
        granted [n] quality budget the pass's rows spent / were granted. Adaptive policies use it."""

    def choose(self, layer: np.ndarray, topk: np.ndarray, gates: np.ndarray, state: TokenState, load: np.ndarray) -> Decision:
        raise NotImplementedError


# ------------------------------------------------------------------------------- shared layer arithmetic


def top1(topk: np.ndarray, gates: np.ndarray) -> np.ndarray:
    """[T] the routed expert with the largest gate of each row."""
    if topk.shape[1] == 0:
        return np.full(topk.shape[0], -1, np.int64)
    return np.take_along_axis(topk, np.argmax(gates, axis=1)[:, None], axis=1)[:, 0]


def choose_replicas(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, usable: np.ndarray, experts: np.ndarray,
                    load: np.ndarray, cloud: str = "fallback") -> np.ndarray:
    """[T, K] node to run each routed expert: the token's node if it holds it, else the cheapest replica.

    layer, location: [T]; usable: [T, N] bool nodes each row may use; experts: [T, K] (>= 0); load: [N] seconds.
    Cost of a replica n = round trip location <-> n + compute + load[n]. cloud: "fallback" (the cloud only
    when no usable non-cloud node holds the expert; `exact`) or "candidate" (the cloud competes on cost;
    `slimcaching`, whose objective takes the minimum over cloud and edges).

    Speed: when every row may use every node, the answer is looked up among the few replicas that are
    cheapest without load (`ReplicaShortlist`); rows whose winner the shortlist cannot prove fall back to
    the full [T, K, N] comparison. Both give the same node (same sums, same first-index tie-break).
    """
    T, K = experts.shape
    if T and K and T * K * ctx.num_nodes >= _SHORTLIST_MIN_WORK and usable.all():
        node, proven = replica_shortlist(ctx, cloud).pick(layer, location, experts, load)
        rows = np.flatnonzero(~proven.all(axis=1))
        if rows.size:
            node[rows] = _choose_replicas_full(ctx, layer[rows], location[rows], usable[rows], experts[rows], load, cloud)
    else:
        node = _choose_replicas_full(ctx, layer, location, usable, experts, load, cloud)
    at_home = ctx.hosts[location[:, None], layer[:, None], experts]  # [T, K]: the token's node holds it -> run it there
    return np.where(at_home, location[:, None], node)


def _choose_replicas_full(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, usable: np.ndarray,
                          experts: np.ndarray, load: np.ndarray, cloud: str) -> np.ndarray:
    """[T, K] cheapest usable replica by brute force over all N nodes (the definition)."""
    lk = layer[:, None]
    held = ctx.hosts[:, lk, experts].transpose(1, 2, 0) & usable[:, None, :]  # [T, K, N] (moveaxis 0 -> -1)
    rt = ctx.xfer_s[location] + ctx.xfer_s[:, location].T  # [T, N]
    cost = rt[:, None, :] + ctx.compute_s[:, lk, experts].transpose(1, 2, 0) + load[None, None, :]
    if cloud == "fallback" and ctx.is_cloud.any():
        edge_held = held & ~ctx.is_cloud[None, None, :]
        held = np.where(edge_held.any(axis=2, keepdims=True), edge_held, held)
    cost = np.where(held, cost, np.inf)
    return cost.argmin(axis=2)


_SHORTLIST_MIN_WORK = 4096  # below this many (row, slot, node) cells the brute force is as fast
SHORTLIST_SIZE = 16  # replicas kept per (location, layer, expert): 89% of rows proven on 256 busy servers (8: 82%)
_SHORTLIST_MAX_CELLS = 1 << 22  # table cells N * L * E * m at most (2 tables of 8 bytes: 64 MiB)


class ReplicaShortlist:
    """Per (location c, layer l, expert e): the m replicas with the smallest static cost s(n) = round trip
    c <-> n + compute[n, l, e] (ties by node index), and the static cost of the (m+1)-th.

    With load >= 0 the total s(n) + load[n] of any replica outside the list is >= that (m+1)-th static cost,
    so when the best total inside the list is strictly below it, the list's winner is the global argmin.
    Built lazily per location (every row may use every node: the candidate set does not depend on the user).
    """

    def __init__(self, ctx: RuntimeContext, cloud: str, size: int = SHORTLIST_SIZE):
        N, L, E = ctx.compute_s.shape
        size = max(1, min(size, N, _SHORTLIST_MAX_CELLS // (N * L * E)))
        self.cloud, self.size, self.num_nodes = cloud, int(size), N
        self.xfer_s = ctx.xfer_s  # no reference to ctx itself: the cache entry dies with the context
        self.built = np.zeros(N, bool)
        self.all_built = False
        self.node = np.zeros((N, L, E, self.size), np.int64)  # [N, L, E, m] shortlisted replica
        self.static = np.full((N, L, E, self.size), np.inf)  # [N, L, E, m] its static cost (inf: padding)
        self.bound = np.full((N, L, E), np.inf)  # [N, L, E] static cost of the first replica left out
        held = np.moveaxis(ctx.hosts, 0, -1)  # [L, E, N]
        if cloud == "fallback" and ctx.is_cloud.any():
            edge_held = held & ~ctx.is_cloud
            held = np.where(edge_held.any(axis=2, keepdims=True), edge_held, held)
        self.held = held
        self.compute = np.moveaxis(ctx.compute_s, 0, -1)  # [L, E, N]

    def _build(self, locations: np.ndarray) -> None:
        xfer, m = self.xfer_s, self.size
        for c in locations:
            rt = xfer[c] + xfer[:, c]  # [N], the same sum as the brute force
            static = np.where(self.held, rt + self.compute, np.inf)  # [L, E, N]
            order = np.argsort(static, axis=2, kind="stable")  # ties: lower node index first
            self.node[c] = order[..., :m]
            self.static[c] = np.take_along_axis(static, order[..., :m], 2)
            if static.shape[2] > m:
                self.bound[c] = np.take_along_axis(static, order[..., m:m + 1], 2)[..., 0]
        self.built[locations] = True

    def ensure(self, location: np.ndarray) -> None:
        """Build the tables of every node in `location` not built yet."""
        if not self.all_built:
            missing = np.unique(location[~self.built[location]])
            if missing.size:
                self._build(missing)
            self.all_built = bool(self.built.all())

    def candidates(self, layer: np.ndarray, location: np.ndarray, experts: np.ndarray, m: int):
        """([R, K, m] node, [R, K, m] bool real): the m statically cheapest replicas of each (location, layer, expert).

        layer, location: [R]; experts: [R, K]. Returns [R, K, m'] with m' = min(m, table size); padding (an
        expert with fewer replicas than m') is marked not real."""
        self.ensure(location)
        _, L, E, size = self.node.shape
        m = min(int(m), size)
        flat = (location * L + layer)[:, None] * E + experts  # [R, K]
        # take rows first, then cut to m: `take` on the cut (non-contiguous) view would copy the whole table
        node = self.node.reshape(-1, size).take(flat, axis=0)[..., :m]
        real = np.isfinite(self.static.reshape(-1, size).take(flat, axis=0)[..., :m])
        return node, real

    def pick(self, layer: np.ndarray, location: np.ndarray, experts: np.ndarray, load: np.ndarray):
        """([T, K] node, [T, K] bool proven): the shortlist's cheapest replica and whether it is the global one."""
        self.ensure(location)
        _, L, E, m = self.node.shape
        flat = (location * L + layer)[:, None] * E + experts  # [T, K] row of (c, l, e) in the tables
        cand = self.node.reshape(-1, m).take(flat, axis=0)  # [T, K, m]
        total = self.static.reshape(-1, m).take(flat, axis=0) + load[cand]
        best = total.min(axis=2)
        node = np.where(total == best[..., None], cand, self.num_nodes).min(axis=2)
        return node, best < self.bound.reshape(-1).take(flat)


_SHORTLISTS: dict[tuple[int, str], ReplicaShortlist] = {}


def replica_shortlist(ctx: RuntimeContext, cloud: str) -> ReplicaShortlist:
    """The ReplicaShortlist of `ctx` for a cloud rule, built once and kept while the context lives."""
    key = (id(ctx), cloud)
    table = _SHORTLISTS.get(key)
    if table is None:
        table = _SHORTLISTS[key] = ReplicaShortlist(ctx, cloud)
        weakref.finalize(ctx, _SHORTLISTS.pop, key, None)
    return table


def branch_ready_s(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, experts: np.ndarray, node: np.ndarray,
                   load: np.ndarray) -> np.ndarray:
    """[..., K] seconds after the layer starts at which each branch's output exists at its node (inf: dropped).

    layer, location: [...]; experts, node: [..., K] (-1 dropped). Transfer there + load + compute.
    """
    ok = node >= 0
    n = np.where(ok, node, 0)
    e = np.where(ok, experts, 0)
    t = ctx.xfer_s[location[..., None], n] + load[n] + ctx.compute_s[n, layer[..., None], e]
    return np.where(ok, t, -np.inf)


def meeting_node(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, home: np.ndarray, node: np.ndarray,
                 ready: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([...] next location, [...] layer seconds) for branches ready at `ready` [..., K] on `node` [..., K].

    home mode: the outputs return to the token's node. migrate mode: they meet at whichever candidate
    (the current node, then the branch nodes in slot order; first wins ties) finishes the layer first;
    after the last layer the token also travels home, and that trip counts.
    """
    if ctx.mode == "home" or ready.shape[-1] == 0:
        back = np.where(node >= 0, ctx.xfer_s[np.maximum(node, 0), location[..., None]], 0.0)
        return location.copy(), np.max(ready + back, axis=-1, initial=0.0)
    cand = np.concatenate([location[..., None], node], axis=-1)  # [..., K+1]
    cand_ok = cand >= 0
    c = np.maximum(cand, 0)
    n = np.maximum(node, 0)
    N = ctx.num_nodes
    to = ctx.xfer_s.reshape(-1).take(n[..., :, None] * N + c[..., None, :])  # [..., K, K+1] branch k -> candidate g
    done = np.max(ready[..., :, None] + to, axis=-2)  # [..., K+1]
    done = np.maximum(done, 0.0)
    last = layer == ctx.num_layers - 1
    if last.any():
        done = done + np.where(last[..., None], ctx.xfer_s[c, home[..., None]], 0.0)
    else:
        done = done + 0.0  # (what adding the zero trip home gives, bit for bit)
    done = np.where(cand_ok, done, np.inf)
    pick = done.argmin(axis=-1)
    rows = np.arange(pick.size)
    nxt = cand.reshape(-1, cand.shape[-1])[rows, pick.reshape(-1)].reshape(pick.shape)
    return nxt, done.reshape(-1, done.shape[-1])[rows, pick.reshape(-1)].reshape(pick.shape)
