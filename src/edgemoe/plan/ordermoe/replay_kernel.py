"""`PathModel`'s incremental replay, compiled: each row walks the layers one decision at a time.

The numpy form (`PathModel._propagate_numpy` over `PathModel.step`) decides a batch of rows with a few dozen
array operations on [R', K, H], [R', M, K] and [R', M, K+1] temporaries per layer; on a 24-layer, top-4
model a search evaluation replays tens of thousands of rows, and those temporaries are where the planner
spends its time. This kernel decides the same rows one at a time without materialising them.

It does the same floating-point operations in the same order as the numpy path (the same sums, exact maxima
and minima, first index on ties), so it reports the same bits. The one reduction whose order numpy leaves
to its build is `standins.choose_stand_ins`'s einsum over the run slots (the drop cost's mix); here it is
summed as numpy's einsum sums K <= 6 terms on x86-64 (two interleaved partial sums, even and odd slots,
then added), which tests/plan/ordermoe/test_replay_kernel.py checks against the numpy path. Only the
enumerated stand-in actions (K <= `standins.MAX_ENUM_K`) are compiled; wider layers take the numpy path.

Budget bounds. A row whose change has passed (a later layer, on the node the old replay had it on) still
differs from the old replay when it carries a different budget, and with stand-ins it then ran to the last
layer. But a decision depends on the budget left only through which actions fit it (`q <= left + 1e-12`):
it stays the same for any budget that still admits the chosen action (its cost, q_need; -inf when no
stand-in was taken) and admits none of the actions that would beat it (the least of their costs, q_block;
inf when none would). The replay stores both per row and layer, and a propagating row whose budget is inside
its old decision's bounds takes that decision without pricing the actions again: the same bits, with the
pricing done only where the budget changes an outcome.

One of the copies of the layer rule (the reference is `edgemoe.runtime.policy`; the others are
`runtime.sim.rules._decide_rows`, `runtime.policies.ordermoe_kernel` and this module's numpy twin
`PathModel.step`), pinned by tests/plan/ordermoe/test_replay_kernel.py and test_planner.py.
"""

from __future__ import annotations

import numpy as np

from edgemoe.jit import njit


@njit(cache=True, inline="always")
def _candidate_node(j, H, held, flip_hit, f_node, f_value):  # pragma: no cover - compiled
    """Node of a branch's j-th replica candidate (-1: none), for both passes of `propagate_rows`' exact rule
    (the first finds whether a usable non-cloud holder exists, the second takes the cloud only when none
    does): j < H is its j-th holder `held` (-1 padded), less the flipped node when the flip hits the branch
    (flip_hit), and j == H the flipped node when the flip adds the expert there (f_value). Scalars only: an
    inlined call with array arguments would reference-count them per candidate."""
    if j < H:
        return -1 if held < 0 or (flip_hit and held == f_node) else held
    return f_node if flip_hit and f_value else -1


@njit(cache=True)
def propagate_rows(rows, layer, loc0, left0, new_lat, new_loc, new_left, old_loc, old_left,
                   q_need, q_block, reuse, has_flip, f_node, f_changed, f_value,
                   hosts, holders, topk, gates, user, home, usable, rt, xfer, compute, is_cloud, any_cloud,
                   miss_s, home_mode, subs, subst_err, row_budget, standins, use_sub, use_drop, use_zero,
                   power):  # pragma: no cover - compiled (the numpy twin is the reference)
    """Replay rows[i] from `layer` on, writing each layer's (latency, next location, budget left) into
    new_lat [R', L], new_loc [R', L+1], new_left [R', L+1] (which hold the old values: a row that comes back
    to its old location and budget keeps them from there on, as in `PathModel._propagate_numpy`).

    loc0, left0: [R'] start of `layer`; old_loc, old_left: [R', L+1] the old replay's values.
    q_need, q_block: [R', L] each decision's budget bounds (module docstring, "Budget bounds"), holding the
    old replay's and receiving the new ones; reuse: they hold the old replay's (else nothing is reused).
    has_flip: row i sees hosts[f_node[i], layer, f_changed[i]] = f_value at `layer` (f_changed [R', F], -1
    padded). holders: [L, E, H] nodes holding each expert (ascending, -1 padded) under `hosts` [N, L, E].
    standins: the budget is > 0 and some stand-in kind is allowed (use_sub / use_drop / use_zero)."""
    R = rows.shape[0]
    L = hosts.shape[1]
    K = topk.shape[2]
    N = hosts.shape[0]
    H = holders.shape[2]
    S = subs.shape[2]
    F = f_changed.shape[1]
    M = 1 << K
    node = np.empty(K, np.int64)
    miss = np.empty(K, np.bool_)
    sub = np.empty(K, np.int64)
    sub_err = np.empty(K)
    cand = np.empty(K + 1, np.int64)
    done = np.empty(K + 1)
    ready_x = np.empty(K)
    ready_s = np.empty(K)
    q_sub = np.empty(K)
    q_zero = np.empty(K)
    err = np.empty((K, K))
    p = np.empty(K)
    kind = np.empty(K, np.int64)
    cost = np.empty(K)
    back = np.empty(K)
    arrive = np.empty((K, K + 1))
    to_home = np.empty(K + 1)
    a_score = np.empty(M)
    a_q = np.empty(M)
    a_lat = np.empty(M)
    a_nxt = np.empty(M, np.int64)
    for i in range(R):
        r = rows[i]
        u = user[r]
        c = loc0[i]
        left = left0[i]
        lay = layer
        while lay < L:
            # Past the changed layer, a row on its old node meets the old replay's hosts there: its old decision
            # stands unless the budget it carries now crosses one of that decision's bounds.
            if reuse and lay > layer and c == old_loc[i, lay]:
                need = q_need[i, lay]
                if need <= left + 1e-12 and not q_block[i, lay] <= left + 1e-12:
                    if need > -np.inf:
                        left = left - need
                    else:
                        left = left - 0.0
                    c = old_loc[i, lay + 1]
                    new_loc[i, lay + 1] = c
                    new_left[i, lay + 1] = left  # new_lat[i, lay] holds the old (same) seconds already
                    if left == old_left[i, lay + 1]:
                        break
                    lay += 1
                    continue
            flip = has_flip and lay == layer
            need = -np.inf  # no stand-in: the decision holds for any budget
            block = np.inf
            # ---- each branch's node by the exact rule (`PathModel._replicas`)
            n_miss = 0
            for k in range(K):
                e = topk[r, lay, k]
                hit = False
                if flip:
                    for f in range(F):
                        if f_changed[i, f] == e:
                            hit = True
                local = hosts[c, lay, e]
                if flip and hit and c == f_node[i]:
                    local = f_value
                best = np.inf
                best_n = N
                any_edge = False
                any_cand = False
                # two passes when there is a cloud: the cloud only when no other usable holder exists
                for j in range(H + 1):
                    n = _candidate_node(j, H, holders[lay, e, j] if j < H else -1, flip and hit, f_node[i], f_value)
                    if n < 0:
                        continue
                    if usable[u, n]:
                        any_cand = True
                        if not is_cloud[n]:
                            any_edge = True
                for j in range(H + 1):
                    n = _candidate_node(j, H, holders[lay, e, j] if j < H else -1, flip and hit, f_node[i], f_value)
                    if n < 0:
                        continue
                    if not usable[u, n]:
                        continue
                    if any_cloud and any_edge and is_cloud[n]:
                        continue
                    v = rt[c, n] + compute[n, lay, e]
                    if v < best or (v == best and n < best_n):
                        best = v
                        best_n = n
                if not np.isfinite(best):
                    best_n = 0
                miss[k] = (not any_cand) and not local
                node[k] = c if local else best_n
                if miss[k]:
                    n_miss += 1
            penalty = miss_s * n_miss
            # ---- no stand-in (`PathModel._finish`)
            last = lay == L - 1
            for k in range(K):
                e = topk[r, lay, k]
                ready_x[k] = xfer[c, node[k]] + compute[node[k], lay, e]
            # each branch's arrival (ready + the trip back, or to each meeting candidate), kept for the actions
            if home_mode:
                lat = 0.0
                for k in range(K):
                    back[k] = -np.inf if miss[k] else ready_x[k] + xfer[node[k], c]
                    if back[k] > lat:
                        lat = back[k]
                best_lat = lat + penalty
                best_nxt = c
            else:
                cand[0] = c
                for k in range(K):
                    cand[k + 1] = c if miss[k] else node[k]
                pick = 0
                for g in range(K + 1):
                    v = -np.inf
                    for k in range(K):
                        w = -np.inf if miss[k] else ready_x[k] + xfer[cand[k + 1], cand[g]]
                        arrive[k, g] = w
                        if w > v:
                            v = w
                    if v < 0.0:
                        v = 0.0
                    to_home[g] = xfer[cand[g], home[r]] if last else 0.0
                    if last:
                        v = v + to_home[g]
                    done[g] = v
                    if v < done[pick]:
                        pick = g
                best_lat = done[pick] + penalty
                best_nxt = cand[pick]
            best_q = 0.0
            # ---- the ordermoe policy's myopic stand-ins (`PathModel._step_standins`)
            if standins:
                # An action may replace only slots run remotely (valid below needs node != c and no miss), so
                # only the actions inside this bit mask of remote slots are priced, and only their slots'
                # stand-ins are looked up: the others are skipped unread, which changes no value.
                remote = 0
                for k in range(K):
                    if node[k] != c and not miss[k]:
                        remote |= 1 << k
                if remote != 0 and row_budget[r] > 0:
                    for k in range(K):
                        if not (remote >> k) & 1:
                            continue
                        e = topk[r, lay, k]
                        sub[k] = -1
                        if use_sub:
                            for s in range(S):
                                mate = subs[lay, e, s]
                                if mate < 0:
                                    continue
                                ok = hosts[c, lay, mate]
                                if flip and c == f_node[i]:
                                    for f in range(F):
                                        if f_changed[i, f] == mate:
                                            ok = f_value
                                if ok:
                                    sub[k] = mate
                                    break
                        sub_err[k] = subst_err[lay, e, sub[k]] if sub[k] >= 0 else np.inf
                        g = gates[r, lay, k]
                        q_sub[k] = g * sub_err[k] if (use_sub and sub[k] >= 0) else np.inf
                        q_zero[k] = g if use_zero else np.inf
                        for j in range(K):
                            err[k, j] = subst_err[lay, e, topk[r, lay, j]]
                    here = xfer[c, c]
                    for k in range(K):
                        if (remote >> k) & 1:
                            ready_s[k] = here + compute[c, lay, sub[k] if sub[k] >= 0 else 0]
                    act_lat = np.inf
                    act_score = np.inf
                    act_nxt = c
                    act_q = 0.0
                    n_act = 0
                    for m in range(1, M):
                        if (m | remote) != remote:
                            continue  # replaces a slot run here or missed: never valid
                        # -- `choose_stand_ins` for action m
                        wsum = 0.0
                        for j in range(K):
                            if not (m >> j) & 1:
                                wsum += gates[r, lay, j]
                        # only the replaced slots' kinds and costs are read below (as in numpy, where the
                        # kept slots' values are computed and then masked out)
                        for k in range(K):
                            if not (m >> k) & 1:
                                continue
                            q_drop = np.inf
                            if use_drop and K > 1 and wsum > 0:
                                even = 0.0
                                odd = 0.0
                                for j in range(0, K, 2):
                                    if not (m >> j) & 1:
                                        even += gates[r, lay, j] * err[k, j]
                                    else:
                                        even += 0.0 * err[k, j]
                                for j in range(1, K, 2):
                                    if not (m >> j) & 1:
                                        odd += gates[r, lay, j] * err[k, j]
                                    else:
                                        odd += 0.0 * err[k, j]
                                q_drop = gates[r, lay, k] * (even + odd) / wsum
                            sub_first = q_sub[k] <= q_zero[k]
                            q_sz = q_sub[k] if sub_first else q_zero[k]
                            if q_drop < q_sz or (q_drop == q_sz and not sub_first):
                                kind[k] = 1
                                p[k] = q_drop
                            else:
                                kind[k] = 0 if sub_first else 2
                                p[k] = q_sz
                        no_expert = K > 0
                        for k in range(K):
                            if not ((m >> k) & 1 and kind[k] != 0):
                                no_expert = False
                        if no_expert:
                            for k in range(K):
                                p[k] = np.inf
                        if power == 1.0:
                            for k in range(K):
                                cost[k] = p[k]
                        else:
                            layer_p = 0.0
                            for k in range(K):
                                if (m >> k) & 1:
                                    layer_p += p[k]
                            for k in range(K):
                                if (m >> k) & 1:
                                    cost[k] = p[k] * layer_p ** (power - 1.0) if np.isfinite(layer_p) else np.inf
                        # -- valid: every replaced slot replaceable with a finite cost, within the budget left
                        valid = True
                        q = 0.0
                        for k in range(K):
                            if (m >> k) & 1:
                                if node[k] == c or miss[k] or not np.isfinite(cost[k]):
                                    valid = False
                                q += cost[k] if np.isfinite(cost[k]) else 0.0
                            else:
                                q += 0.0
                        if not valid:
                            continue
                        # -- the action's layer seconds (`PathModel._finish_actions`)
                        sub_ready = -np.inf
                        for k in range(K):
                            if (m >> k) & 1 and kind[k] == 0 and ready_s[k] > sub_ready:
                                sub_ready = ready_s[k]
                        if home_mode:
                            kept = -np.inf
                            for k in range(K):
                                if not (m >> k) & 1 and back[k] > kept:
                                    kept = back[k]
                            v = sub_ready + here
                            lat = kept if kept >= v else v
                            if lat < 0.0:
                                lat = 0.0
                            lat = lat + penalty
                            nxt = c
                        else:
                            pick = -1
                            best_g = np.inf
                            for g in range(K + 1):
                                if g > 0 and (m >> (g - 1)) & 1:
                                    continue  # a slot not run exactly is no meeting candidate
                                v = -np.inf
                                for k in range(K):
                                    if not (m >> k) & 1 and arrive[k, g] > v:
                                        v = arrive[k, g]
                                w = sub_ready + xfer[c, cand[g]]
                                if w > v:
                                    v = w
                                if v < 0.0:
                                    v = 0.0
                                if last:
                                    v = v + to_home[g]
                                if pick < 0 or v < best_g:
                                    best_g = v
                                    pick = g
                            lat = best_g + penalty
                            nxt = cand[pick]
                        # every structurally valid action is kept (in m order), within the budget or not,
                        # so the bounds below see the ones the budget excludes
                        a_score[n_act] = lat + 1e-9 * q
                        a_q[n_act] = q
                        a_lat[n_act] = lat
                        a_nxt[n_act] = nxt
                        n_act += 1
                    chosen = -1
                    for a in range(n_act):  # the fastest action within the budget left, first on ties
                        if a_q[a] <= left + 1e-12 and a_score[a] < act_score:
                            act_score = a_score[a]
                            act_lat = a_lat[a]
                            act_nxt = a_nxt[a]
                            act_q = a_q[a]
                            chosen = a
                    use = act_score < best_lat + 1e-9 * best_q
                    for a in range(n_act):  # the actions that would win if the budget let them in
                        if use:
                            wins = a_score[a] < act_score or (a_score[a] == act_score and a < chosen)
                        else:
                            wins = a_score[a] < best_lat + 1e-9 * best_q
                        if wins and a_q[a] < block:
                            block = a_q[a]
                    if use:
                        need = act_q
                        best_lat = act_lat
                        best_nxt = act_nxt
                        best_q = act_q
            left = left - best_q
            new_lat[i, lay] = best_lat
            new_loc[i, lay + 1] = best_nxt
            new_left[i, lay + 1] = left
            q_need[i, lay] = need
            q_block[i, lay] = block
            c = best_nxt
            # back at its old location with its old budget: the rest replays the old way (copied already)
            if best_nxt == old_loc[i, lay + 1] and left == old_left[i, lay + 1]:
                break
            lay += 1


@njit(cache=True)
def flip_affected_rows(rows, layer, loc, nodes, changed, value, device, is_server, topk, held, old_n, old_c, pos,
                       rt, compute):  # pragma: no cover - compiled (the numpy twin is the reference)
    """`PathModel.flip_affected`'s per-row test, row i seeing hosts[nodes[i], layer, changed[i]] = value.

    rows, loc, nodes: [R']; changed: [R', W] (-1 padded); held: [N, E] hosts at `layer`; old_n, old_c: [N, X]
    `holder_table` of held for the changed experts, pos [E] their column (-1: not changed). Returns [R'] bool."""
    R = rows.shape[0]
    K = topk.shape[2]
    W = changed.shape[1]
    out = np.empty(R, np.bool_)
    for i in range(R):
        r, c, n = rows[i], loc[i], nodes[i]
        hit = c == n or device[r] == n or not is_server[n]
        k = 0
        while not hit and k < K:
            e = topk[r, layer, k]
            mine = False
            for w in range(W):
                if changed[i, w] == e:
                    mine = True
            if mine and not held[c, e]:
                x = pos[e]  # >= 0: e is a changed expert
                server = old_n[c, x]
                if value:
                    moved = server < 0 or rt[c, n] + compute[n, layer, e] <= old_c[c, x]
                else:
                    moved = server < 0 or server == n
                hit = moved
            k += 1
        out[i] = hit
    return out
