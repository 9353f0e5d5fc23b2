"""Improvement phase for SlimCaching's successive decomposition: settle, then iterated kicks (an extension).

One pass of the per-node decomposition (`slimcaching.successive`) is block-coordinate ascent: each cache
node is solved exactly with every other node fixed. With K >= 2 it stalls where two caches must change
together (a device and an edge server each taking one member of a co-activated pair: either change alone
saves nothing), and on the tiny instances the ILP solves, even every *pair* of nodes re-optimised jointly
leaves gaps of several percent: the optimum is a different arrangement altogether (docs/planners-slimcaching.md).

So the refinement is an iterated local search whose local search is the decomposition itself:
1. settle: revisit blocks until none changes (block re-solves with exact tables are monotone);
2. kick: force two experts onto one random node (sampled by how much they would cut its users' call
   times if their partners were fast too, evicting random non-essential experts when full), re-solve
   every other node, that node last, and settle again; keep the result only if the objective drops.

Speed: a node's per-layer value table depends only on the other nodes' caches at that layer (and on the
copies it must keep for coverage), so tables are cached under that key and a block whose keys and own
cache are unchanged since its last solve is skipped without any work. A kick then costs the one or two
layers it touches plus one max-convolution per node that actually needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..base import PlanProblem
from ..objective import (
    SlimModel,
    charge_per_user,
    charged_objective,
    expert_latency,
    marginal_prob,
    node_charge,
    serving_charge,
)
from .maxconv import solve_layers
from .values import free_units, set_gains, value_table

DP_PAIRS_PER_CELL = 8  # work units: one user-set cell of a value table ~ 8 (budget, budget) pairs of the DP
REL_TOL = 1e-12  # relative: a change must cut latency by more than this to count (prevents cycling on ties)
TABLE_VERSIONS = 4  # cached value tables kept per (node, layer): the current and a few reverted states


@dataclass(frozen=True)
class SolverSettings:
    """How each block is solved (the `slimcaching` parameters of the same names)."""

    maxconv: str = "auto"
    epsilon: float = 0.1
    enum_max: int = 12
    beam_width: int = 8


@dataclass(frozen=True)
class Block:
    """One cache node's subproblem. U_n users, R related nodes, L layers, E experts."""

    node: int
    users: np.ndarray  # [U_n] users that can use the node
    call: np.ndarray  # [U_n, L, E] seconds on the node (inf where the user may not use it)
    capacity: int  # capacity in units
    units: np.ndarray  # [L, E] expert sizes in units
    unit: int  # bytes per unit
    capacity_bytes: int
    related: np.ndarray  # [R] other nodes whose caches change this block's tables
    is_edge: bool
    charge: np.ndarray | None = None  # [U_n, L, E] remote-call charge of a call on the node (None: paper)


def dp_work(num_layers: int, capacity: int) -> int:
    """Work units of one block's max-convolution DP (the naive bound (L - 1) (C + 1)^2)."""
    return (num_layers - 1) * (capacity + 1) ** 2 // DP_PAIRS_PER_CELL


def sole_copies(hosts: np.ndarray, edge_nodes: np.ndarray, node: int) -> np.ndarray:
    """[L, E] experts that `node` holds and no other edge server does (coverage must keep them)."""
    others = edge_nodes[edge_nodes != node]
    return hosts[node] & ~hosts[others].any(axis=0)


def users_layer_latency(model: SlimModel, users: np.ndarray, layer: int, tau_layer: np.ndarray) -> float:
    """sum_u w_u * expected latency of `layer` for `users` [U'] given their tau_layer [U', E]."""
    sets = model.layers[layer].sets
    padded = np.concatenate([tau_layer, np.zeros((tau_layer.shape[0], 1))], axis=1)
    prob = model.layers[layer].prob[model.domain[users]]  # [U', M]
    return float(model.weight[users] @ (padded[:, sets].max(axis=2) * prob).sum(axis=1))


class BlockSearch:
    """Mutable state of the refinement: the caches, per-user call times and the table cache."""

    def __init__(self, problem: PlanProblem, model: SlimModel, hosts: np.ndarray, blocks: list[Block],
                 coverage: bool, settings: SolverSettings):
        self.problem, self.model, self.settings, self.coverage = problem, model, settings, coverage
        self.hosts = hosts.copy()
        self.tau = expert_latency(model, self.hosts)  # [U, L, E]
        self.chg = serving_charge(model, self.hosts)  # [U, L, E] remote-call charges, None for the paper's
        self.blocks = {b.node: b for b in blocks}
        self.edge_nodes = model.edge_nodes
        self.tables: dict[tuple[int, int], dict[bytes, tuple]] = {}
        self.last: dict[int, tuple[bytes, bytes]] = {}  # node -> (layer keys, own cache) at its last solve
        self.block_solves = 0
        self.tables_built = 0
        self.work = 0  # user-set cells of the tables built (U_n x M_l each) plus `dp_work` per block solve
        self.max_work = np.inf  # work budget (deterministic units); checked before each block solve
        self.exact_tables = True

    def objective(self) -> float:
        return charged_objective(self.model, self.tau, self.chg)

    def users_cost(self, users: np.ndarray, layers: np.ndarray, tau: np.ndarray, chg: np.ndarray | None) -> float:
        """sum_u w_u (expected latency of `layers` + their remote-call charge) for `users`; tau, chg [U', L, E]."""
        latency = sum(users_layer_latency(self.model, users, layer, tau[:, layer]) for layer in layers)
        return latency + float(self.model.weight[users] @ charge_per_user(self.model, chg, users, layers))

    def fixed(self, node: int) -> np.ndarray:
        """[L, E] copies `node` must keep: sole edge copies when coverage is required."""
        if self.coverage and self.blocks[node].is_edge:
            return sole_copies(self.hosts, self.edge_nodes, node)
        return np.zeros(self.hosts.shape[1:], bool)

    def _layer_keys(self, block: Block, fixed: np.ndarray) -> list[bytes]:
        L = self.hosts.shape[1]
        others = np.packbits(self.hosts[block.related].transpose(1, 0, 2).reshape(L, -1), axis=1)
        own = np.packbits(fixed, axis=1)
        return [others[layer].tobytes() + own[layer].tobytes() for layer in range(L)]

    def _table(self, block: Block, layer: int, key: bytes, tau_free: np.ndarray | None,
               chg_free: np.ndarray | None = None):
        """(table [C+1], candidates, picks [C+1, c]) of one layer at the block's full capacity C.

        From the cache, or built from tau_free [U_n, L, E] (and chg_free, its charges). V(c) does not depend on C, so a block with
        reserved (coverage) copies just uses the first entries.
        """
        cache = self.tables.setdefault((block.node, layer), {})
        entry = cache.get(key)
        if entry is None:
            g = set_gains(tau_free[:, layer], block.call[:, layer], self.model.user_set_prob(layer)[block.users],
                          self.model.weight[block.users], self.model.layers[layer].sets,
                          None if chg_free is None else chg_free[:, layer],
                          None if chg_free is None else block.charge[:, layer])
            table, pick, exact = value_table(g, block.units[layer, g.candidates], block.capacity,
                                             self.settings.enum_max, self.settings.beam_width)
            self.exact_tables &= exact
            self.tables_built += 1
            self.work += block.users.size * self.model.layers[layer].sets.shape[0]
            entry = (table, g.candidates, pick)
            if len(cache) >= TABLE_VERSIONS:
                cache.pop(next(iter(cache)))
            cache[key] = entry
        return entry

    def solve(self, node: int) -> bool:
        """Re-solve one block with the others fixed; apply it if it strictly lowers latency. True if changed."""
        block = self.blocks[node]
        if block.users.size == 0:
            return False
        fixed = self.fixed(node)
        keys = self._layer_keys(block, fixed)
        signature = (b"".join(keys), np.packbits(self.hosts[node]).tobytes())
        if self.last.get(node) == signature:
            return False  # same tables, same cache, already confirmed optimal for them
        self.block_solves += 1
        L = block.units.shape[0]
        capacity = min(free_units(block.capacity_bytes, self.problem.expert_bytes[fixed].sum(), block.unit),
                       block.capacity)
        tau_free = chg_free = None
        if any(keys[layer] not in self.tables.get((node, layer), {}) for layer in range(L)):
            trial = self.hosts.copy()
            trial[node] = fixed
            tau_free = expert_latency(self.model, trial, block.users)
            chg_free = serving_charge(self.model, trial, block.users)
        entries = [self._table(block, layer, keys[layer], tau_free, chg_free) for layer in range(L)]
        tables = np.stack([e[0][: capacity + 1] for e in entries])
        budgets, _ = solve_layers(tables, self.settings.maxconv, self.settings.epsilon)
        self.work += dp_work(L, capacity)
        held = fixed.copy()
        for layer, (_, cands, pick) in enumerate(entries):
            held[layer, cands[pick[budgets[layer]]]] = True
        changed = self.apply(node, held)
        if changed:
            self.last.pop(node, None)  # its fixed copies may differ now: confirm on the next sweep
        else:
            self.last[node] = signature
        return changed

    def apply(self, node: int, held: np.ndarray, force: bool = False) -> bool:
        """Set node's cache to held [L, E] if that strictly lowers latency (always with `force`)."""
        layers = np.flatnonzero((held != self.hosts[node]).any(axis=1))
        if layers.size == 0:
            return False
        users = self.blocks[node].users
        before = self.users_cost(users, layers, self.tau[users], None if self.chg is None else self.chg[users])
        old = self.hosts[node].copy()
        self.hosts[node] = held
        tau_new = expert_latency(self.model, self.hosts, users)
        chg_new = serving_charge(self.model, self.hosts, users)
        after = self.users_cost(users, layers, tau_new, chg_new)
        if not force and after >= before - REL_TOL * max(abs(before), 1e-300):
            self.hosts[node] = old
            return False
        self.tau[users] = tau_new
        if chg_new is not None:
            self.chg[users] = chg_new
        return True

    def exhausted(self) -> bool:
        return self.work >= self.max_work

    def settle(self, order: list[int], max_sweeps: int = 50) -> int:
        """Sweep blocks in `order` until a whole sweep changes nothing or the table budget is spent
        (every applied change lowers latency, so stopping early is safe). Returns sweeps run."""
        for sweep in range(1, max_sweeps + 1):
            changed = False
            for n in order:
                if self.exhausted():
                    return sweep
                changed |= self.solve(n)
            if not changed:
                return sweep
        return max_sweeps

    def restore(self, hosts: np.ndarray, tau: np.ndarray, chg: np.ndarray | None = None) -> None:
        self.hosts[...] = hosts
        self.tau[...] = tau
        if chg is not None:
            self.chg[...] = chg

    def state(self) -> tuple:
        """(hosts, tau, chg) copies, for `restore`."""
        return self.hosts.copy(), self.tau.copy(), None if self.chg is None else self.chg.copy()


def kick_scores(search: BlockSearch, block: Block, weighted_prob: np.ndarray) -> np.ndarray:
    """[L, E] how much forcing each expert onto the block's node would cut its users' calls (additively)."""
    users = block.users
    saving = np.maximum(search.tau[users] - block.call, 0.0)
    score = (weighted_prob[users] * saving).sum(axis=0)
    return np.where(search.hosts[block.node], 0.0, score)


def kick(search: BlockSearch, node: int, rng: np.random.Generator, weighted_prob: np.ndarray,
         num_forced: int, expert_bytes: np.ndarray) -> bool:
    """Force `num_forced` sampled experts onto `node`, evicting random non-essential ones when full."""
    block = search.blocks[node]
    held = search.hosts[node].copy()
    fixed = search.fixed(node)
    free = block.capacity_bytes - int(expert_bytes[held].sum())  # bytes: the exact constraint
    forced_any = False
    for _ in range(num_forced):
        score = kick_scores(search, block, weighted_prob)
        score = np.where(held, 0.0, score).ravel()
        if score.sum() <= 0:
            break
        layer, expert = divmod(int(rng.choice(score.size, p=score / score.sum())), held.shape[1])
        need = int(expert_bytes[layer, expert])
        evictable = np.argwhere(held & ~fixed)
        if free + int(expert_bytes[held & ~fixed].sum()) < need:
            break  # cannot make room without dropping a copy coverage needs
        while free < need:
            out = evictable[rng.integers(len(evictable))]
            evictable = evictable[(evictable != out).any(axis=1)]
            held[tuple(out)] = False
            free += int(expert_bytes[tuple(out)])
        held[layer, expert] = True
        free -= need
        forced_any = True
    if forced_any:
        search.apply(node, held, force=True)
    return forced_any


def make_blocks(problem: PlanProblem, model: SlimModel, nodes: list[int], coverage: bool,
                capacity_units) -> list[Block]:
    """Block descriptions for `nodes`; capacity_units(node) -> (unit bytes, C, units [L, E])."""
    if not nodes:
        return []
    edge = np.isin(nodes, model.edge_nodes)  # [B]
    serves = np.stack([np.isfinite(model.node_call(n)).any(axis=(1, 2)) for n in nodes])  # [B, U]
    shared = (serves.astype(np.int64) @ serves.T.astype(np.int64)) > 0  # [B, B]: some user uses both
    if coverage:
        shared |= edge[:, None] & edge[None, :]  # sole-copy status depends on every edge server
    np.fill_diagonal(shared, False)
    nodes_arr = np.asarray(nodes, dtype=np.int64)
    blocks = []
    for i, n in enumerate(nodes):
        unit, capacity, units = capacity_units(n)
        users = np.flatnonzero(serves[i])
        blocks.append(Block(node=n, users=users, call=model.node_call(n)[users], capacity=capacity, units=units,
                            unit=unit, capacity_bytes=int(problem.capacity_bytes[n]),
                            related=nodes_arr[shared[i]], is_edge=bool(edge[i]), charge=node_charge(model, n, users)))
    return blocks


def refine(problem: PlanProblem, model: SlimModel, hosts: np.ndarray, order: list[int], capacity_units,
           settings: SolverSettings, coverage: bool, kicks: int, num_forced: int, seed: int,
           max_work: float = np.inf):
    """Settle, then up to `kicks` kicks, while the value tables built cover fewer than `max_work`
    user-set cells (deterministic work units, never seconds); returns (best hosts [N, L, E], info)."""
    blocks = make_blocks(problem, model, order, coverage, capacity_units)
    search = BlockSearch(problem, model, hosts, blocks, coverage, settings)
    search.max_work = max_work
    start_objective = search.objective()
    sweeps = search.settle(order)
    best_value, best = search.objective(), search.state()
    settled = best_value
    rng = np.random.default_rng(seed)
    weighted_prob = marginal_prob(model, problem.expert_bytes.shape[1]) * model.weight[:, None, None]
    kickable = [b.node for b in blocks if b.capacity > 0 and b.users.size > 0]
    accepted = done = 0
    while kickable and done < kicks and not search.exhausted():
        done += 1
        node = int(rng.choice(kickable))
        if kick(search, node, rng, weighted_prob, num_forced, problem.expert_bytes):
            rest = [n for n in rng.permutation(order).tolist() if n != node]
            search.settle(rest + [node])
            value = search.objective()
            if value < best_value - REL_TOL * best_value:
                best_value, best = value, search.state()
                accepted += 1
                continue
        search.restore(*best)
    info = {"refine_start_s": start_objective, "refine_settled_s": settled, "refine_sweeps": sweeps,
            "kicks": kicks, "kicks_run": done, "kicks_accepted": accepted,
            "refine_stopped_by": "work" if done < kicks and kickable else "kicks", "refine_work": search.work,
            "refine_max_work": max_work,
            "block_solves": search.block_solves, "tables_built": search.tables_built,
            "refine_exact_tables": search.exact_tables}
    return best[0], info
