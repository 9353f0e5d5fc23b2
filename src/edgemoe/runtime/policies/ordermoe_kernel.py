"""OrderMoE's steered decision, compiled: the per-row search over (stand-in subset, meeting node) actions.

At 64 rows per call the numpy form of the steered decision spends its time on the [R, K, J, G] arrival times
and the [R, M, G] latency, look-ahead and cost arrays, a few dozen small array operations per call; this
kernel walks the same actions row by row without materialising them (ALGORITHMS.md §3.4.4),
and `steered_inputs` builds the candidates and meeting nodes it reads in one call instead of ~15.
It does the same floating-point operations in the same order as `layer_options` + `OrderMoEPolicy.choose`
(sums, exact maxima and minima, first index on ties), so it picks the same action and reports the same
bits; tests/runtime/policies/test_ordermoe_kernel.py checks that against the numpy path, which stays the reference
and the fallback without numba (`edgemoe.jit.HAVE_NUMBA`). One of four copies of the layer rule (the others:
`edgemoe.runtime.policy`, the reference; `runtime.sim.rules._decide_rows`; `plan.ordermoe.runtime_model.PathModel`).
"""

from __future__ import annotations

import numpy as np

from edgemoe.jit import njit


@njit(cache=True)
def _steered_inputs(layer, location, topk, node_x, short, real, usable, xfer, load, comp, is_sub, ready_sub,
                    all_nodes):  # pragma: no cover - compiled (the numpy twin is tested)
    """`layer_options`' steered candidates, their ready times and the meeting nodes, in one call (the same
    values: the same sums in the same order).

    layer, location: [R]; topk, node_x: [R, K]; short, real: [R, K, S] shortlisted replicas; usable: [R, N];
    xfer [N, N]; load [N]; comp [N, L, E]; is_sub [R, M, K]; ready_sub [R, K]; all_nodes: meet at any usable
    node (else at the token's node or a candidate). Returns (cand, base [R, K, 1 + S], meet [R, G], sub_first [R, M])."""
    R, K, S = short.shape
    J = S + 1
    N = xfer.shape[0]
    M = is_sub.shape[1]
    G = 1 + N if all_nodes else 1 + K * J
    cand = np.empty((R, K, J), np.int64)
    base = np.empty((R, K, J))
    meet = np.empty((R, G), np.int64)
    sub_first = np.empty((R, M))
    for r in range(R):
        c, lr = location[r], layer[r]
        for k in range(K):
            for j in range(J):
                n = node_x[r, k] if j == 0 else short[r, k, j - 1]
                ok = (j == 0 or real[r, k, j - 1]) and usable[r, n]  # exact's own choice first
                if not ok:
                    n = node_x[r, k]
                cand[r, k, j] = n
                base[r, k, j] = xfer[c, n] + load[n] + comp[n, lr, topk[r, k]] if ok else np.inf
        meet[r, 0] = c
        if all_nodes:
            for n in range(N):
                meet[r, 1 + n] = n if usable[r, n] else c
        else:
            for k in range(K):
                for j in range(J):
                    meet[r, 1 + k * J + j] = cand[r, k, j]
        for m in range(M):
            v = -np.inf
            for k in range(K):
                if is_sub[r, m, k] and ready_sub[r, k] > v:
                    v = ready_sub[r, k]
            sub_first[r, m] = v
    return cand, base, meet, sub_first


def steered_inputs(layer, location, topk, node_x, short, real, usable, xfer, load, comp, is_sub, ready_sub,
                   all_nodes: bool):
    """(cand [R, K, J], base [R, K, J], meet [R, G], sub_first [R, M]): see `_steered_inputs`."""
    c = np.ascontiguousarray
    return _steered_inputs(c(layer, np.int64), c(location, np.int64), c(topk, np.int64), c(node_x, np.int64),
                           c(short, np.int64), c(real), c(usable), c(xfer, float), c(load, float), c(comp, float),
                           c(is_sub), c(ready_sub, float), bool(all_nodes))


@njit(cache=True)
def _steered_pick(base, cand, meet, xfer, mask, stand_node, sub_ready, location, home, last, feasible, qterm, alpha,
                  part, stride, table, use_table):  # pragma: no cover - compiled (the numpy twin is tested)
    """Per row r: the action a = m * G + g of least cost, its layer seconds and the node of each slot.

    base, cand [R, K, J]: when each candidate replica's output exists, and the replica; meet [R, G]; xfer [N, N];
    mask [R, M, K] slot replaced; stand_node [R, M, K] where a replaced slot runs (-1: not run); sub_ready
    [R, M] latest substitute ready time (-inf: none); location, home [R]; last [R] bool: last layer (add the
    trip home); feasible [R, M]; qterm [R, M] (beta + eps) x quality; alpha [R]; part [R, M] and stride:
    look-ahead flat index part + meet * stride into table (use_table False: no look-ahead).
    Returns (pick [R], latency [R], node [R, K])."""
    R, K, J = base.shape
    M = mask.shape[1]
    G = meet.shape[1]
    pick = np.zeros(R, np.int64)
    lat_out = np.empty(R)
    node = np.empty((R, K), np.int64)
    arrive = np.empty((K, G))
    # all 2^K subsets (`subset_bits`; the only mask with 2^K actions, prefixes included when K <= 1): the max
    # over every kept set built one slot at a time, as `max_over_kept` does; action m keeps the complement of m
    enumerated = M == 1 << K
    kept_max = np.empty((M, G))
    to_meet = np.empty(G)  # xfer[c, g]: a substitute's output to the meeting node
    home_leg = np.zeros(G)  # the trip home after the last layer
    # a meeting node named twice (the token's node, exact's choice among the shortlisted replicas) gives
    # equal costs, so its later copy never wins the first-index argmin: it is skipped
    dup = np.zeros(G, np.bool_)
    seen = np.full(xfer.shape[0], -1, np.int64)  # row that last named each node
    for r in range(R):
        c = location[r]
        for g in range(G):
            dup[g] = seen[meet[r, g]] == r
            seen[meet[r, g]] = r
            to_meet[g] = xfer[c, meet[r, g]]
            if last[r]:
                home_leg[g] = xfer[meet[r, g], home[r]]
        # each exact slot on the candidate whose output reaches g first (numpy: min over J of the sums)
        for k in range(K):
            for g in range(G):
                if dup[g]:
                    continue
                best = np.inf
                for j in range(J):
                    v = base[r, k, j] + xfer[cand[r, k, j], meet[r, g]]
                    if v < best:
                        best = v
                arrive[k, g] = best
        if enumerated:
            for g in range(G):
                kept_max[0, g] = -np.inf
            for s in range(1, M):
                low = 0
                while not (s >> low) & 1:
                    low += 1
                for g in range(G):
                    if dup[g]:
                        continue
                    kept_max[s, g] = max(kept_max[s & (s - 1), g], arrive[low, g])
        best_cost = np.inf
        best_a = 0  # numpy's argmin of an all-inf row
        best_lat = np.nan
        for m in range(M):
            if not feasible[r, m]:
                continue
            for g in range(G):
                if dup[g]:
                    continue
                if enumerated:
                    lat = kept_max[M - 1 - m, g]
                else:
                    lat = -np.inf
                    for k in range(K):
                        if not mask[r, m, k] and arrive[k, g] > lat:
                            lat = arrive[k, g]
                lat = max(lat, sub_ready[r, m] + to_meet[g])
                lat = max(lat, 0.0)
                if last[r]:
                    lat = lat + home_leg[g]
                # the look-ahead is >= 0 and rounding is monotone: an action whose cost without it is no
                # better than the best so far cannot win (skips the table read, changes no pick)
                cost = alpha[r] * lat + qterm[r, m]
                if use_table and (alpha[r] < 0 or cost < best_cost):
                    cost = alpha[r] * (lat + table[part[r, m] + meet[r, g] * stride]) + qterm[r, m]
                if cost < best_cost:
                    best_cost, best_a, best_lat = cost, m * G + g, lat
        m, g = best_a // G, best_a % G
        if best_lat != best_lat:  # nothing finite: action best_a's latency all the same (numpy reports it)
            lat = -np.inf
            for k in range(K):
                if not mask[r, m, k] and arrive[k, g] > lat:
                    lat = arrive[k, g]
            lat = max(max(lat, sub_ready[r, m] + to_meet[g]), 0.0)
            if last[r]:
                lat = lat + home_leg[g]
            best_lat = lat
        pick[r], lat_out[r] = best_a, best_lat
        # each slot's node: a replaced slot's stand-in node, else the candidate that reaches g first (first on ties)
        for k in range(K):
            if mask[r, m, k]:
                node[r, k] = stand_node[r, m, k]
                continue
            best = np.inf
            bj = 0
            for j in range(J):
                v = base[r, k, j] + xfer[cand[r, k, j], meet[r, g]]
                if v < best:
                    best, bj = v, j
            node[r, k] = cand[r, k, bj]
    return pick, lat_out, node


def steered_pick(opt, part: np.ndarray | None, stride: int, table: np.ndarray, location: np.ndarray, home: np.ndarray,
                 last: np.ndarray, feasible: np.ndarray, qterm: np.ndarray, alpha: np.ndarray):
    """(pick [T], latency [T], node [T, K]) for a steered `Options` built without its [T, M, G] latency
    (`layer_options(..., steered_latency=False)`): see `_steered_pick`. part: [T, M] look-ahead index or None (H = 0)."""
    use_table = part is not None
    if part is None:
        part = np.zeros(feasible.shape, np.int64)
    return _steered_pick(np.ascontiguousarray(opt.cand_ready), np.ascontiguousarray(opt.cand), np.ascontiguousarray(opt.meet),
                         np.ascontiguousarray(opt.xfer_s), np.ascontiguousarray(opt.mask), np.ascontiguousarray(opt.node_m),
                         np.ascontiguousarray(opt.sub_ready, dtype=float), location.astype(np.int64), home.astype(np.int64),
                         np.ascontiguousarray(last), np.ascontiguousarray(feasible), np.ascontiguousarray(qterm, dtype=float),
                         np.ascontiguousarray(alpha, dtype=float), np.ascontiguousarray(part, dtype=np.int64), int(stride),
                         table, use_table)
