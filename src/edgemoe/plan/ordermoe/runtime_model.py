"""Expected per-token latency of the runtime, by replaying calibration routing paths (pure numpy).

The OrderMoE planner optimises what the runtime will do, not a proxy of it. `PathModel` replays R sampled
calibration tokens (their Top-K experts at every layer, the user whose domain they come from) through the
runtime's layer rule (docs/runtime.md, "Layer cost"), with no queues:

- the K branches start at the token's node c; branch k runs on c when c holds it, else on the cheapest
  usable holder by round trip + compute (the cloud only when no usable non-cloud node holds it: the
  `exact` policy's rule); it is ready at xfer[c, n_k] + compute[n_k, l, e_k];
- `home` mode: the outputs come back to c, the layer costs max_k(ready_k + xfer[n_k, c]);
- `migrate` mode: the outputs meet at the candidate (c, then the branch nodes in slot order) that finishes
  first, where the token continues; the last layer adds the trip home;
- an expert no usable node holds (no cloud, not yet covered) adds `miss_s` to the layer (additive, so the
  search sees the gain of covering each one);
- stand-ins (budget > 0): the ordermoe policy's own myopic choice (H = 0, no pacing weight), through the
  code it uses (`standins`): an action replaces a subset of the branches the token's node lacks (all
  subsets for K <= 4, else the prefixes by latency) by each slot's cheapest allowed stand-in (the node's
  best-ranked group mate, drop and renormalise, or zero; quality cost (gate x error) ** power); each row
  gets budget x L for its pass and takes the fastest action whose cost fits what is left;
- exact_share: every path is also replayed without budget (exact execution), at that share of the weight;
- the dense part: L x the home's per-layer backbone seconds (`PlanProblem.dense_s`) per row, a constant
  beside the replay (no placement changes it).

Rows are decided layer by layer exactly as the runtime decides them, so with budget 0 the replay's layer
latencies equal the `exact` policy's `Decision.latency_s`, and with a budget its stand-ins, quality and
latencies equal the ordermoe policy's at horizon 0 and no quality price (both tested against
`edgemoe.runtime`: tests/plan/ordermoe/test_planner.py). It is one of four copies of the layer rule (the
others: `edgemoe.runtime.policy`, the reference; `runtime.sim.waves._decide_rows`; `runtime.policies.
ordermoe_kernel`).

Incremental evaluation: a change of one node's experts at one layer only changes rows whose Top-K set at
that layer meets the changed experts (or, with substitution, their group mates); among those, only the
rows whose next location changes need the later layers replayed. `delta()` does exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgemoe.cluster.cost import usable_nodes
from edgemoe.errors import EdgeMoEError
from edgemoe.jit import HAVE_NUMBA

from ..base import PlanProblem
from ..objective import MISS_PENALTY_FACTOR
from .replay_kernel import flip_affected_rows, propagate_rows
from .standins import (
    KINDS,
    MAX_ENUM_K,
    QUALITY_POWER,
    check_kinds,
    choose_stand_ins,
    max_over_kept,
    prefix_masks,
    subset_bits,
)

MODES = ("migrate", "home")


def one_way_s(problem: PlanProblem) -> np.ndarray:
    """[N, N] one-way seconds of one hidden state between nodes (0 on the diagonal).

    `problem.xfer_s` when the problem carries it (plan_problem does). Otherwise it is rebuilt from the users'
    round trips comm_s [U, N] (halved, symmetric, as given); pairs of nodes that are nobody's home go
    through the home that joins them fastest.
    """
    N = problem.num_nodes
    if getattr(problem, "xfer_s", None) is not None:
        x = np.asarray(problem.xfer_s, dtype=np.float64).copy()
        np.fill_diagonal(x, 0.0)
        return x
    x = np.full((N, N), np.inf)
    for u, h in enumerate(problem.user_home):
        row = np.asarray(problem.comm_s[u], dtype=np.float64) / 2.0
        x[h] = np.minimum(x[h], row)
        x[:, h] = np.minimum(x[:, h], row)
    np.fill_diagonal(x, 0.0)
    known = np.isfinite(x)
    for h in np.unique(problem.user_home):
        x = np.where(known, x, np.minimum(x, x[:, h, None] + x[None, h, :]))
    np.fill_diagonal(x, 0.0)
    return x


@dataclass(frozen=True)
class Replay:
    """Per-row outcome of a replay. R rows, L layers."""

    latency_s: np.ndarray  # [R, L] seconds of each layer
    location: np.ndarray  # [R, L+1] node at the start of each layer (column L: after the last layer)
    budget_left: np.ndarray  # [R, L+1] remaining quality budget at the start of each layer


class PathModel:
    """Replays sampled calibration paths under a placement; see the module docstring.

    paths_per_user: calibration tokens sampled per user (evenly spaced over its domain's tokens; the
    domain's tokens all when fewer). budget: quality allowance per token-layer (0: exact execution).
    substitutes: [L, E, S] ranked group mates (-1 padded), needed when budget > 0 with "sub" among `kinds`.
    max_rows: cap on the rows (`sample_rows`, both copies with `exact_share`); users with the same home and
    domain share rows. kinds, power,
    max_enum_k: the ordermoe policy's stand-in kinds, quality power and subset enumeration limit.
    exact_share: with budget > 0, the share of the traffic replayed without budget (exact execution, as for
    users without budget or under the `exact` policy): every path is replayed twice, with and without
    budget, weighted 1 - exact_share and exact_share.
    """

    def __init__(self, problem: PlanProblem, mode: str = "migrate", paths_per_user: int = 256, budget: float = 0.0,
                 substitutes: np.ndarray | None = None, max_rows: int | None = None, kinds=KINDS,
                 power: float = QUALITY_POWER, max_enum_k: int = MAX_ENUM_K, exact_share: float = 0.0):
        if mode not in MODES:
            raise EdgeMoEError(f"mode={mode!r}; expected one of {list(MODES)}")
        if budget < 0 or not np.isfinite(budget):
            raise EdgeMoEError(f"budget must be finite and >= 0, got {budget}")
        if not 0.0 <= exact_share <= 1.0:
            raise EdgeMoEError(f"exact_share must be in [0, 1], got {exact_share}")
        self.kinds = check_kinds(kinds)
        if budget > 0 and "sub" in self.kinds and substitutes is None:
            raise EdgeMoEError("a budget > 0 with 'sub' stand-ins needs the substitutes [L, E, S] of the similarity "
                               "groups")
        self.power, self.max_enum_k = float(power), int(max_enum_k)
        self.problem, self.mode, self.budget = problem, mode, float(budget)
        prof = problem.profile
        L, E = problem.expert_bytes.shape
        self.L, self.E, self.N = L, E, problem.num_nodes
        self.xfer = one_way_s(problem)  # [N, N]
        self.rt = self.xfer + self.xfer.T
        self.compute = np.asarray(problem.compute_s, dtype=np.float64)  # [N, L, E]
        self.is_cloud = problem.is_cloud
        self.usable = usable_nodes(problem.node_kind, problem.user_home)  # [U, N]
        twice = budget > 0 and exact_share > 0
        users, tokens, weight = sample_rows(problem, paths_per_user,
                                            max_rows if max_rows is None or not twice else max(1, max_rows // 2))
        row_budget = np.full(users.size, float(budget))
        if twice:
            # the same paths once more, run exactly (a user without budget: no stand-in at all), weighted
            # exact_share; the policy's copy keeps the rest
            users, tokens = np.r_[users, users], np.r_[tokens, tokens]
            weight = np.r_[(1.0 - exact_share) * weight, exact_share * weight]
            row_budget = np.r_[row_budget, np.zeros(row_budget.size)]
        self.row_budget = row_budget  # [R] quality allowance per token-layer of each row
        self.exact_share = float(exact_share) if budget > 0 else 0.0
        self.user, self.weight = users, weight  # [R]
        self.home = np.asarray(problem.user_home, dtype=np.int64)[users]
        self.topk = np.asarray(prof.topk, dtype=np.int64)[tokens]  # [R, L, K]
        self.gates = np.abs(np.asarray(prof.gates, dtype=np.float64)[tokens])  # [R, L, K]
        finite = self.rt[np.isfinite(self.rt)].max() + self.compute.max()
        self.miss_s = MISS_PENALTY_FACTOR * float(finite)  # SlimCaching objective's penalty for a miss
        self.subs = np.zeros((L, E, 0), np.int64) if substitutes is None else np.asarray(substitutes, dtype=np.int64)
        self.subst_err = np.asarray(prof.subst_err, dtype=np.float64)
        # rows_with[l][e]: rows whose Top-K set at layer l contains e (the rows a change of (l, e) touches)
        self._touched: dict = {}
        self.rows_with = [[np.flatnonzero((self.topk[:, layer] == e).any(axis=1)) for e in range(E)]
                          for layer in range(L)]
        # Who a change at a node can reach (`affected`): shared servers are compared through `holder_table`;
        # a device serves only its owner, so its rows are the owner's.
        is_device = np.array([k == "device" for k in problem.node_kind])
        self.servers = np.flatnonzero(~is_device & ~self.is_cloud)  # [S]
        self.is_server = ~is_device & ~self.is_cloud  # [N]
        self.device = np.where(is_device[self.home], self.home, -1)  # [R] the row's own device, -1 none
        # The dense part: every layer's backbone work on the row's home, before its experts (the simulator's
        # order); no placement changes it, so it is one constant beside the replay, not in its layer times.
        # incremental replays run compiled (`replay_kernel`) where numba imports and the stand-in actions are
        # enumerated; False selects the numpy reference (`_propagate_numpy`), the same bits
        self.compiled = HAVE_NUMBA and self.topk.shape[2] <= self.max_enum_k
        dense = np.zeros(self.N) if problem.dense_s is None else np.asarray(problem.dense_s, dtype=np.float64)
        self.dense_token_s = float(self.weight @ (L * dense[self.home]))

    @property
    def num_rows(self) -> int:
        return int(self.user.shape[0])

    # ------------------------------------------------------------------------------------ one layer
    def step(self, hosts: np.ndarray, layer: int, rows: np.ndarray, loc: np.ndarray, left: np.ndarray, flip=None,
             record: dict | None = None):
        """Decide `layer` for `rows` [R'] at nodes `loc` [R'] with budget `left` [R'] under hosts [N, L, E].

        flip: None, or (nodes [R'], changed [R', F] (-1 padded), value): row i sees
        hosts[nodes[i], layer, changed[i]] = value (a batch of candidate placements, one call).
        record: a dict that receives the stand-ins taken, "kind" [R', K] (-1: run exactly, else the index into
        KINDS), and their "quality" [R'].
        Returns (latency [R'], next location [R'], budget left after [R']).
        """
        experts = self.topk[rows, layer]  # [R', K]
        gates = self.gates[rows, layer]
        # Only the nodes holding a branch's expert can serve it: [R', K, H] columns of holders (H = most copies
        # of one expert at this layer, a few on a large cluster), not [R', K, N], so a row costs the same
        # whatever the number of nodes.
        cols = self.holders(hosts, layer)[experts]  # [R', K, H], -1 padded
        held = cols >= 0
        local = hosts[loc[:, None], layer, experts]  # [R', K]
        if flip is not None:
            nodes, changed, value = flip
            hit = (experts[:, :, None] == changed[:, None, :]).any(axis=2)  # [R', K]
            # The flipped node leaves the holder columns and comes back as one extra column when it is added.
            held &= ~(hit[:, :, None] & (cols == nodes[:, None, None]))
            cols = np.concatenate([cols, np.broadcast_to(nodes[:, None, None], (*hit.shape, 1))], axis=2)
            held = np.concatenate([held, (hit & value)[:, :, None]], axis=2)
            local = np.where(hit & (loc == nodes)[:, None], value, local)
        node, miss = self._replicas(layer, rows, loc, experts, cols, held, local)
        if self.budget > 0 and self.kinds:
            return self._step_standins(hosts, layer, rows, loc, left, experts, gates, node, miss, flip, record)
        lat, nxt = self._finish(layer, rows, loc, experts, node, miss)
        if record is not None:
            record["kind"], record["quality"] = np.full(experts.shape, -1, np.int64), np.zeros(rows.size)
        return lat, nxt, left

    def holders(self, hosts: np.ndarray, layer: int) -> np.ndarray:
        """[E, H] nodes holding each expert at `layer` under hosts [N, L, E], ascending, -1 padded (H >= 1)."""
        e_idx, n_idx = np.nonzero(hosts[:, layer].T)  # by expert, then node
        count = np.bincount(e_idx, minlength=self.E)
        table = np.full((self.E, max(int(count.max(initial=0)), 1)), -1, dtype=np.int64)
        table[e_idx, np.arange(e_idx.size) - (np.cumsum(count) - count)[e_idx]] = n_idx
        return table

    def _replicas(self, layer, rows, loc, experts, cols, held, local):
        """([R', K] node of each branch, [R', K] bool no usable holder) by the `exact` policy's rule: the token's
        node if it holds the expert (local [R', K]), else the usable holder (cols/held [R', K, H]) of least
        round trip + compute, the cloud only when no other holder is usable; ties to the lowest node index."""
        at = np.maximum(cols, 0)
        cand = held & self.usable[self.user[rows][:, None, None], at]
        if self.is_cloud.any():
            edge = cand & ~self.is_cloud[at]
            cand = np.where(edge.any(axis=2, keepdims=True), edge, cand)
        cost = np.where(cand, self.rt[loc[:, None, None], at] + self.compute[at, layer, experts[:, :, None]], np.inf)
        best = cost.min(axis=2, initial=np.inf)
        node = np.where(cand & (cost == best[..., None]), at, self.N).min(axis=2, initial=self.N)
        # Nothing finite (no usable holder): node 0, what an argmin over all-infinite costs gives.
        node = np.where(np.isfinite(best), node, 0)
        miss = ~cand.any(axis=2) & ~local
        node = np.where(local, loc[:, None], node)
        return node, miss

    def _finish(self, layer, rows, loc, experts, node, miss, skip=None):
        """([R'] layer seconds, [R'] next location) of branches on `node` [R', K] (miss: [R', K] unreachable;
        skip: [R', K] not run, dropped or zeroed)."""
        R = loc.shape[0]
        comp = self.compute[node, layer, experts]
        ready = self.xfer[loc[:, None], node] + comp  # [R', K]
        # An unreachable branch adds the miss penalty on top of the layer (additive, so covering any one
        # missing expert already pays) and takes no part in the max or the meeting; neither does a skipped one.
        penalty = self.miss_s * miss.sum(axis=1)
        if skip is not None:
            miss = miss | skip
        ready = np.where(miss, -np.inf, ready)
        if self.mode == "home":
            back = np.where(miss, 0.0, self.xfer[node, loc[:, None]])
            return np.max(ready + back, axis=1, initial=0.0) + penalty, loc.copy()
        node = np.where(miss, loc[:, None], node)
        cand = np.concatenate([loc[:, None], node], axis=1)  # [R', K+1]
        to = self.xfer[node[:, :, None], cand[:, None, :]]  # [R', K, K+1]
        done = np.maximum(np.max(ready[:, :, None] + to, axis=1), 0.0)  # [R', K+1]
        if layer == self.L - 1:
            done = done + self.xfer[cand, self.home[rows][:, None]]
        pick = done.argmin(axis=1)
        ar = np.arange(R)
        return done[ar, pick] + penalty, cand[ar, pick]

    def _finish_actions(self, layer, rows, loc, experts, node, miss, mask, order, is_sub, sub):
        """([R', M] layer seconds, [R', M] next location) of every action at once: action m runs slot k exactly
        on node [R', K] unless mask [R', M, K] (every subset, order None, or the prefixes in `order` [R', K]:
        `standins.max_over_kept`); a masked slot runs sub [R', K] at the token's node where is_sub [R', M, K],
        else not at all. The same sums and maxima as `_finish` on each action alone: the max over kept exact
        slots, and the max over substitutes of (compute at the token's node) plus the one transfer from there
        (rounding is monotone, so that is the max of the sums); a substitute's node is the token's,
        candidate 0, which wins that tie, so a masked slot is no candidate."""
        R, K = experts.shape
        ready_x = self.xfer[loc[:, None], node] + self.compute[node, layer, experts]  # [R', K]
        here = self.xfer[loc, loc]  # [R'] (0: the token's own node)
        ready_s = here[:, None] + self.compute[loc[:, None], layer, np.maximum(sub, 0)]  # [R', K]
        sub_ready = np.where(is_sub, ready_s[:, None, :], -np.inf).max(axis=2)  # [R', M]
        penalty = self.miss_s * miss.sum(axis=1)
        if self.mode == "home":
            back = np.where(miss, -np.inf, ready_x + self.xfer[node, loc[:, None]])
            lat = np.maximum(max_over_kept(back[:, :, None], mask, order)[:, :, 0], sub_ready + here[:, None])
            lat = np.maximum(lat, 0.0) + penalty[:, None]
            return lat, np.broadcast_to(loc[:, None], lat.shape).copy()
        node = np.where(miss, loc[:, None], node)
        cand = np.concatenate([loc[:, None], node], axis=1)  # [R', K+1]
        arrive = np.where(miss[:, :, None], -np.inf, ready_x[:, :, None] + self.xfer[node[:, :, None], cand[:, None, :]])
        done = max_over_kept(arrive, mask, order)  # [R', M, K+1]
        np.maximum(done, sub_ready[:, :, None] + self.xfer[loc[:, None], cand][:, None, :], out=done)
        np.maximum(done, 0.0, out=done)
        if layer == self.L - 1:
            done = done + self.xfer[cand, self.home[rows][:, None]][:, None, :]
        done[:, :, 1:][mask] = np.inf  # a slot not run exactly is no candidate
        pick = done.argmin(axis=2)  # [R', M]
        lat = np.take_along_axis(done, pick[..., None], 2)[..., 0] + penalty[:, None]
        return lat, np.take_along_axis(cand, pick, 1)

    def _step_standins(self, hosts, layer, rows, loc, left, experts, gates, node, miss, flip, record=None):
        """The ordermoe policy's myopic stand-in choice (H = 0, no pacing weight): among the actions that replace
        a subset of the replaceable branches (those the token's node lacks and some usable node holds) by their
        cheapest stand-in (`standins.choose_stand_ins`: the node's best-ranked group mate, drop and renormalise,
        or zero), the fastest whose quality cost fits what is left; ties to less quality, then to the first
        action (subset index order, the runtime's argmin). record: a dict that receives "kind" [R', K] (-1 exact,
        else the index into KINDS) and "quality" [R'] of the actions taken."""
        R, K = experts.shape
        sub = np.full((R, K), -1, np.int64)
        if "sub" in self.kinds and self.subs.shape[2] > 0:
            # the best-ranked group mate the token's node holds (the runtime's `best_local_substitutes`)
            mates = self.subs[layer, experts]  # [R', K, S]
            ok = hosts[loc[:, None, None], layer, np.maximum(mates, 0)]
            if flip is not None:
                nodes, changed, value = flip
                hit = (mates[..., None] == changed[:, None, None, :]).any(axis=3)  # [R', K, S]
                ok = np.where(hit & (loc == nodes)[:, None, None], value, ok)
            ok &= mates >= 0
            sub = np.where(ok.any(axis=2), np.take_along_axis(mates, ok.argmax(axis=2)[..., None], 2)[..., 0], -1)
        sub_err = np.where(sub >= 0, self.subst_err[layer, experts, np.maximum(sub, 0)], np.inf)
        best_lat, best_nxt = self._finish(layer, rows, loc, experts, node, miss)
        best_q = np.zeros(R)
        kind_taken = np.full((R, K), -1, np.int64)
        replaceable = (node != loc[:, None]) & ~miss  # a missing expert keeps its penalty: never stood in for
        # only these rows have a choice (a row without budget has none: the runtime's has_budget rule)
        some = np.flatnonzero(replaceable.any(axis=1) & (self.row_budget[rows] > 0))
        if some.size:
            if K <= self.max_enum_k:  # every subset (action 0: none, never taken here)
                order, mask = None, np.broadcast_to(subset_bits(K)[None], (some.size, 2 ** K, K))
            else:  # the runtime's prefixes by remote latency (without its queue load: the replay has none)
                ready = self.xfer[loc[some, None], node[some]] + self.compute[node[some], layer, experts[some]]
                order, mask = prefix_masks(ready, replaceable[some])
            lay = np.full(some.size, layer)
            kind, cost = choose_stand_ins(lay, experts[some], gates[some], sub[some], sub_err[some], self.subst_err,
                                          mask, self.kinds, self.power)
            valid = ~(mask & (~replaceable[some][:, None, :] | ~np.isfinite(cost))).any(axis=2)  # [S', M]
            q = np.where(mask, np.where(np.isfinite(cost), cost, 0.0), 0.0).sum(axis=2)
            valid &= q <= left[some][:, None] + 1e-12
            valid[:, 0] = False  # action 0 is the exact execution, already in best_*
            if valid.any():
                is_sub = mask & (kind == 0)
                lat, nxt = self._finish_actions(layer, rows[some], loc[some], experts[some], node[some], miss[some],
                                                mask, order, is_sub, sub[some])
                # the policy's cost with alpha = 1, beta = 0: seconds + EPS x quality; the first least action
                score = np.where(valid, lat + 1e-9 * q, np.inf)  # [S', M]
                pick = score.argmin(axis=1)
                ar = np.arange(some.size)
                # kept only if strictly better than no stand-in (action 0, first in the runtime's argmin)
                better = score[ar, pick] < best_lat[some] + 1e-9 * best_q[some]
                r, ar, pick = some[better], ar[better], pick[better]
                best_lat[r], best_nxt[r], best_q[r] = lat[ar, pick], nxt[ar, pick], q[ar, pick]
                kind_taken[r] = np.where(mask[ar, pick], kind[ar, pick], -1)
        if record is not None:
            record["kind"], record["quality"] = kind_taken, best_q
        return best_lat, best_nxt, left - best_q

    # --------------------------------------------------------------------------------- whole paths
    def replay(self, hosts: np.ndarray, record: dict | None = None) -> Replay:
        """Replay every row through every layer under hosts [N, L, E]. record: a dict that receives the
        stand-ins taken, "kind" [R, L, K] (-1: run exactly, else the index into KINDS), and "quality" [R, L]."""
        R, L = self.num_rows, self.L
        lat = np.zeros((R, L))
        loc = np.zeros((R, L + 1), np.int64)
        left = np.zeros((R, L + 1))
        loc[:, 0] = self.home
        left[:, 0] = self.row_budget * L
        rows = np.arange(R)
        parts = []
        for layer in range(L):
            part = {} if record is not None else None
            lat[:, layer], loc[:, layer + 1], left[:, layer + 1] = self.step(hosts, layer, rows, loc[:, layer],
                                                                               left[:, layer], record=part)
            parts.append(part)
        if record is not None:
            record["kind"] = np.stack([p["kind"] for p in parts], axis=1)
            record["quality"] = np.stack([p["quality"] for p in parts], axis=1)
        return Replay(latency_s=lat, location=loc, budget_left=left)

    def expected_latency(self, hosts: np.ndarray) -> float:
        """Weighted mean per-token latency (seconds, the MoE layers' replay + the dense part) under hosts
        [N, L, E]."""
        return float(self.weight @ self.replay(hosts).latency_s.sum(axis=1)) + self.dense_token_s

    def expected_parts(self, state: Replay) -> tuple[float, float]:
        """(seconds, seconds): the expected per-token latency (dense part included) of the rows with budget (the
        policy's) and of those without (exact execution), each on its own weight; nan for a part with no rows."""
        tok = state.latency_s.sum(axis=1)
        out = []
        for rows in (self.row_budget > 0, self.row_budget <= 0):
            w = self.weight[rows]
            out.append(float(w @ tok[rows]) / float(w.sum()) + self.dense_token_s if w.sum() > 0 else float("nan"))
        return out[0], out[1]

    def touched_rows(self, layer: int, experts) -> np.ndarray:
        """[R'] rows whose set at `layer` contains one of `experts` (or, with substitution, a group mate)."""
        experts = set(int(e) for e in experts)
        if len(experts) == 1 and self._touched.get((layer, *experts)) is not None:
            return self._touched[(layer, *experts)]
        key = (layer, *experts) if len(experts) == 1 else None
        if self.budget > 0 and "sub" in self.kinds:
            for e in list(experts):
                experts |= {int(m) for m in self.subs[layer, e] if m >= 0}
                experts |= {int(m) for m in np.flatnonzero((self.subs[layer] == e).any(axis=1))}
        parts = [self.rows_with[layer][e] for e in sorted(experts)]
        rows = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        if key is not None:
            self._touched[key] = rows
        return rows

    # ------------------------------------------------------------------------- who a change reaches
    def holder_table(self, held: np.ndarray, layer: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([N, X] node, [N, X] seconds): for a token at each node c, the shared server (not a device, not the
        cloud) the exact rule would send a branch of experts[x] to among the holders in held [N, E] at `layer`:
        least round trip + compute, first index on ties (as `_replicas`); node -1 where none is finite."""
        s = self.servers
        cost = self.rt[:, s, None] + self.compute[s][:, layer, experts][None]  # [N, S, X]
        cost = np.where(held[s][:, experts][None], cost, np.inf)
        if s.size == 0:
            return np.full((self.N, len(experts)), -1), np.full((self.N, len(experts)), np.inf)
        pick = cost.argmin(axis=1)  # [N, X]
        best = np.take_along_axis(cost, pick[:, None], axis=1)[:, 0]
        return np.where(np.isfinite(best), s[pick], -1), best

    def affected(self, state: Replay, layer: int, rows: np.ndarray, before: np.ndarray,
                 after: np.ndarray) -> np.ndarray:
        """[R'] bool: rows whose decision at `layer` may differ between hosts before and after ([N, E] at
        `layer`). A superset, so deltas stay exact: the others run the same branches on the same nodes and
        keep their old values bit for bit. A row can only feel a change when it sits on a changed node (local
        hits, substitutes), owns a changed device, or one of its branches' experts changed and the shared server
        that branch goes to (`holder_table`) is not the same before and after while the token's node lacks it."""
        diff = before != after
        nodes = diff.any(axis=1)  # [N]
        if (nodes & self.is_cloud).any():
            return np.ones(rows.size, bool)  # the cloud is everyone's fallback: no cheap test
        loc = state.location[rows, layer]
        dev = self.device[rows]
        keep = nodes[loc] | ((dev >= 0) & nodes[np.maximum(dev, 0)])
        experts = np.flatnonzero(diff.any(axis=0))
        if experts.size == 0:
            return keep
        old_n, old_c = self.holder_table(before, layer, experts)
        new_n, new_c = self.holder_table(after, layer, experts)
        moved = (old_n != new_n) | ~np.isfinite(old_c) | ~np.isfinite(new_c)  # [N, X]
        pos = np.full(self.E, -1)
        pos[experts] = np.arange(experts.size)
        ek = self.topk[rows, layer]  # [R', K]
        x = pos[ek]
        hit = (x >= 0) & moved[loc[:, None], np.maximum(x, 0)]  # [R', K] the branch's server changed
        return keep | (hit & ~before[loc[:, None], ek]).any(axis=1)

    def flip_affected(self, state: Replay, hosts: np.ndarray, layer: int, rows: np.ndarray, nodes: np.ndarray,
                      changed: np.ndarray, value: bool) -> np.ndarray:
        """[R'] bool: `affected` for a batch of candidates, row i seeing hosts[nodes[i], layer, changed[i]] = value
        (changed [R', W], -1 padded). Adding a server copy reaches a branch only if that server is at least as
        fast as the branch's current server (or there is none); removing one only if it was that server."""
        loc = state.location[rows, layer]
        keep = (loc == nodes) | (self.device[rows] == nodes) | ~self.is_server[nodes]
        experts = np.unique(changed[changed >= 0])
        if experts.size == 0:
            return keep
        held = hosts[:, layer]
        old_n, old_c = self.holder_table(held, layer, experts)
        pos = np.full(self.E, -1)
        pos[experts] = np.arange(experts.size)
        if self.compiled:
            return flip_affected_rows(rows, int(layer), loc, nodes, changed, bool(value), self.device, self.is_server,
                                      self.topk, np.ascontiguousarray(held), old_n, old_c, pos, self.rt, self.compute)
        ek = self.topk[rows, layer]  # [R', K]
        xs = np.maximum(pos[ek], 0)
        mine = (ek[:, :, None] == changed[:, None, :]).any(axis=2)  # [R', K] the branch's expert flips
        server = old_n[loc[:, None], xs]  # [R', K]
        if value:
            cost = self.rt[loc, nodes][:, None] + self.compute[nodes[:, None], layer, ek]
            moved = (server < 0) | (cost <= old_c[loc[:, None], xs])
        else:
            moved = (server < 0) | (server == nodes[:, None])
        return keep | (mine & moved & ~held[loc[:, None], ek]).any(axis=1)

    def delta(self, state: Replay, hosts: np.ndarray, layer: int, experts, rows: np.ndarray | None = None,
              before: np.ndarray | None = None):
        """Change of the expected latency when `hosts` (already modified at `layer` for `experts`) replaces
        the hosts `state` was replayed under. Returns (seconds, patch); `commit(state, patch)` applies it.
        before: [N, E] hosts at `layer` before the change; when given, only the rows it can reach are replayed
        (`affected`), which is what keeps a change's cost from growing with the cluster."""
        rows = self.touched_rows(layer, experts) if rows is None else rows
        if before is not None and rows.size:
            rows = rows[self.affected(state, layer, rows, before, hosts[:, layer])]
        if rows.size == 0:
            return 0.0, None
        d, patch = self._propagate(state, hosts, layer, rows, None)
        return float(d.sum()), patch

    def delta_batch(self, state: Replay, hosts: np.ndarray, layer: int, experts, nodes: np.ndarray,
                    value: bool) -> np.ndarray:
        """[V] change of the expected latency if hosts[nodes[v], layer, experts] were set to `value`
        (one candidate per node, the others untouched), all in one vectorised replay."""
        nodes = np.asarray(nodes, dtype=np.int64)
        changed = np.asarray(list(experts), dtype=np.int64)
        return self._batch(state, hosts, layer, nodes, [changed] * nodes.size, value)

    def delta_singles(self, state: Replay, hosts: np.ndarray, layer: int, node: int, experts: np.ndarray,
                      value: bool) -> np.ndarray:
        """[V] change of the expected latency if hosts[node, layer, experts[v]] alone were set to `value`."""
        experts = np.asarray(experts, dtype=np.int64)
        return self._batch(state, hosts, layer, np.full(experts.size, node), [experts[v:v + 1] for v in range(experts.size)],
                           value)

    def _batch(self, state, hosts, layer, nodes, changed: list, value: bool) -> np.ndarray:
        """[V] deltas of V candidates: candidate v sets hosts[nodes[v], layer, changed[v]] = value."""
        V = nodes.size
        parts, owner = [], []
        for v in range(V):
            rows = self.touched_rows(layer, changed[v])
            # Only rows whose user may use the node can feel a change there (a device serves its owner).
            rows = rows[self.usable[self.user[rows], nodes[v]]]
            parts.append(rows)
            owner.append(np.full(rows.size, v))
        rows = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if rows.size == 0:
            return np.zeros(V)
        vi = np.concatenate(owner)
        width = max(c.size for c in changed)
        table = np.full((V, width), -1, np.int64)
        for v, c in enumerate(changed):
            table[v, :c.size] = c
        near = self.flip_affected(state, hosts, layer, rows, nodes[vi], table[vi], value)
        rows, vi = rows[near], vi[near]
        if rows.size == 0:
            return np.zeros(V)
        flip = (nodes[vi], table[vi], value)
        d, _ = self._propagate(state, hosts, layer, rows, flip)
        return np.bincount(vi, weights=d, minlength=V)

    def _propagate(self, state: Replay, hosts, layer, rows, flip, groups=None):
        """Replay `rows` [R'] (possibly repeated) from `layer` on; ([R'] weighted delta per row, patch).

        Compiled (`replay_kernel.propagate_rows`, the same bits) where numba imports and the stand-in actions
        are enumerated (K <= max_enum_k); else `_propagate_numpy`, the reference."""
        if not self.compiled:
            return self._propagate_numpy(state, hosts, layer, rows, flip)
        old = state.latency_s[rows, layer:].sum(axis=1)
        new_lat = state.latency_s[rows].copy()
        new_loc = state.location[rows].copy()
        new_left = state.budget_left[rows].copy()
        self._run_kernel(hosts, layer, rows, new_loc[:, layer], new_left[:, layer], new_lat, new_loc, new_left,
                         state.location[rows], state.budget_left[rows], flip)
        diff = self.weight[rows] * (new_lat[:, layer:].sum(axis=1) - old)
        return diff, (rows, new_lat, new_loc, new_left)

    def holders_all(self, hosts: np.ndarray) -> np.ndarray:
        """[L, E, H] `holders` of every layer, -1 padded to the most copies of one expert at any layer."""
        tables = [self.holders(hosts, layer) for layer in range(self.L)]
        H = max(t.shape[1] for t in tables)
        out = np.full((self.L, self.E, H), -1, dtype=np.int64)
        for layer, t in enumerate(tables):
            out[layer, :, :t.shape[1]] = t
        return out

    def _run_kernel(self, hosts, layer, rows, loc0, left0, new_lat, new_loc, new_left, old_loc, old_left, flip):
        """`replay_kernel.propagate_rows` on this model's tables (arrays as there; flip as in `step`)."""
        if flip is None:
            f_node, f_changed, f_value = np.zeros(rows.size, np.int64), np.full((rows.size, 1), -1, np.int64), False
        else:
            f_node, f_changed, f_value = flip
        propagate_rows(np.ascontiguousarray(rows, dtype=np.int64), int(layer), np.ascontiguousarray(loc0),
                       np.ascontiguousarray(left0), new_lat, new_loc, new_left, old_loc, old_left,
                       flip is not None, np.ascontiguousarray(f_node, dtype=np.int64),
                       np.ascontiguousarray(f_changed, dtype=np.int64), bool(f_value),
                       np.ascontiguousarray(hosts, dtype=np.bool_), self.holders_all(hosts), self.topk, self.gates,
                       self.user, self.home, self.usable, self.rt, self.xfer, self.compute, self.is_cloud,
                       bool(self.is_cloud.any()), float(self.miss_s), self.mode == "home", self.subs, self.subst_err,
                       self.row_budget, bool(self.budget > 0 and self.kinds), "sub" in self.kinds and self.subs.shape[2] > 0,
                       "drop" in self.kinds, "zero" in self.kinds, float(self.power))

    def _propagate_numpy(self, state: Replay, hosts, layer, rows, flip):
        """`_propagate` in numpy (the reference of `replay_kernel`)."""
        old = state.latency_s[rows, layer:].sum(axis=1)
        lat_l, nxt, left = self.step(hosts, layer, rows, state.location[rows, layer], state.budget_left[rows, layer],
                                     flip)
        new_lat = state.latency_s[rows].copy()
        new_loc = state.location[rows].copy()
        new_left = state.budget_left[rows].copy()
        new_lat[:, layer], new_loc[:, layer + 1], new_left[:, layer + 1] = lat_l, nxt, left
        moved = (nxt != state.location[rows, layer + 1]) | (left != state.budget_left[rows, layer + 1])
        sub = np.flatnonzero(moved)
        for later in range(layer + 1, self.L):
            if sub.size == 0:
                break
            r = rows[sub]
            lat2, nxt2, left2 = self.step(hosts, later, r, new_loc[sub, later], new_left[sub, later])
            new_lat[sub, later] = lat2
            new_loc[sub, later + 1], new_left[sub, later + 1] = nxt2, left2
            # A row back at its old location with its old budget replays the old way from here on (later
            # layers' hosts did not change), and its copied old values already say so.
            back = (nxt2 == state.location[r, later + 1]) & (left2 == state.budget_left[r, later + 1])
            sub = sub[~back]
        diff = self.weight[rows] * (new_lat[:, layer:].sum(axis=1) - old)
        return diff, (rows, new_lat, new_loc, new_left)

    @staticmethod
    def commit(state: Replay, patch) -> None:
        """Write a `delta` patch into `state` (in place)."""
        if patch is None:
            return
        rows, lat, loc, left = patch
        state.latency_s[rows] = lat
        state.location[rows] = loc
        state.budget_left[rows] = left


MIN_PATHS = 16  # paths per user group that the row cap never goes below


def sample_rows(problem: PlanProblem, paths_per_user: int,
                max_rows: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([R] user, [R] calibration token, [R] weight): up to `paths_per_user` tokens of each user's domain,
    evenly spaced (deterministic); weights w_u / (tokens sampled for u), so they sum to 1.

    Users with the same home and domain would replay identical rows (same tokens, same start, same usable
    nodes), so they share one set of rows (user: the first of them) carrying their summed weight. max_rows:
    when the groups x paths_per_user would exceed it, each group gets max(MIN_PATHS, max_rows // groups)
    paths instead, so the rows (and every evaluation's cost) stop growing with the number of users.
    """
    if paths_per_user < 1:
        raise EdgeMoEError(f"paths_per_user must be >= 1, got {paths_per_user}")
    if max_rows is not None and max_rows < 1:
        raise EdgeMoEError(f"max_rows must be >= 1, got {max_rows}")
    domain = np.asarray(problem.profile.domain, dtype=np.int64)
    user_domain = np.asarray(problem.user_domain, dtype=np.int64)
    home = np.asarray(problem.user_home, dtype=np.int64)
    groups: dict[tuple[int, int], list[int]] = {}
    for u in range(user_domain.size):
        groups.setdefault((int(home[u]), int(user_domain[u])), []).append(u)
    per_group = paths_per_user
    if max_rows is not None and len(groups) * paths_per_user > max_rows:
        per_group = max(MIN_PATHS, max_rows // len(groups))
    users, tokens, weight = [], [], []
    for (_, d), members in groups.items():  # in order of each group's first user
        pool = np.flatnonzero(domain == d)
        if pool.size == 0:
            pool = np.arange(domain.size)
        take = pool if pool.size <= per_group else pool[np.linspace(0, pool.size - 1, per_group).astype(np.int64)]
        users.append(np.full(take.size, members[0]))
        tokens.append(take)
        w = problem.user_weight[members[0]] if len(members) == 1 else float(np.sum(problem.user_weight[members]))
        weight.append(np.full(take.size, w / take.size))
    return np.concatenate(users), np.concatenate(tokens), np.concatenate(weight)
