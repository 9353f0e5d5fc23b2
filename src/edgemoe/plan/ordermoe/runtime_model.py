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
`edgemoe.runtime`: tests/plan/ordermoe/test_planner.py). Its layer rule (`layer_rule.LayerRule.step`, numpy,
and its compiled twin `replay_kernel.propagate_rows`) is one of the copies of the runtime's (the others:
`edgemoe.runtime.policy`, the reference; `runtime.sim.rules._decide_rows`; `runtime.policies.ordermoe_kernel`).

The units: `layer_rule` (one layer's decision for a batch of rows), `reach` (which rows a change can
reach), `incremental` (exact deltas of changes and the patches that apply them), `replay_kernel` (the
compiled replay); this module holds the tables (`PathModel.__init__`), the row sampling and whole replays.

Incremental evaluation: a change of one node's experts at one layer only changes rows whose Top-K set at
that layer meets the changed experts (or, with substitution, their group mates); among those, only the
rows whose next location changes need the later layers replayed. `delta()` does exactly that.
"""

from __future__ import annotations

import numpy as np

from edgemoe.cluster.cost import usable_nodes
from edgemoe.errors import EdgeMoEError
from edgemoe.jit import HAVE_NUMBA

from ..base import PlanProblem
from ..objective import MISS_PENALTY_FACTOR
from .incremental import IncrementalReplay
from .layer_rule import LayerRule
from .reach import ChangeReach
from .replay_state import Replay
from .standins import KINDS, MAX_ENUM_K, QUALITY_POWER, check_kinds

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


class PathModel(LayerRule, ChangeReach, IncrementalReplay):
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
        self.subst_err = np.array(prof.subst_err, dtype=np.float64)  # writable: one compiled propagate_rows signature
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
        # Replays run compiled (`replay_kernel`) where numba imports and the stand-in actions are enumerated;
        # False selects the numpy reference (`LayerRule.step`, `_propagate_numpy`): the same bits.
        self.compiled = HAVE_NUMBA and self.topk.shape[2] <= self.max_enum_k
        # The dense part: every layer's backbone work on the row's home, before its experts (the simulator's
        # order); no placement changes it, so it is one constant beside the replay, not in its layer times.
        dense = np.zeros(self.N) if problem.dense_s is None else np.asarray(problem.dense_s, dtype=np.float64)
        self.dense_token_s = float(self.weight @ (L * dense[self.home]))

    @property
    def num_rows(self) -> int:
        return int(self.user.shape[0])

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
        if self.compiled and record is None:
            # no old replay to come back to: every row runs every layer
            need, block = np.zeros((R, L)), np.zeros((R, L))
            self._run_kernel(hosts, 0, rows, loc[:, 0].copy(), left[:, 0].copy(), lat, loc, left,
                             np.full((R, L + 1), -1, np.int64), np.full((R, L + 1), np.nan), None, need, block, False)
            return Replay(latency_s=lat, location=loc, budget_left=left, q_need=need, q_block=block)
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
