"""OrderMoE's runtime: quality- and trajectory-aware server-expert selection (ALGORITHMS.md §3.4.4).

Per token row and layer, with the token at node c, routed experts A [K] and gates g [K]:

- exact: each branch on c if c holds it, else on a usable replica;
- stand-ins for a non-local branch k: c's best-ranked local substitute (original gate), zero the branch, or
  drop it and renormalise; each has a predicted quality cost from the measured output errors
  (`stand_in_costs`, squared by default) and the slot takes the cheapest;
- actions: subsets X of the non-local branches get stand-ins (all 2^K for K <= `max_enum_k`, else the K+1
  prefixes by remote latency); steered (H >= 1, migrate mode) each subset also names the meeting node g
  where the token continues from, with each exact branch on the replica that reaches g first;
- feasible iff q(X) <= remaining budget of the row (and the row has a budget at all);
- choose argmin J = alpha_u * (lat(X, g) + Phi_H[l+1](g, key(A), b - q(X))) + (beta + eps) * q(X).

Phi_H is the expected latency of the next H layers when they act optimally, from precomputed tables
(`LookAhead`), so the online step is a lookup. H = 0 is the myopic, unsteered ablation: with a zero budget
its decision is exactly `exact`'s. alpha_u and the user's quality weight adapt through `observe`
(docs/runtime.md).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError, require_in_range
from edgemoe.jit import HAVE_NUMBA
from edgemoe.plan.ordermoe.standins import (  # shared with the planner's runtime model (edgemoe.plan.ordermoe.runtime_model)
    KINDS,
    MAX_ENUM_K,
    QUALITY_POWER,
    KindCalibration,
    check_kinds,
    choose_stand_ins,
    max_over_kept,
    prefix_masks,
    subset_bits,
)

from ..context import RuntimeContext
from ..policy import Decision, Policy, TokenState, branch_ready_s, choose_replicas, replica_shortlist, top1
from .baselines import exact_decision
from .exposure import Exposure, ExposureLayer
from .ordermoe_kernel import DecodePath, steered_inputs, steered_pick, weight_steps

EPS_S_PER_Q = 1e-9  # tie-break: between equally fast actions, spend no budget
STEER_REPLICAS = 4  # replicas per branch (besides exact's own choice) that a steered decision considers
TABLE_CHUNK_CELLS = 1 << 22  # rows x actions x levels per block when the look-ahead tables are built
EXPOSURE_MAX_BYTES = 1 << 30  # the queue term's exposure rows above this: a clear error, not an allocation that fails
TABLE_MAX_BYTES = 8 << 30  # the look-ahead's tables (`LookAhead.flat`) above this: a clear error before they are built
STEER_ALL_NODES = 16  # up to this many nodes, a steered decision may meet at any node; beyond, at a replica
COMPILED_STEER = HAVE_NUMBA  # steered decisions by `ordermoe_kernel` (same picks and bits; False: the numpy path)
COMPILED_DECODE = HAVE_NUMBA  # `decide` in one compiled call (`ordermoe_kernel.DecodePath`; same bits; False: numpy)
BACKLOG = "mean"  # the look-ahead's queue term (`LookAhead.backlog_s`): "off" (static tables), "now" or "mean" (`BACKLOGS`)
BACKLOGS = ("off", "now", "mean")  # queue waits priced: none, the current ones (load), their per-node EWMA (node_wait)
COMPILED_LOOP = HAVE_NUMBA  # the simulator's fast engine decides inside its compiled loop (`edgemoe.runtime.sim.ordermoe_loop`;
# same picks and bits; False: the per-wave `decide` call, the reference)


@dataclass(frozen=True)
class Options:
    """The actions of R rows at one layer: M stand-in subsets, each with G meeting choices (G = 1 unsteered),
    A = M x G actions; action a is subset a // G with meeting choice a % G. Per-subset arrays are kept once
    (not repeated G times), and so are the meeting choices (not repeated M times): the [R, A] views below are
    built only on request (look-ahead tables, oracle); `ordermoe`'s decision reads the [R, M, G] forms. A
    steered action's replicas are found for the chosen action only (`exact_node`)."""

    mask: np.ndarray  # [R, M, K] bool: slot not run exactly (substituted, dropped or zeroed)
    valid_m: np.ndarray  # [R, M] bool: only replaceable slots replaced, each by an allowed stand-in
    experts: np.ndarray  # [R, M, K] expert run (-1: not run)
    node_m: np.ndarray  # [R, M, K] node running it (unsteered), or where a replaced slot runs (-1: not run)
    zeroed: np.ndarray  # [R, M, K] bool: not run and zeroed (else, when not run, dropped and renormalised)
    quality_m: np.ndarray  # [R, M]
    next_mg: np.ndarray  # [R, M, G] where the token continues from (steered: a broadcast view of `meet`)
    latency_mg: np.ndarray | None  # [R, M, G] layer seconds (None: steered, left to the compiled decision)
    meet: np.ndarray | None = None  # [R, G] steered: meeting node of each choice
    cand: np.ndarray | None = None  # [R, K, J] steered: candidate replicas of each slot (exact's choice first)
    cand_ready: np.ndarray | None = None  # [R, K, J] steered: when each candidate's output exists (inf: unusable)
    xfer_s: np.ndarray | None = None  # [N, N] steered: the context's transfer times
    sub_ready: np.ndarray | None = None  # [R, M] steered: when the action's last substitute is ready (-inf: none)

    @property
    def G(self) -> int:
        return int(self.next_mg.shape[2])

    def per_action(self, x: np.ndarray) -> np.ndarray:
        """[R, M] -> [R, A]."""
        return x if self.G == 1 else np.repeat(x, self.G, axis=1)

    @property
    def next_location(self) -> np.ndarray:
        """[R, A]."""
        return self.next_mg.reshape(self.next_mg.shape[0], -1)

    @property
    def latency_s(self) -> np.ndarray:
        """[R, A]."""
        return self.latency_mg.reshape(self.latency_mg.shape[0], -1)

    @property
    def quality(self) -> np.ndarray:
        return self.per_action(self.quality_m)

    @property
    def valid(self) -> np.ndarray:
        return self.per_action(self.valid_m)

    @property
    def any_replaced(self) -> np.ndarray:
        return self.per_action(self.mask.any(axis=2))

    def exact_node(self, rows: np.ndarray, g: np.ndarray) -> np.ndarray:
        """[T, K] steered: for rows `rows` [T] meeting at choice g [T], the candidate replica of each slot whose
        output reaches the meeting node first (ties: the first candidate, exact's own choice)."""
        N = self.xfer_s.shape[0]
        cand = self.cand[rows]
        arrive = self.cand_ready[rows] + self.xfer_s.reshape(-1).take(cand * N + self.meet[rows, g][:, None, None])
        return np.take_along_axis(cand, arrive.argmin(axis=2)[:, :, None], 2)[:, :, 0]


def stand_in_costs(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, topk: np.ndarray, gates: np.ndarray,
                   mask: np.ndarray, kinds: tuple[str, ...], power: float = QUALITY_POWER, subs=None,
                   calib: KindCalibration | None = None):
    """Per replaced slot, the stand-in with the least predicted quality cost, and that cost: the token's node's
    best-ranked local group member (`ctx.best_sub`), zeroing, or dropping and renormalising, priced by
    `edgemoe.plan.ordermoe.standins.choose_stand_ins` (shared with the planner's runtime model).

    layer, location: [R]; topk, gates: [R, K]; mask: [R, M, K] slots replaced by each action; subs: None (the
    group member), or (sub [R, K], err [R, K]) each slot's substitute chosen per token and its predicted
    error (`token_substitutes`); calib: None, or the measured nats per kind and layer (`KindCalibration`:
    costs in nats, kinds compared on their measured cost, and a layer left without expert output allowed at
    its measured cost where the calibration has one).
    Returns (kind [R, M, K] index into KINDS, cost [R, M, K] (inf: no stand-in allowed), sub [R, K] ids).
    """
    R, K = topk.shape
    loc, lk = location[:, None], layer[:, None]
    if "sub" not in kinds:
        sub, sub_err = np.full((R, K), -1, np.int64), np.full((R, K), np.inf)
    elif subs is not None:
        sub, sub_err = subs
    else:
        sub, sub_err = ctx.best_sub[loc, lk, topk], ctx.best_sub_err[loc, lk, topk]
    if calib is None:
        kind, cost = choose_stand_ins(layer, topk, gates, sub, sub_err, ctx.subst_err, mask, kinds, power)
    else:
        kind, cost = choose_stand_ins(layer, topk, gates, sub, sub_err, ctx.subst_err, mask, kinds, calib.power,
                                      calib.scale(layer), calib.empty_cost(layer, gates))
    return kind, cost, sub


STAND_IN_CHOICES = ("group", "token")  # where a substitute comes from: the expert's group, or any local expert per token
ROUTER_WEIGHT = 0.5  # w of `token_substitutes`: how much of the measured error the router's agreement may discount


def logit_affinity(topk: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """[R, K, E] how close the token's router ranks each expert e to slot k's routed expert e_k, in [0, 1]:
    exp(min(z_e - z_{e_k}, 0)), the router's probability of e relative to e_k (1: ranked at least as high).
    topk: [R, K]; logits: [R, E] the token's router logits at the layer."""
    z_k = np.take_along_axis(logits, topk, axis=1)  # [R, K]
    return np.exp(np.minimum(logits[:, None, :] - z_k[:, :, None], 0.0))


def coselection_counts(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E, E] how many calibration tokens routed both e and j at layer l (diagonal: tokens routing e).

    topk: [T, L, K] calibration routing."""
    T, L, K = topk.shape
    onehot = np.zeros((T, L, num_experts))
    np.put_along_axis(onehot, topk, 1.0, axis=2)
    return np.einsum("tle,tlj->lej", onehot, onehot)


def coselect_affinity(coselect: np.ndarray, layer: np.ndarray, topk: np.ndarray) -> np.ndarray:
    """[R, K, E] the fallback without router logits (simulator, Ray, look-ahead tables): the share of the
    calibration tokens routing e_k at the layer that also routed e (`coselection_counts` [L, E, E]), in [0, 1]. layer: [R]; topk: [R, K]."""
    co = coselect[layer[:, None], topk]  # [R, K, E]
    own = np.take_along_axis(co, topk[:, :, None], axis=2)  # [R, K, 1] tokens routing e_k
    return co / np.maximum(own, 1.0)


def token_substitutes(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, topk: np.ndarray,
                      affinity: np.ndarray, weight: float = ROUTER_WEIGHT) -> tuple[np.ndarray, np.ndarray]:
    """(sub [R, K], err [R, K]): per slot, the local expert with the least predicted error for this token, and
    that error (-1 / inf: the token's node holds no candidate).

    Candidates are every expert of the layer that the token's node holds and that the token did not route
    (a routed one runs in its own slot; giving its output a second gate is what `drop` prices). The predicted
    error of e for slot k is the measured mean error subst_err[l, e_k, e] discounted by the token's router
    agreement: err = subst_err[l, e_k, e] x (1 - weight x affinity[k, e]) (affinity in [0, 1],
    `logit_affinity` or `coselect_affinity`). Assumption (not calibrated per token): a token whose router
    ranks e nearly as high as e_k sits where the two experts' outputs differ less than on average; weight 0
    is the measured error alone. Ties: the lower id. layer, location: [R]; topk: [R, K]; affinity: [R, K, E]."""
    R, K = topk.shape
    E = ctx.num_experts
    held = ctx.hosts[location[:, None], layer[:, None], np.arange(E)[None, :]]  # [R, E]
    routed = np.zeros((R, E), bool)
    np.put_along_axis(routed, topk, True, axis=1)
    err = ctx.subst_err[layer[:, None], topk] * (1.0 - weight * affinity)  # [R, K, E]
    err = np.where((held & ~routed)[:, None, :], err, np.inf)
    sub = err.argmin(axis=2)  # first minimum: the lower id
    best = np.take_along_axis(err, sub[:, :, None], axis=2)[:, :, 0]
    ok = np.isfinite(best)
    return np.where(ok, sub, -1), np.where(ok, best, np.inf)


def layer_options(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, home: np.ndarray, usable: np.ndarray,
                  topk: np.ndarray, gates: np.ndarray, load: np.ndarray, max_enum_k: int = MAX_ENUM_K,
                  kinds: tuple[str, ...] = KINDS, steer: bool = False, steer_replicas: int = STEER_REPLICAS,
                  power: float = QUALITY_POWER, steered_latency: bool = True, subs=None,
                  calib: KindCalibration | None = None) -> Options:
    """Every action for R rows (layer, location, home [R]; usable [R, N]; topk, gates [R, K]; load [N]).

    An action replaces a subset X of the non-local slots by their cheapest stand-in (`stand_in_costs`) and
    runs the others exactly. Unsteered (the myopic rule): exact slots go where `exact` sends them and the
    token meets its outputs by `meeting_node`'s earliest-finish rule. Steered (migrate mode): the action also
    names the meeting node g among the token's node and each slot's candidate replicas (exact's choice + the
    `steer_replicas` statically cheapest), and each exact slot runs on the replica whose output reaches g
    first; the token continues from g (which may hold none of this layer's experts: it is positioned for
    the next layers). A = M subsets unsteered, M x G steered with G = 1 + K (steer_replicas + 1).
    steered_latency False: a steered result leaves latency_mg None (`ordermoe_kernel.steered_pick` walks it).
    subs: the per-token substitutes (`stand_in_costs`), None: each expert's group member; calib: the measured
    cost per kind and layer (`stand_in_costs`), None: the profile's predicted errors alone.
    """
    R, K = topk.shape
    node_x = choose_replicas(ctx, layer, location, usable, topk, load, "fallback")
    local = node_x == location[:, None]
    unsteered = not steer or ctx.mode == "home"
    # [R, K] when each exact branch is ready where exact runs it (the prefixes' order, the unsteered layer time)
    ready_x = branch_ready_s(ctx, layer, location, topk, node_x, load) if unsteered or K > max_enum_k else None
    if K <= max_enum_k:
        order = None
        mask = np.broadcast_to(subset_bits(K)[None], (R, 2 ** K, K))
    else:
        order, mask = prefix_masks(ready_x, ~local)  # prefix j replaces the j slowest non-local slots
    M = mask.shape[1]
    kind, q_alt, sub = stand_in_costs(ctx, layer, location, topk, gates, mask, kinds, power, subs, calib)
    valid = ~(mask & (local[:, None, :] | ~np.isfinite(q_alt))).any(axis=2)
    is_sub = mask & (kind == 0)
    experts = np.where(mask, np.where(is_sub, sub[:, None, :], -1), topk[:, None, :])
    zeroed = mask & (kind == 2)
    quality = np.where(mask, np.where(np.isfinite(q_alt), q_alt, 0.0), 0.0).sum(axis=2)
    stand_node = np.where(is_sub, location[:, None, None], -1)  # [R, M, K] where a replaced slot runs
    # a substitute runs at the token's node: ready after its load and compute (+ the zero transfer, as
    # branch_ready_s adds it); a slot's exact branch is the same in every action, so both are [R, K]
    sub_ok = sub >= 0
    ready_sub = 0.0 + load[location][:, None] + ctx.compute_s[location[:, None], layer[:, None], np.where(sub_ok, sub, 0)]
    if unsteered:
        node = np.where(mask, stand_node, node_x[:, None, :])
        nxt, lat = unsteered_meeting(ctx, layer, location, home, node_x, ready_x, ready_sub, mask, is_sub, order)
        return Options(mask=mask, valid_m=valid, experts=experts, node_m=node, zeroed=zeroed, quality_m=quality,
                       next_mg=nxt[:, :, None], latency_mg=lat[:, :, None])
    # -- steered: candidate runners per slot [R, K, J] and meeting nodes [R, G]
    xfer, comp = ctx.xfer_s, ctx.compute_s
    short, real = replica_shortlist(ctx, "fallback").candidates(layer, location, topk, steer_replicas)
    N = ctx.num_nodes
    if not steered_latency:  # for the compiled decision: the values below, in one compiled call
        cand, base, meet, sub_first = steered_inputs(layer, location, topk, node_x, short, real, usable, xfer, load, comp,
                                                     is_sub, ready_sub, N <= STEER_ALL_NODES)
        return Options(mask=mask, valid_m=valid, experts=experts, node_m=stand_node, zeroed=zeroed, quality_m=quality,
                       next_mg=np.broadcast_to(meet[:, None, :], (R, M, meet.shape[1])), latency_mg=None, meet=meet,
                       cand=cand, cand_ready=base, xfer_s=xfer, sub_ready=sub_first)
    cand = np.concatenate([node_x[:, :, None], short], axis=2)  # exact's own choice first
    ok = np.concatenate([np.ones((R, K, 1), bool), real], axis=2)
    ok &= np.take_along_axis(usable[:, None, :], cand.reshape(R, 1, -1), 2).reshape(cand.shape)
    cand = np.where(ok, cand, node_x[:, :, None])
    J = cand.shape[2]
    lk = layer[:, None, None]
    base = xfer[location[:, None, None], cand] + load[cand] + comp[cand, lk, topk[:, :, None]]  # [R, K, J]
    base = np.where(ok, base, np.inf)
    if N <= STEER_ALL_NODES:  # every node it may use (location first)
        meet = np.concatenate([location[:, None], np.broadcast_to(np.arange(N), (R, N))], 1)
        meet = np.where(np.take_along_axis(usable, meet, 1), meet, location[:, None])
    else:
        meet = np.concatenate([location[:, None], cand.reshape(R, K * J)], axis=1)  # [R, G]
    G = meet.shape[1]
    sub_first = np.where(is_sub, ready_sub[:, None, :], -np.inf).max(axis=2)  # [R, M]
    # each exact slot on the candidate whose output reaches g first: [R, K, G]
    exact_arr = (base[..., None] + xfer.reshape(-1).take(cand[..., None] * N + meet[:, None, None, :])).min(axis=2)
    # the layer ends when the last kept output reaches g: max over exact slots, and over substitutes, whose
    # arrival is (load + compute at the token's node) + xfer[c, g]: the max of the first term plus the second
    # (rounding is monotone, so this is the max of the sums)
    lat = max_over_kept(exact_arr, mask, order)  # [R, M, G]
    np.maximum(lat, sub_first[:, :, None] + xfer[location[:, None], meet][:, None, :], out=lat)
    np.maximum(lat, 0.0, out=lat)
    last = layer == ctx.num_layers - 1
    if last.any():
        lat = lat + np.where(last[:, None], xfer[meet, home[:, None]], 0.0)[:, None, :]
    return Options(mask=mask, valid_m=valid, experts=experts, node_m=stand_node, zeroed=zeroed, quality_m=quality,
                   next_mg=np.broadcast_to(meet[:, None, :], (R, M, G)), latency_mg=lat, meet=meet, cand=cand,
                   cand_ready=base, xfer_s=xfer)


def unsteered_meeting(ctx: RuntimeContext, layer: np.ndarray, location: np.ndarray, home: np.ndarray, node_x: np.ndarray,
                      ready_x: np.ndarray, ready_sub: np.ndarray, mask: np.ndarray, is_sub: np.ndarray,
                      order: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """([R, M] next location, [R, M] layer seconds): `meeting_node`'s rule for every action at once.

    Slot k runs exactly on node_x [R, K] (ready at ready_x), or as a substitute at the token's node (ready_sub),
    or not at all (mask, is_sub [R, M, K]). Only the token's node and the exact slots' nodes are candidates: a
    substitute's node is the token's node, candidate 0, which wins that tie. Per candidate, the max over kept
    exact slots comes from `max_over_kept` on [R, K, K+1] and the max over substitutes is max(ready) + the
    one transfer (monotone rounding): the same sums and maxima as `meeting_node`, so the same bits."""
    xfer = ctx.xfer_s
    N = ctx.num_nodes
    sub_ready = np.where(is_sub, ready_sub[:, None, :], -np.inf).max(axis=2)  # [R, M]
    if ctx.mode == "home" or node_x.shape[1] == 0:
        back = max_over_kept((ready_x + xfer[node_x, location[:, None]])[:, :, None], mask, order)[:, :, 0]
        lat = np.maximum(np.maximum(back, sub_ready + 0.0), 0.0)
        return np.broadcast_to(location[:, None], lat.shape).copy(), lat
    cand = np.concatenate([location[:, None], node_x], axis=1)  # [R, K+1]
    to = xfer.reshape(-1).take(node_x[:, :, None] * N + cand[:, None, :])  # [R, K, K+1]
    done = max_over_kept(ready_x[:, :, None] + to, mask, order)  # [R, M, K+1]
    np.maximum(done, sub_ready[:, :, None] + xfer[location[:, None], cand][:, None, :], out=done)
    np.maximum(done, 0.0, out=done)
    last = layer == ctx.num_layers - 1
    if last.any():
        done = done + np.where(last[:, None], xfer[cand, home[:, None]], 0.0)[:, None, :]
    else:
        done = done + 0.0  # (as meeting_node adds the zero trip home)
    done[:, :, 1:][mask] = np.inf  # a slot not run exactly is no candidate (a substitute's node is candidate 0)
    pick = done.argmin(axis=2)  # [R, M]
    return np.take_along_axis(cand, pick, 1), np.take_along_axis(done, pick[:, :, None], 2)[:, :, 0]


class BudgetGrid:
    """m levels 0, d, 2d, ... of remaining budget; a remaining budget maps to the level at or below it."""

    def __init__(self, max_budget: float, levels: int):
        self.levels = int(levels) if max_budget > 0 else 1
        self.step = max_budget / (self.levels - 1) if self.levels > 1 else 1.0
        self.values = np.arange(self.levels) * self.step  # [m]

    def index(self, remaining: np.ndarray) -> np.ndarray:
        return np.clip(np.floor(np.asarray(remaining) / self.step + 1e-9), 0, self.levels - 1).astype(np.int64)


# A Top-K set seen this often at a layer in calibration conditions the look-ahead on its own (0: top-1 only,
# the default: on the default model's held-out routing the sets did not help, docs/runtime.md)
MIN_SET_COUNT = 0


class RoutingKeys:
    """The look-ahead's context of a token after layer l: its whole Top-K set (sorted) when calibration saw
    that set at layer l at least `min_count` times, else its top-1 expert. Keys 0..E-1 are top-1 experts;
    E + i is the i-th frequent set of that layer. `size` = E + the most frequent sets any layer has."""

    def __init__(self, topk: np.ndarray, gates: np.ndarray, num_experts: int, min_count: int = MIN_SET_COUNT):
        T, L, K = topk.shape
        self.E, self.K, self.L = num_experts, K, L
        self.enabled = K > 1 and float(num_experts) ** K * L < 2.0 ** 62 and min_count > 0
        codes, ids = [], []
        for layer in range(L if self.enabled else 0):
            u, c = np.unique(self._code(np.full(T, layer), topk[:, layer]), return_counts=True)
            codes.append(u[c >= min_count])
            ids.append(num_experts + np.arange(int((c >= min_count).sum())))
        self.codes = np.concatenate(codes) if codes else np.zeros(0, np.int64)  # sorted: layer is the top digit
        self.ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        self.size = num_experts + max((len(i) for i in ids), default=0)

    def _code(self, layer: np.ndarray, topk: np.ndarray) -> np.ndarray:
        srt = np.sort(topk, axis=1).astype(np.int64)
        return layer.astype(np.int64) * self.E ** self.K + (srt * self.E ** np.arange(self.K, dtype=np.int64)).sum(1)

    def keys(self, layer, topk: np.ndarray, gates: np.ndarray) -> np.ndarray:
        """[R] key of rows whose routing at `layer` (int or [R]) is topk, gates [R, K]."""
        key = top1(topk, gates)
        if not self.enabled or not len(self.codes) or not len(key):
            return key
        code = self._code(np.broadcast_to(np.asarray(layer), key.shape), topk)
        pos = np.minimum(np.searchsorted(self.codes, code), len(self.codes) - 1)
        return np.where(self.codes[pos] == code, self.ids[pos], key)


@dataclass(frozen=True)
class SetStats:
    """Representative Top-K sets of one layer given the previous layer's routing key (calibration trace)."""

    experts: np.ndarray  # [M, K] sorted expert ids of each distinct set kept
    gates: np.ndarray  # [M, K] mean gates aligned with `experts`
    prob: np.ndarray  # [C, M] P(set | previous key), rows sum to 1


def set_stats(topk: np.ndarray, gates: np.ndarray, layer: int, num_experts: int, per_prev: int,
              keys: RoutingKeys | None = None) -> SetStats:
    """The `per_prev` most frequent Top-K sets at `layer` after each routing key at layer-1 (topk, gates
    [T, L, K]; keys: `RoutingKeys`, default top-1 only). A top-1 row counts every token with that top-1; a
    set row the tokens with that set. Keys never seen fall back to the layer's overall set frequencies."""
    E = num_experts
    order = np.argsort(topk[:, layer], axis=1)
    sets = np.take_along_axis(topk[:, layer], order, 1)
    set_gates = np.take_along_axis(gates[:, layer], order, 1)
    prev = top1(topk[:, layer - 1], gates[:, layer - 1])
    C = E if keys is None else keys.size
    prev_key = prev if keys is None else keys.keys(layer - 1, topk[:, layer - 1], gates[:, layer - 1])
    uniq, inverse = np.unique(sets, axis=0, return_inverse=True)
    inverse = inverse.ravel()
    counts = np.zeros((C, len(uniq)))
    np.add.at(counts, (prev, inverse), 1.0)
    is_set = prev_key >= E
    np.add.at(counts, (prev_key[is_set], inverse[is_set]), 1.0)
    overall = np.bincount(inverse, minlength=len(uniq)).astype(float)
    counts[counts.sum(axis=1) == 0] = overall
    keep_rank = np.argsort(-counts, axis=1, kind="stable")[:, :per_prev]  # [C, S]
    kept_cols = np.unique(keep_rank)
    trimmed = np.zeros_like(counts)
    np.put_along_axis(trimmed, keep_rank, np.take_along_axis(counts, keep_rank, 1), 1)
    trimmed = trimmed[:, kept_cols]
    prob = trimmed / trimmed.sum(axis=1, keepdims=True)
    mean_gates = np.zeros((len(uniq), sets.shape[1]))
    np.add.at(mean_gates, inverse, set_gates)
    mean_gates /= np.maximum(np.bincount(inverse, minlength=len(uniq)), 1)[:, None]
    return SetStats(experts=uniq[kept_cols], gates=mean_gates[kept_cols], prob=prob)


def _check_numbers(**values) -> None:
    """Raise EdgeMoEError unless every value (name=(value, low, high)) is a real number in [low, high] and
    finite (`OrderMoEPolicy`'s numeric parameters: a NaN or an infinite gain reaches every decision)."""
    for name, (value, low, high) in values.items():
        ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
        if not (ok and np.isfinite(value) and low <= value <= high):
            bound = f">= {low:g}" if high == np.inf else f"in [{low:g}, {high:g}]"
            raise EdgeMoEError(f"ordermoe: {name} must be a finite number {bound}, got {value!r}")


def _feedback(U: int, users, latency_s, estimate_s, spent, granted) -> tuple:
    """`OrderMoEPolicy.observe`'s arguments as arrays, checked (see there); EdgeMoEError names the first bad one."""
    try:
        users = np.asarray(users)
        arrays = {name: None if a is None else np.asarray(a, dtype=float) for name, a in
                  (("latency_s", latency_s), ("estimate_s", estimate_s), ("spent", spent), ("granted", granted))}
    except (TypeError, ValueError) as exc:
        raise EdgeMoEError(f"observe: the feedback must be arrays of numbers ({exc})") from None
    n = users.shape[0] if users.ndim == 1 else -1
    if users.ndim != 1 or (users.size and users.dtype.kind not in "iu"):
        raise EdgeMoEError(f"observe: users must be a [n] array of user indices, got {users.dtype} {users.shape}")
    users = users.astype(np.int64)
    require_in_range(users, 0, U, "observe: users must be")
    for name, a in arrays.items():
        if a is None:
            continue
        if a.shape != (n,):
            raise EdgeMoEError(f"observe: {name} must be [n={n}], one per user given, got shape {a.shape}")
        if n and not (a.min() >= 0 and (name == "estimate_s" or a.max() < np.inf)):  # (a NaN fails the first)
            raise EdgeMoEError(f"observe: {name} must hold {'' if name == 'estimate_s' else 'finite '}numbers >= 0, "
                               f"got values in [{a.min()}, {a.max()}]")
    return (users, *arrays.values())


class LookAhead:
    """Cost-to-go tables phi[l] [N, C, m]: expected seconds of layers l .. l+H-1 for a token at node c whose
    previous-layer routing has key k (`RoutingKeys`: its Top-K set if frequent, else its top-1 expert), with
    remaining budget level b, when those layers act optimally.

    Built once per (context, budget grid, H) by the truncated recursion of ALGORITHMS.md §3.4.4 with static
    costs (no queues); `phi(l)` is zero for l >= L and for H = 0.

    home_trip: also build home[l] [Nh, N, C, m], the same cost-to-go for a token whose home is the h-th of the
    users' homes (`homes`, sorted): a window that reaches the last layer then charges the trip from the last
    meeting node to the token's real home, as the decision at the last layer does. Without it the tables take
    the token's home to be its node at the last layer, so ending that window away from home looks free. Only
    the tables of windows that reach the last layer depend on the home (the last min(H, L - 1) layers), and only
    those are kept per home: `home` [D, Nh, N, C, m], slot `home_slot[l]` (-1: layer l's table is the home-free
    `stacked[l]`). Keeping every layer per home took (L+1)/D times the memory (906 MB at 256 servers, L = 8,
    H = 2, against 201 MB; 14.5 GB at 1024) for copies of the home-free tables. `flat` holds `stacked` and then
    `home` in one array, which both decision paths index (`flat_index`); tables above `TABLE_MAX_BYTES` are
    refused before they are allocated.

    backlog: also build exposure[l] [Hx, N, C, N], the expected number of layers l .. l+H-1 whose slowest output
    (the one that sets the layer's time) is computed on node n, for the same token, along the actions the
    tables choose at budget level `backlog_level` (one level for every row: a per-level exposure would be m
    times larger); Hx = Nh with `home_trip` (the actions of a window that reaches the last layer depend on the
    home, as its seconds do), else 1. It is the first-order sensitivity of phi to a queue wait at each node (`backlog`): a wait
    w_n at n delays every such layer by w_n until another action becomes cheaper, so phi + exposure . w is an
    upper bound on the cost-to-go under those waits that is exact for small ones (docs/runtime.md).

    quality_price: seconds per unit of quality cost that the future layers' actions pay in the tables besides
    their seconds (`OrderMoEPolicy` table_price); 0 (default): only the tie-break EPS_S_PER_Q.
    """

    def __init__(self, ctx: RuntimeContext, grid: BudgetGrid, horizon: int, sets_per_prev: int = 4,
                 max_enum_k: int = MAX_ENUM_K, kinds: tuple[str, ...] = KINDS, steer: bool = False,
                 steer_replicas: int = STEER_REPLICAS, power: float = QUALITY_POWER, min_set_count: int = MIN_SET_COUNT,
                 subs_fn=None, calib: KindCalibration | None = None, backlog: bool = False,
                 backlog_level: int = 0, home_trip: bool = False, quality_price: float = 0.0):
        self.ctx, self.grid, self.horizon = ctx, grid, int(horizon)
        self.quality_price = float(quality_price)  # seconds per unit of quality the future layers pay
        self.backlog = bool(backlog) and self.horizon > 0
        self.home_trip = bool(home_trip) and self.horizon > 0
        self.backlog_level = int(np.clip(backlog_level, 0, grid.levels - 1))
        self.subs_fn = subs_fn  # (layer [R], location [R], topk [R, K]) -> per-token substitutes; None: the groups
        self.calib = calib  # measured nats per kind and layer (`KindCalibration`), None: predicted errors alone
        self.kinds, self.steer, self.steer_replicas, self.power = kinds, steer, steer_replicas, power
        N, L, E = ctx.num_nodes, ctx.num_layers, ctx.num_experts
        self.keys = RoutingKeys(ctx.profile_topk, ctx.profile_gates, E, min_set_count if horizon > 0 else 0)
        C = self.keys.size
        self.tables: dict[int, np.ndarray] = {}
        self.homes = np.unique(ctx.user_home) if self.home_trip else np.zeros(0, np.int64)
        # depth L - 1 is a fixed point: from it on every layer's window reaches the last layer, so a deeper
        # recursion recomputes the same tables (and a horizon of millions would run for hours)
        depth = min(self.horizon, L - 1) if L >= 2 else 0
        # home_trip: the tables of layers L - depth .. L - 1 (their windows reach the last layer) per home
        self.home_slot = np.full(L + 1, -1, np.int64)
        if self.home_trip and depth > 0:
            self.home_slot[L - depth:L] = np.arange(depth)
        per_home = len(self.homes) * N * C * grid.levels  # cells of one layer's per-home table
        cells = (L + 1) * N * C * grid.levels + (depth * per_home if self.home_trip else 0)
        if cells * 8 > TABLE_MAX_BYTES:
            raise EdgeMoEError(
                f"ordermoe: the look-ahead tables would take {cells * 8 / 2**30:.2f} GiB (L+1={L + 1} layers of N={N} "
                f"nodes x keys={C} x levels={grid.levels}" + (f", and {depth} of them per home for {len(self.homes)} "
                f"homes (home_trip)" if self.home_trip else "") + f"), above {TABLE_MAX_BYTES / 2**30:g} GiB: use "
                "fewer budget levels" + (", home_trip=False" if self.home_trip else "") + " or horizon=0")
        # [L+1, N, C, m] phi(l) for every l (home-free, or the first home's), then [D, Nh, N, C, m] the per-home
        # layers (`home_index` maps a node to its home row), in one flat array
        self.flat = np.zeros(cells)
        self.stacked = self.flat[:(L + 1) * N * C * grid.levels].reshape(L + 1, N, C, grid.levels)
        self.home = self.flat[self.stacked.size:].reshape(depth if self.home_trip else 0, len(self.homes), N, C,
                                                          grid.levels)
        self.zero = self.stacked[L]  # phi(L): zeros (a view of `flat` that nothing writes)
        # exposure(l) for every l in compressed rows, per home where the tables are (`backlog`; None without it)
        self.expo = Exposure({}, L, N, C) if self.backlog else None
        self.home_index = np.full(N, -1, np.int64)
        self.home_index[self.homes] = np.arange(len(self.homes))
        if depth <= 0:
            return
        stats = {layer: set_stats(ctx.profile_topk, ctx.profile_gates, layer, E, sets_per_prev, self.keys)
                 for layer in range(1, L)}
        # values[l] for each depth: one layer's expected optimal cost over its sets, recursively.
        prev_depth: dict[int, np.ndarray] = {}
        prev_expo: dict[int, ExposureLayer] = {}
        zero_expo = ExposureLayer.empty(N, C)
        for _depth in range(1, depth + 1):
            cur, cur_expo = {}, {}
            for layer in range(1, L):
                nxt = prev_depth.get(layer + 1, self.zero)
                cur[layer], cur_expo[layer] = self._layer_table(layer, stats[layer], nxt, max_enum_k,
                                                                prev_expo.get(layer + 1, zero_expo))
            prev_depth, prev_expo = cur, cur_expo
        for layer, table in prev_depth.items():
            if table.ndim == 4:  # per home (home_trip): into its slot, `stacked` holding the first home's
                self.home[self.home_slot[layer]] = table
                table = self.home[self.home_slot[layer]]
                self.stacked[layer] = table[0]
            else:
                self.stacked[layer] = table
                table = self.stacked[layer]
            self.tables[layer] = table  # (a view of `flat`: no second copy)
        if self.backlog:
            self.expo = Exposure(prev_expo, L, N, C)
            if self.expo.nbytes > EXPOSURE_MAX_BYTES:
                raise EdgeMoEError(
                    f"ordermoe: the queue term's exposure rows take {self.expo.nbytes / 2**30:.2f} GiB "
                    f"({len(self.expo.val)} entries over {len(self.expo.span)} rows: L+1={L + 1}, homes up to "
                    f"{int(self.expo.homes.max())}, N={N}, keys={C}), above {EXPOSURE_MAX_BYTES / 2**30:g} GiB: use "
                    "backlog='off'" + (", or home_trip=False (one exposure for every home)" if self.home_trip else ""))

    def phi(self, layer: int) -> np.ndarray:
        """[N, C, m] table for decisions that start at `layer` (zeros past the end or with H = 0); with
        `home_trip`, [Nh, N, C, m] where the window reaches the last layer (`home`; `stacked` then holds the
        first home's)."""
        return self.tables.get(layer, self.zero)

    def home_table(self, layer: int) -> np.ndarray:
        """[Nh, N, C, m] the cost-to-go of `layer` for each home (home_trip): its per-home table, or the
        home-free one broadcast (a read-only view)."""
        slot = self.home_slot[layer]
        if slot >= 0:
            return self.home[slot]
        return np.broadcast_to(self.stacked[layer], (len(self.homes), *self.stacked.shape[1:]))

    def flat_index(self, layer: np.ndarray, home: np.ndarray, key: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(table, base [T], node stride): the flat table a decision at `layer` [T] reads (`flat`) and each row's
        index in it for the tables of layer + 1, its home [T] (home_trip) and key [T], less the next node x
        stride and the budget level, which the caller adds."""
        _, N, C, m = self.stacked.shape
        base = (layer + 1) * (N * C * m) + key * m
        if self.home_trip:
            slot = self.home_slot[layer + 1]
            per = slot >= 0  # layer + 1's table depends on the home: its slot's row of that home
            at = self.stacked.size + (slot * len(self.homes) + self.home_index[home]) * (N * C * m) + key * m
            base = np.where(per, at, base)
        return self.flat, base, C * m

    def _actions(self, ctx: RuntimeContext) -> int:
        """Actions per row (an upper bound): subsets x meeting choices."""
        K = ctx.top_k
        subsets = 2 ** K if K <= MAX_ENUM_K else K + 1
        if not self.steer:
            return subsets
        return subsets * (1 + (ctx.num_nodes if ctx.num_nodes <= STEER_ALL_NODES else K * (self.steer_replicas + 1)))

    @property
    def exposure(self) -> np.ndarray:
        """[L+1, Hx, N, C, N] the exposure rows made dense (Hx: the homes where some layer's rows are per home,
        else 1; a [1, 1, 1, 1, 1] zero without `backlog`); for tests and inspection, N times the compressed rows'
        memory (`exposure.Exposure`)."""
        return np.zeros((1, 1, 1, 1, 1)) if self.expo is None else self.expo.dense()

    def backlog_s(self, layer: np.ndarray, home: np.ndarray, key: np.ndarray, nodes: np.ndarray,
                  load: np.ndarray) -> np.ndarray:
        """[T, G] expected queue wait over the next H layers of rows that decide at `layer` [T], whose home is
        `home` [T], with look-ahead key `key` [T] and continue from `nodes` [T, G], under the current waits
        `load` [N]: exposure[l + 1, home's row] (g, key) . load, summed in node order (as the compiled loop sums
        it, so both give the same bits)."""
        hx = self.home_index[home] if self.home_trip else np.zeros(layer.shape, np.int64)
        return self.expo.wait(layer + 1, hx, nodes, key, load)

    def _layer_table(self, layer: int, stats: SetStats, phi_next: np.ndarray, max_enum_k: int,
                     expo_next: ExposureLayer) -> tuple[np.ndarray, ExposureLayer | None]:
        """(phi[layer] [N, C, m], or [Nh, N, C, m] per home when it depends on the home (`home_trip`: phi_next
        does, or `layer` is the last); exposure[layer] (one home row, or Nh where phi[layer] is per home), or
        None without `backlog`). expo_next: layer + 1's."""
        ctx, grid = self.ctx, self.grid
        N, M = ctx.num_nodes, stats.experts.shape[0]
        last = layer == ctx.num_layers - 1
        per_home = self.home_trip and (last or phi_next.ndim == 4)
        H = len(self.homes) if per_home else 1
        loc = np.repeat(np.arange(N), M)  # rows = (node, set)
        experts = np.tile(stats.experts, (N, 1))
        gates = np.tile(stats.gates, (N, 1))
        # A token at c may use every non-device node and c itself (other users' devices serve no one else).
        is_device = np.array([k == "device" for k in ctx.node_kind])
        usable = ~is_device[None, :] | (np.arange(N)[None, :] == loc[:, None])
        t1_all = self.keys.keys(layer, experts, gates)  # [R] context key for the next layer
        b = grid.values  # [m]
        best = np.empty((H, len(loc), grid.levels))
        # per home row and table row: the meeting node the exposed action continues from, and the node whose
        # output arrives last there (-1: none)
        nxt_at = np.zeros((H, len(loc)), np.int64) if self.backlog else None
        slow_at = np.full((H, len(loc)), -1, np.int64) if self.backlog else None
        per = max(1, TABLE_CHUNK_CELLS // (self._actions(ctx) * grid.levels))  # rows per block: bounded memory
        for lo in range(0, len(loc), per):
            r = slice(lo, lo + per)
            lr = np.full(len(loc[r]), layer)
            subs = None if self.subs_fn is None else self.subs_fn(lr, loc[r], experts[r])
            opt = None
            for h in range(H):
                # the last layer's seconds end at the token's home: its real one per home, else its node
                if opt is None or (per_home and last):
                    home = np.full(len(lr), self.homes[h]) if per_home else loc[r]
                    opt = layer_options(ctx, lr, loc[r], home, usable[r], experts[r], gates[r],
                                        np.zeros(N), max_enum_k, self.kinds, self.steer, self.steer_replicas,
                                        self.power, subs=subs, calib=self.calib)
                phi = phi_next[h] if phi_next.ndim == 4 else phi_next
                quality = opt.quality
                left = b[None, None, :] - quality[:, :, None]  # [R, A, m]
                feasible = opt.valid[:, :, None] & (left >= -1e-12)
                future = phi[opt.next_location[:, :, None], t1_all[r][:, None, None], grid.index(np.maximum(left, 0.0))]
                value = opt.latency_s[:, :, None] + (self.quality_price + EPS_S_PER_Q) * quality[:, :, None] + future
                value = np.where(feasible, value, np.inf)
                best[h, r] = value.min(axis=1)  # [R, m]
                if self.backlog:  # along this home's actions
                    nxt_at[h, r], slow_at[h, r] = self._exposed(opt, value[:, :, self.backlog_level].argmin(axis=1),
                                                                loc[r], lr)
        best = best.reshape(H, N, M, grid.levels)
        table = np.stack([np.einsum("cs,nsm->ncm", stats.prob, best[h]) for h in range(H)])
        table = table if per_home else table[0]
        if not self.backlog:
            return table, None
        return table, ExposureLayer.from_dense(
            (self._exposure_rows(nxt_at[h], slow_at[h], t1_all, expo_next.dense(h, N, self.keys.size), stats.prob, N, M)
             for h in range(H)), N, self.keys.size)

    @staticmethod
    def _exposure_rows(nxt: np.ndarray, slow: np.ndarray, key: np.ndarray, expo_next: np.ndarray, prob: np.ndarray,
                       n: int, m: int) -> np.ndarray:
        """[N, C, N] one home row's exposure: each table row's (node, set) the next layers' exposure from its
        meeting node nxt [R] with the set's key [R] (expo_next [N, C, N]) plus a one at its slowest node slow [R]
        (-1: none), averaged over the sets with prob [C, M]."""
        rows = np.arange(len(nxt))
        out = expo_next[nxt, key].copy()  # [R, N]
        hit = slow >= 0
        out[rows[hit], slow[hit]] += 1.0
        return np.einsum("cs,nsk->nck", prob, out.reshape(n, m, n))

    def _exposed(self, opt: Options, pick: np.ndarray, loc: np.ndarray, layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(meeting node [R], slowest node [R]) of rows (node loc [R], a set at `layer` [R]) that take action
        `pick` [R] of `opt`: where the token continues from, and the node computing the output that arrives last
        at the meeting node (queue-free times, as the tables price them; -1 when every slot is dropped or
        zeroed)."""
        ctx = self.ctx
        R = len(pick)
        rows = np.arange(R)
        m, g = np.divmod(pick, opt.G)
        nxt = opt.next_mg[rows, m, g]
        node = opt.node_m[rows, m]
        if opt.meet is not None:  # steered: each exact slot on the candidate that reaches the meeting node first
            node = np.where(opt.mask[rows, m], node, opt.exact_node(rows, g))
        expert = opt.experts[rows, m]  # [R, K]
        run = node >= 0
        n0, e0 = np.where(run, node, 0), np.where(expert >= 0, expert, 0)
        arrive = ctx.xfer_s[loc[:, None], n0] + ctx.compute_s[n0, layer[:, None], e0] + ctx.xfer_s[n0, nxt[:, None]]
        arrive = np.where(run, arrive, -np.inf)
        slow = arrive.argmax(axis=1)  # [R] first slowest slot
        return nxt, np.where(run[rows, slow], node[rows, slow], -1)


_LOOKAHEADS: dict[int, dict[tuple, LookAhead]] = {}  # id(ctx) -> the context's tables by their parameters


def lookahead_tables(ctx: RuntimeContext, grid: BudgetGrid, horizon: int, sets_per_prev: int, max_enum_k: int,
                     kinds: tuple[str, ...], steer: bool, steer_replicas: int, power: float, min_set_count: int,
                     subs_fn, calib: KindCalibration | None, backlog: bool, backlog_level: int,
                     home_trip: bool = False, quality_price: float = 0.0) -> LookAhead:
    """`LookAhead(...)` of these arguments, built once per context and kept while the context lives (a policy
    is made anew for every run; the tables depend only on the context and these numbers, and nothing writes
    them after they are built). Per-token substitutes (subs_fn) and calibrations are built every time."""
    args = (horizon, sets_per_prev, max_enum_k, kinds, steer, steer_replicas, power, min_set_count)
    if subs_fn is not None or calib is not None:
        return LookAhead(ctx, grid, *args, subs_fn, calib, backlog, backlog_level, home_trip, quality_price)
    key = (grid.levels, grid.step, *args, bool(backlog), int(backlog_level), bool(home_trip), float(quality_price))
    tables = _LOOKAHEADS.get(id(ctx))
    if tables is None:
        tables = _LOOKAHEADS[id(ctx)] = {}
        weakref.finalize(ctx, _LOOKAHEADS.pop, id(ctx), None)
    if key not in tables:
        tables[key] = LookAhead(ctx, grid, *args, None, None, backlog, backlog_level, home_trip, quality_price)
    return tables[key]


def compiled_loop_supported(policy) -> bool:
    """Whether the simulator's compiled loop (`edgemoe.runtime.sim.ordermoe_loop`) decides exactly as `policy`
    (an OrderMoEPolicy): all 2^K subsets enumerated (K <= max_enum_k, up to K = 8: 256 subsets) or the K + 1
    prefixes (K > max_enum_k, up to K = 16), top-1 look-ahead keys (no frequent-set keys), quality power 1 or 2
    (numpy's power for other exponents may round otherwise); tables with or without a home axis (`home_trip`:
    the loop reads the row's home's table). Kept here, not in the loop's module, so that the policy's
    `compiled_rule` needs nothing from the simulator (no import circle)."""
    K = policy.ctx.top_k
    actions_ok = K <= 8 if K <= policy.max_enum_k else K <= 16
    return (actions_ok and not policy.lookahead.keys.enabled
            and policy.power in (1.0, 2.0) and getattr(policy, "calib", None) is None and not getattr(policy, "accrue", False))


class OrderMoEPolicy(Policy):
    """OrderMoE runtime policy. Parameters (defaults and units in docs/runtime.md):

    budget: quality allowance per token-layer (gate-weighted relative output error), scalar or [U];
    horizon: look-ahead depth H; steer: choose the meeting node and replicas with the look-ahead (default:
    H >= 1 in migrate mode; H = 0 keeps the myopic earliest-finish rule); substitutes: the stand-in kinds
    allowed ("sub,drop,zero"); levels: budget grid size m; quality_price: beta_0 in seconds per unit of
    quality cost (None: half the median round trip per token-layer allowance); pressure_gain: kappa of the
    latency weight; sets_per_prev: Top-K sets kept per previous top-1 in the tables; max_enum_k;
    steer_replicas; ewma: the feedback's smoothing; adapt_gain: step of the per-user quality weight;
    spend_target: the share of its budget a user's passes should spend; pace: look the tables up at the
    next H layers' paced share of the remaining budget (`pace_share`) instead of all of it;
    stand_in_choice: "group" (default: the expert's best-ranked local group member) or "token" (per token, the
    local expert with the least predicted error, `token_substitutes`, scored with the token's real router
    logits where the backend passes them, else the calibration co-selection); router_weight: w of that score;
    calibration: None (default), or the measured extra nats of each stand-in kind per layer (a `KindCalibration`,
    its `to_dict` form, or the path of a JSON file holding that form at its top level or under "calibration";
    `bench.studies.calibration` writes one per model under models[i].calibration): predicted costs and the budget are then in nats per token-layer, the
    kinds are compared on what they were measured to cost, quality_power is the calibration's, and a layer
    left with no expert output is allowed at its measured cost where the calibration has one; accrue: a row
    may spend by layer l at most its allowance x (l + 1) (default False: all it has left, at any layer);
    home_trip: the look-ahead charges the trip to the token's real home in the window that reaches the last layer
    (`LookAhead`, home_trip; None, the default: on in migrate mode, where a token may end a pass away from
    home, and with stand_in_choice "token"); table_price: the tables' future layers pay the policy's quality price
    (`quality_price` seconds per unit of quality) besides their seconds, as the decision pays it now (default
    False: they pay only the tie-break epsilon, so budget kept looks worth every second it could buy).
    """

    name = "ordermoe"
    wants_feedback = True

    def __init__(self, ctx: RuntimeContext, budget=0.05, horizon: int = 2, backlog: str = BACKLOG,
                 steer: bool | None = None,
                 substitutes="sub,drop,zero", levels: int = 24, quality_price: float | None = None,
                 pressure_gain: float = 1.0, sets_per_prev: int = 16, max_enum_k: int = MAX_ENUM_K,
                 steer_replicas: int = STEER_REPLICAS, ewma: float = 0.1, adapt_gain: float = 0.5,
                 spend_target: float = 0.5, quality_power: float = QUALITY_POWER, min_set_count: int = MIN_SET_COUNT,
                 pace: bool = True, stand_in_choice: str = "group", router_weight: float = ROUTER_WEIGHT,
                 calibration: str | dict | None = None, accrue: bool = False, home_trip: bool | None = None,
                 table_price: bool = False):
        kinds = check_kinds(substitutes)
        calib = load_calibration(calibration, ctx.num_layers)
        if calib is not None:
            quality_power = calib.power
        if stand_in_choice not in STAND_IN_CHOICES:
            raise EdgeMoEError(f"ordermoe: stand_in_choice must be one of {list(STAND_IN_CHOICES)}, got {stand_in_choice!r}")
        if not 0.0 <= router_weight <= 1.0:
            raise EdgeMoEError(f"ordermoe: router_weight must be in [0, 1], got {router_weight}")
        if backlog not in BACKLOGS:
            raise EdgeMoEError(f"ordermoe: backlog must be one of {list(BACKLOGS)}, got {backlog!r}")
        _check_numbers(ewma=(ewma, 0.0, 1.0), pressure_gain=(pressure_gain, 0.0, np.inf),
                       adapt_gain=(adapt_gain, 0.0, np.inf), quality_power=(quality_power, 0.0, np.inf),
                       **({} if quality_price is None else {"quality_price": (quality_price, 0.0, np.inf)}))
        for name, value, low in (("steer_replicas", steer_replicas, 0), ("max_enum_k", max_enum_k, 0),
                                 ("sets_per_prev", sets_per_prev, 1), ("min_set_count", min_set_count, 0)):
            if not (isinstance(value, int | np.integer) and value >= low):
                raise EdgeMoEError(f"ordermoe: {name} must be a whole number >= {low}, got {value!r}")
        super().__init__(ctx, budget=budget, horizon=horizon, **({"backlog": backlog} if backlog != BACKLOG else {}),
                         steer=steer, substitutes=",".join(kinds), levels=levels,
                         quality_price=quality_price, pressure_gain=pressure_gain, sets_per_prev=sets_per_prev,
                         max_enum_k=max_enum_k, steer_replicas=steer_replicas, ewma=ewma, adapt_gain=adapt_gain,
                         spend_target=spend_target, quality_power=quality_power, min_set_count=min_set_count,
                         pace=bool(pace), **({} if stand_in_choice == "group" else
                                             {"stand_in_choice": stand_in_choice, "router_weight": float(router_weight)}),
                         **({} if calib is None else {"calibration": calib.to_dict()}),
                         **({"accrue": True} if accrue else {}),
                         **({} if home_trip is None else {"home_trip": bool(home_trip)}),
                         **({"table_price": True} if table_price else {}))
        self.calib = calib
        self.accrue = bool(accrue)
        self.stand_in_choice, self.router_weight = stand_in_choice, float(router_weight)
        self.per_token = stand_in_choice == "token"
        if self.per_token:
            self.wants_router_logits = True  # the local backend passes the real logits to `decide`
            self.coselect = coselection_counts(ctx.profile_topk, ctx.num_experts)  # [L, E, E] the fallback's affinity
            self.logit_layers = 0  # decide calls handed real router logits (the rest score with the co-selection)
        self.trace_logits: np.ndarray | None = None  # [T', L, E] `replay_logits`: the replayed tokens' router logits
        self.row_tokens: np.ndarray | None = None  # [T] each started row's token in them (`start`)
        if not (isinstance(horizon, int | float | np.integer | np.floating) and horizon >= 0
                and float(horizon).is_integer()) or levels < 2:
            raise EdgeMoEError(f"ordermoe: horizon must be a whole number >= 0 and levels >= 2, got {horizon!r}, "
                               f"{levels}")
        if not 0 < spend_target <= 1 or adapt_gain < 0:
            raise EdgeMoEError(f"ordermoe: spend_target must be in (0, 1] and adapt_gain >= 0, got {spend_target}, "
                               f"{adapt_gain}")
        self.horizon, self.max_enum_k, self.ewma = int(horizon), int(max_enum_k), float(ewma)
        self.pace = bool(pace)
        self.kinds, self.steer_replicas, self.power = kinds, int(steer_replicas), float(quality_power)
        self.steer = (self.horizon >= 1 if steer is None else bool(steer)) and ctx.mode == "migrate"
        self.rt_med = max(ctx.median_round_trip_s(), 1e-6)
        mean_allowance = float(self.allowance.mean())
        self.quality_price = (0.5 * self.rt_med / mean_allowance if mean_allowance > 0 else 0.0) \
            if quality_price is None else float(quality_price)
        self.pressure_gain, self.adapt_gain, self.spend_target = float(pressure_gain), float(adapt_gain), float(spend_target)
        self.grid = BudgetGrid(float(self.allowance.max()) * ctx.num_layers, levels)
        # Steered tables cost N x G times the unsteered ones; beyond STEER_ALL_NODES nodes the tables price the
        # future with the myopic rule (64 servers, L=16, E=32, K=4: 57 s steered vs ~1 s), the decision stays steered.
        self.lookahead = lookahead_tables(ctx, self.grid, self.horizon, sets_per_prev, max_enum_k, kinds,
                                          self.steer and ctx.num_nodes <= STEER_ALL_NODES, self.steer_replicas,
                                          self.power, min_set_count, self.token_subs if self.per_token else None,
                                          calib, backlog != "off", int(self.grid.index(self.horizon * mean_allowance)),
                                          self._home_trip(home_trip),
                                          self.quality_price if table_price else 0.0)
        # the cost-to-go adds the queue waits the tables are exposed to: "now" the current ones, "mean" node_wait
        self.backlog = backlog if self.lookahead.backlog else "off"
        self.node_wait = np.zeros(ctx.num_nodes)  # [N] EWMA (weight ewma per decided row) of each node's queue wait
        U = ctx.num_users
        self.queue_pressure = 0.0  # EWMA of mean queueing delay / (it + median round trip)
        self.latency_excess = np.zeros(U)  # [U] EWMA of max(observed / estimated latency - 1, 0)
        self.spend_rate = np.zeros(U)  # [U] EWMA of spent / granted budget of the user's finished passes
        self.quality_weight = np.ones(U)  # [U] multiplier of the quality price, adapted per user

    def _home_trip(self, home_trip: bool | None) -> bool:
        """Whether the tables charge the trip home (the `home_trip` parameter; None: the default, class docstring).
        In home mode the token never leaves home, so the trip is zero and a home axis would only copy the tables."""
        if home_trip is not None:
            return bool(home_trip)
        return self.per_token or self.ctx.mode == "migrate"

    def replay_logits(self, logits: np.ndarray) -> None:
        """Give a per-token policy the router logits [T', L, E] of the routing its caller replays (the
        simulator's trace), read at the rows whose backend passes none: a simulated run then prices each
        substitute with the token's own router agreement, as the `local` backend does with the real logits,
        instead of the co-selection fallback. Without them the two backends price substitutes differently and a
        run's latency (simulator) and perplexity (local backend) come from different decisions. A serving
        system has these logits at the token's home before it dispatches (they are what picks the routed experts).
        `start(users, tokens)` must then name each row's token in them."""
        if not self.per_token:
            raise EdgeMoEError("ordermoe: replay_logits needs stand_in_choice='token' (only per-token stand-ins read logits)")
        logits = np.asarray(logits, dtype=float)
        if logits.ndim != 3 or logits.shape[1:] != (self.ctx.num_layers, self.ctx.num_experts):
            raise EdgeMoEError(f"ordermoe: replay_logits must be [T, L={self.ctx.num_layers}, E={self.ctx.num_experts}], "
                               f"got {logits.shape}")
        self.trace_logits = logits

    def start(self, users, tokens=None) -> TokenState:
        state = super().start(users, tokens)
        if self.trace_logits is not None:
            if tokens is None:
                raise EdgeMoEError("ordermoe: with replay_logits, start(users, tokens) must name each row's token")
            tokens = np.asarray(tokens, np.int64)
            if tokens.shape != state.user.shape or ((tokens < 0) | (tokens >= len(self.trace_logits))).any():
                raise EdgeMoEError(f"ordermoe: tokens must be [T={len(state)}] indices into the replayed logits' "
                                   f"{len(self.trace_logits)} tokens")
            self.row_tokens = tokens
        return state

    def row_logits(self, layer: np.ndarray, state: TokenState) -> np.ndarray | None:
        """[T, E] the rows' router logits at `layer` [T]: the backend's (`decide(router_logits=)`), else the
        replayed ones (`replay_logits`), else None (the co-selection fallback scores the substitutes)."""
        if self.router_logits is not None or self.trace_logits is None:
            return self.router_logits
        return self.trace_logits[self.row_tokens[state.row], layer]

    def token_subs(self, layer: np.ndarray, location: np.ndarray, topk: np.ndarray,
                   logits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per-token substitutes (`token_substitutes`) of rows at layer, location [R] routed to topk [R, K]:
        scored with their router logits [R, E] when given, else with the calibration co-selection."""
        aff = coselect_affinity(self.coselect, layer, topk) if logits is None else logit_affinity(topk, logits)
        return token_substitutes(self.ctx, layer, location, topk, aff, self.router_weight)

    def compiled_rule(self) -> str | None:
        """"ordermoe" when the simulator's compiled loop makes exactly this policy's decisions
        (`compiled_loop_supported`; its feedback is given there too); None with per-token
        stand-ins (decided in Python, with the token's logits where the backend has them)."""
        if self.per_token or not COMPILED_LOOP or type(self).observe is not OrderMoEPolicy.observe:
            return None
        return self._own_rule(OrderMoEPolicy, "ordermoe") if compiled_loop_supported(self) else None

    def decode_path(self):
        """`ordermoe_kernel.DecodePath` where it decides exactly as `choose` (the simulator loop's conditions,
        `compiled_rule`), else None."""
        if not COMPILED_DECODE or self.compiled_rule() != "ordermoe":
            return None
        return DecodePath(self, EPS_S_PER_Q, STEER_ALL_NODES)

    @property
    def alpha(self) -> np.ndarray:
        """[U] latency weight: 1 without pressure, up to 1 + 2 * pressure_gain under heavy queues / slow links."""
        return self.latency_weights(self.queue_pressure, slice(None))

    def latency_weights(self, pressure, users) -> np.ndarray:
        """alpha of the rows of `users` ([T] indices, or a slice) at queue pressure `pressure` (scalar, or [T]
        per row as `pressures` gives it)."""
        return 1.0 + self.pressure_gain * (pressure + np.minimum(self.latency_excess[users], 1.0))

    def beta(self, layer: np.ndarray, state: TokenState) -> np.ndarray:
        """[T] quality weight: quality_price x the user's adapted weight x (share of budget used) / (share of
        layers done). layer: [T]."""
        progress = (layer + 0.5) / self.ctx.num_layers
        used = np.divide(state.budget_used, state.budget_total, out=np.zeros(len(state)), where=state.budget_total > 0)
        return self.quality_price * self.quality_weight[state.user] * used / progress

    def pace_share(self, layer: np.ndarray) -> np.ndarray:
        """[T] share of a row's remaining budget that the look-ahead lets the next H layers spend: H over the
        layers still to come after `layer` [T] (at most 1), as if the rest of the pass spent it evenly. The
        tables price the future with no quality price, so handing them the whole remaining budget makes every
        future remote branch look substitutable and every meeting node look alike."""
        rest = np.maximum(self.ctx.num_layers - 1 - layer, 1)
        return np.minimum(1.0, self.horizon / rest)

    def weights(self) -> dict:
        """Per user: the latency weight alpha, the quality weight (multiplier of the quality price) and the
        smoothed spent share, as lists (for results files)."""
        return {"alpha": self.alpha.tolist(), "quality_weight": self.quality_weight.tolist(),
                "spend_rate": self.spend_rate.tolist()}

    def observe(self, users, latency_s, estimate_s=None, spent=None, granted=None) -> None:
        """Per-user adaptation from finished passes (docs/runtime.md, "Adaptive weights"):
        - latency: excess_u <- EWMA of max(observed / estimated - 1, 0) raises the user's latency weight;
        - budget: with r_u = spent / granted of the call's passes, the quality weight moves multiplicatively by
          exp(adapt_gain * a * (r_u - spend_target) / spend_target) (a: the EWMA weight of the passes seen;
          spend_rate keeps the EWMA of r_u for reports): a user who spends more of its budget
          than the target pays more for quality (saves it for where it buys most), one who spends less pays
          less (so it substitutes whenever that helps).

        Raises EdgeMoEError, with no weight changed, unless users [n] are in [0, U) and every array given is
        [n] of numbers >= 0, finite except estimate_s (an infinite estimate adds no excess): one NaN would
        stay in the user's weights for good."""
        users, latency_s, estimate_s, spent, granted = _feedback(self.ctx.num_users, users, latency_s, estimate_s,
                                                                 spent, granted)
        if users.size == 0:
            return
        U = self.ctx.num_users
        n = np.bincount(users, minlength=U).astype(float)
        seen = n > 0
        a = 1.0 - (1.0 - self.ewma) ** n[seen]  # n observations in one call: the EWMA weight of n steps
        if estimate_s is not None:
            ratio = np.asarray(latency_s, float) / np.maximum(np.asarray(estimate_s, float), 1e-12) - 1.0
            excess = np.bincount(users, np.maximum(ratio, 0.0), minlength=U)[seen] / n[seen]
            self.latency_excess[seen] += a * (excess - self.latency_excess[seen])
        if spent is not None and granted is not None:
            spent, granted = np.asarray(spent, float), np.asarray(granted, float)
            has = np.bincount(users, granted, minlength=U)
            rate = np.divide(np.bincount(users, spent, minlength=U), has, out=np.zeros(U), where=has > 0)
            upd = seen & (has > 0)
            a_u = 1.0 - (1.0 - self.ewma) ** n[upd]
            self.spend_rate[upd] += a_u * (rate[upd] - self.spend_rate[upd])
            step = self.adapt_gain * a_u * (rate[upd] - self.spend_target) / self.spend_target
            self.quality_weight[upd] = weight_steps(self.quality_weight[upd], step)  # (libm's exp: see there)

    def mean_waits(self, load: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The `mean` queue term's EWMA over one call of `rows` rows that all see the waits `load` [N]: each row
        is one observation, and row t prices the EWMA after its own step, node_wait + (1 - (1 - ewma)^(t+1)) x
        (load - node_wait) = load + keep[t] x dev. Returns (keep [rows], dev [N] = node_wait - load) and leaves
        node_wait after the last row; None when the term is not `mean` or there are no rows.

        One step per row, not per call, so that the waits do not depend on how decisions are grouped into calls
        (the reference engine decides one pass per call, the fast engine every pass of a wave, a server a batch):
        only the order of the rows counts. keep is a running product (as the compiled decision multiplies it)."""
        if self.backlog != "mean" or rows == 0:
            return None
        keep = np.multiply.accumulate(np.full(rows, 1.0 - self.ewma))
        dev = self.node_wait - load
        self.node_wait[:] = load + keep[-1] * dev  # in place: the compiled decision holds this array
        return keep, dev

    def pressures(self, load: np.ndarray, rows: int) -> np.ndarray:
        """[rows] the queue pressure each row of one call prices, all rows seeing the waits `load` [N]: one EWMA
        step per row toward x = mean wait / (mean wait + median round trip), row t after its own step,
        x + keep[t] x (queue_pressure - x) with keep[t] = (1 - ewma)^(t+1) a running product; leaves
        queue_pressure after the last row. Per row for the reason `mean_waits` is: the weights must not depend on
        how the backend groups decisions into calls."""
        keep = np.multiply.accumulate(np.full(rows, 1.0 - self.ewma))
        mean_load = float(load.mean()) if load.size else 0.0
        x = mean_load / (mean_load + self.rt_med)
        pressure = x + keep * (self.queue_pressure - x)
        if rows:
            self.queue_pressure = float(pressure[-1])
        return pressure

    def choose(self, layer, topk, gates, state, load):
        ctx = self.ctx
        mean = self.mean_waits(load, len(state))  # the rows' observations join the per-node EWMA before it is read
        pressure = self.pressures(load, len(state))  # likewise the queue pressure, one step per row
        logits = self.row_logits(np.broadcast_to(layer, state.user.shape), state) if self.per_token else None
        if self.per_token:
            self.logit_layers += logits is not None
        has_budget = state.budget_total > 0
        if len(state) == 0 or not (self.steer or has_budget.any()):
            return exact_decision(ctx, layer, topk, state, load)  # no budget and no steering: exactly `exact`
        loc = state.location
        subs = self.token_subs(layer, loc, topk, logits) if self.per_token else None
        opt = layer_options(ctx, layer, loc, state.home, ctx.usable[state.user], topk, gates, load, self.max_enum_k,
                            self.kinds, self.steer, self.steer_replicas, self.power, steered_latency=not COMPILED_STEER,
                            subs=subs, calib=self.calib)
        # per subset [T, M]: quality, what is left, feasibility, budget level; per action [T, M, G]: the rest
        quality = opt.quality_m
        left = state.budget_left[:, None] - quality  # [T, M]
        # accrue: what a row may spend by this layer is its allowance x (layer + 1), as the field's baselines
        # pace theirs, so that one dear layer (layer 0 costs the most nats on every shipped model) cannot take
        # the budget that cheaper later layers would buy more seconds with
        spendable = left if not self.accrue else (
            np.minimum(self.allowance[state.user] * (layer + 1), state.budget_total) - state.budget_used)[:, None] - quality
        feasible = opt.valid_m & (spendable >= -1e-12) & (~opt.mask.any(axis=2) | has_budget[:, None])
        _, N, C, m = self.lookahead.stacked.shape
        part = None
        table, stride = self.lookahead.stacked.reshape(-1), C * m  # the flat tables read and a next node's stride
        if self.horizon > 0:  # (with H = 0 the tables are zeros: adding them changes no bit)
            key = self.lookahead.keys.keys(layer, topk, gates)
            # flat index (((l + 1) N + next) C + key) m + level (with home_trip, (l + 1) Nh + home for l + 1),
            # split into its per-subset and per-node terms
            ahead = np.maximum(left, 0.0)
            if self.pace:  # the next H layers are priced with their paced share of what is left, not all of it
                ahead = ahead * self.pace_share(layer)[:, None]
            table, base, stride = self.lookahead.flat_index(np.broadcast_to(layer, key.shape), state.home, key)
            part = base[:, None] + self.grid.index(ahead)  # [T, M]
        beta = self.beta(layer, state)
        alpha = self.latency_weights(pressure, state.user)  # [T]
        qterm = (beta + EPS_S_PER_Q)[:, None] * quality  # [T, M]
        wait = None  # [T, G] steered / [T, M] unsteered: the next layers' expected queue wait (`backlog`)
        if part is not None and self.backlog != "off":
            meets = opt.meet if opt.meet is not None else opt.next_mg[:, :, 0]
            # with `mean`, row t reads its own EWMA, load + keep[t] x dev ([T, N]), as the compiled decision sums it
            seen = load if mean is None else load[None, :] + mean[0][:, None] * mean[1][None, :]
            wait = self.lookahead.backlog_s(np.broadcast_to(layer, key.shape), state.home, key, meets, seen)
        if opt.latency_mg is None:  # steered, compiled: the same sums and argmin, row by row
            pick, lat, node = steered_pick(opt, part, stride, table, loc, state.home,
                                           layer == ctx.num_layers - 1, feasible, qterm, alpha, wait)
            return pick_decision(opt, pick, loc, lat, node)
        T, M, G = opt.latency_mg.shape
        seconds = opt.latency_mg
        if part is not None:
            seconds = seconds + table.take(part[:, :, None] + opt.next_mg * stride)
            if wait is not None:
                seconds = seconds + (wait[:, None, :] if opt.meet is not None else wait[:, :, None])
        cost = alpha[:, None, None] * seconds + qterm[:, :, None]
        cost[~feasible] = np.inf
        pick = cost.reshape(T, M * G).argmin(axis=1)  # action 0 (no substitution) is always feasible
        return pick_decision(opt, pick, loc)


def load_calibration(calibration, num_layers: int) -> KindCalibration | None:
    """The `calibration` parameter of OrderMoEPolicy as a KindCalibration for num_layers layers (None: none):
    a KindCalibration, its `to_dict` form, or a JSON file path whose document holds that form (at the top
    level or under "calibration")."""
    if calibration is None or isinstance(calibration, KindCalibration):
        calib = calibration
    elif isinstance(calibration, dict):
        calib = KindCalibration.from_dict(calibration)
    elif isinstance(calibration, str):
        from edgemoe.io import read_json

        doc = read_json(calibration, what="calibration file")
        calib = KindCalibration.from_dict(doc.get("calibration", doc) if isinstance(doc, dict) else doc,
                                          f"calibration file {calibration}")
    else:
        raise EdgeMoEError(f"ordermoe: calibration must be a file path or an object, got {type(calibration).__name__}")
    if calib is not None and calib.num_layers != num_layers:
        raise EdgeMoEError(f"ordermoe: calibration has {calib.num_layers} layers, the model {num_layers}")
    return calib


def pick_decision(opt: Options, pick: np.ndarray, location: np.ndarray, latency_s: np.ndarray | None = None,
                  node: np.ndarray | None = None) -> Decision:
    """The Decision made of action `pick` [T] of each row of `opt` (latency_s [T], node [T, K]: the picked
    actions' seconds and nodes when the caller has them, as `ordermoe_kernel.steered_pick` does)."""
    rows = np.arange(len(pick))
    m, g = np.divmod(pick, opt.G)
    if node is None:
        mask = opt.mask[rows, m]
        node = opt.node_m[rows, m] if opt.meet is None else np.where(mask, opt.node_m[rows, m], opt.exact_node(rows, g))
    zeroed = opt.zeroed[rows, m]
    return Decision(experts=opt.experts[rows, m], node=node, location=location.copy(),
                    next_location=opt.next_mg[rows, m, g], quality_cost=opt.quality_m[rows, m],
                    latency_s=opt.latency_mg[rows, m, g] if latency_s is None else latency_s,
                    zeroed=zeroed if zeroed.any() else None)
