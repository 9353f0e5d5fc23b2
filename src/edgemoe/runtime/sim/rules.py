"""Compiled decisions of the policies whose decision is a fixed rule of the context (exact, slimcaching, drop).

Such policies (`Policy.compiled_rule`) are decided inside the fast engine's compiled loop (`_drive`): a
whole chunk of waves runs without coming back to Python. The rules repeat `edgemoe.runtime.policy`'s
arithmetic operation for operation (choose_replicas, branch_ready_s, meeting_node), so each row gets the
same node, meeting node and latency, bit for bit (tests/runtime/sim/test_sim_speed.py pins it).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgemoe.jit import njit

from ..policy import Decision
from .engine import _rows_into, _wave_step
from .jobqueue import C_PENDING

_I = np.int64

RULES = {"exact": 0, "slimcaching": 1, "drop": 2}  # rule name -> code of `_decide_rows`
RULE_EXACT, RULE_SLIMCACHING, RULE_DROP = RULES["exact"], RULES["slimcaching"], RULES["drop"]


class RuleTables(NamedTuple):
    """What `_decide_rows` reads and writes besides the wave: routing, token state, placement, costs."""

    topk: np.ndarray  # [Q, L, K] the trace's experts
    gates: np.ndarray  # [Q, L, K] and gates
    user: np.ndarray  # [R] token state (`TokenState`): user, home; location, layer, top-1 written in place
    home: np.ndarray
    loc: np.ndarray
    layer: np.ndarray
    top1: np.ndarray
    usable: np.ndarray  # [U, N]
    hosts: np.ndarray  # [N, L, E]
    rt: np.ndarray  # [N, N] round trip xfer + xfer.T
    compute: np.ndarray  # [N, L, E]
    hold_ptr: np.ndarray  # holder lists (`holder_lists`) and their compute seconds
    hold_node: np.ndarray
    hold_compute: np.ndarray
    is_cloud: np.ndarray  # [N]
    migrate: bool
    sorted_on: bool  # the sorted search (every node usable, tables small enough)
    cand_ptr: np.ndarray  # the rule's candidate lists (`holder_lists`)
    cand_node: np.ndarray
    cand_compute: np.ndarray
    srt_built: np.ndarray  # [N] bool: location's sorted row built
    srt_static: np.ndarray  # [N, C] static cost per location, ascending
    srt_node: np.ndarray  # [N, C] and its node
    ready: np.ndarray  # [K] scratch: a row's branch ready times (`_decide_rows` allocates nothing)


class DecisionBuffers(NamedTuple):
    """The decisions of many waves, one row a token-layer ([B] or [B, K])."""

    experts: np.ndarray  # [B, K] expert run per slot (-1: none)
    node: np.ndarray  # [B, K] node per slot (-1: not run)
    loc: np.ndarray  # [B] token's node before the layer
    next: np.ndarray  # [B] meeting node
    lat: np.ndarray  # [B] the policy's latency estimate
    topk: np.ndarray  # [B, K] the routed experts
    layer: np.ndarray  # [B]
    home: np.ndarray  # [B]
    pass_: np.ndarray  # [B] the row's pass


def decision_buffers(cap: int, K: int) -> DecisionBuffers:
    """Empty buffers for cap rows of K slots."""
    return DecisionBuffers(np.empty((cap, K), _I), np.empty((cap, K), _I), np.empty(cap, _I), np.empty(cap, _I),
                           np.empty(cap), np.empty((cap, K), _I), np.empty(cap, _I), np.empty(cap, _I),
                           np.empty(cap, _I))


SORTED_MAX_CELLS = 1 << 22  # per-location sorted candidate tables: N x candidates cells at most (64 MiB)


def holder_lists(hosts: np.ndarray, compute_s: np.ndarray, is_cloud: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR of the nodes holding each (layer, expert): ([L * E + 1] start, [nnz] node, ascending per entry,
    [nnz] the node's compute seconds of that expert, contiguous for the replica search).

    is_cloud: given, the candidates of the "fallback" rule when every node is usable: the non-cloud holders
    if there are any, else the (cloud) holders."""
    N, L, E = hosts.shape
    held = np.moveaxis(np.asarray(hosts, bool), 0, -1).reshape(L * E, N)  # [(l, e), n]
    if is_cloud is not None and is_cloud.any():
        edge = held & ~is_cloud
        held = np.where(edge.any(axis=1, keepdims=True), edge, held)
    ptr = np.zeros(L * E + 1, _I)
    ptr[1:] = np.cumsum(held.sum(axis=1))
    le, node = np.nonzero(held)  # row-major: per (l, e), nodes in ascending order
    return ptr, node.astype(_I), np.moveaxis(compute_s, 0, -1).reshape(L * E, N)[le, node].astype(float)


@njit(cache=True, inline="always")
def _before(v1, n1, v2, n2):
    """(v1, n1) sorts before (v2, n2): by value, NaN last as numpy sorts it, then by node."""
    nan1, nan2 = v1 != v1, v2 != v2
    if nan1 or nan2:
        return nan2 and (not nan1 or n1 < n2)
    return v1 < v2 or (v1 == v2 and n1 < n2)


@njit(cache=True, inline="always")
def _sift(vs, ns, a, root, end):
    """Heap sort's sift-down of entry `root` of the heap vs[a:a + end], ns[a:a + end] (ordered by `_before`)."""
    while True:
        child = 2 * root + 1
        if child >= end:
            return
        if child + 1 < end and _before(vs[a + child], ns[a + child], vs[a + child + 1], ns[a + child + 1]):
            child += 1
        if not _before(vs[a + root], ns[a + root], vs[a + child], ns[a + child]):
            return
        vs[a + root], vs[a + child] = vs[a + child], vs[a + root]
        ns[a + root], ns[a + child] = ns[a + child], ns[a + root]
        root = child


@njit(cache=True, inline="always")
def _sort_candidates(loc, rt, cand_ptr, cand_node, cand_compute, srt_static, srt_node):
    """Row `loc` of the sorted search's tables: each (layer, expert)'s candidates by static cost rt[loc, n] +
    compute (the brute force's first sum), ties in ascending node order: what a stable sort of the ascending
    lists gives, here as an in-place heap sort on (cost, node), so that `_decide_rows`, which inlines it,
    allocates nothing (see its docstring)."""
    vs, ns = srt_static[loc], srt_node[loc]
    for le in range(cand_ptr.shape[0] - 1):
        a, z = cand_ptr[le], cand_ptr[le + 1]
        for i in range(a, z):
            vs[i] = rt[loc, cand_node[i]] + cand_compute[i]
            ns[i] = cand_node[i]
        m = z - a
        for root in range(m // 2 - 1, -1, -1):  # a max-heap on (cost, node) ...
            _sift(vs, ns, a, root, m)
        for end in range(m - 1, 0, -1):  # ... whose largest goes to the end, one at a time
            vs[a], vs[a + end] = vs[a + end], vs[a]
            ns[a], ns[a + end] = ns[a + end], ns[a]
            _sift(vs, ns, a, 0, end)


@njit(cache=True, error_model="numpy")
def _decide_rows(rule, rows, rpass, rlayer, rtok, tables, load, xfer, num_layers, out, b, nodes_only):
    """Decide the T rows of one wave by `rule` (RULES) into the buffers' rows b .. b + T and update the token
    state (location, next layer, top-1) as `Policy.decide` does.

    nodes_only (np.bool_): write the slots' nodes (out.node) and nothing else, the token state untouched: the
    replica choice alone, which the OrderMoE kernel reads (its own meeting rule and state update follow).

    tables: a `RuleTables`; out: a `DecisionBuffers`. The arithmetic is that of `exact_decision` / `DropPolicy.choose`: branch ready = (xfer + load) + compute, meeting node by
    the earliest finish among (token's node, slot nodes) with the trip home after the last layer.
    One of four copies of the layer rule (the others: `edgemoe.runtime.policy`, the reference;
    `plan.ordermoe.runtime_model.PathModel`; `runtime.policies.ordermoe_kernel`); pinned to the policies'
    own `decide` by tests/runtime/sim/test_sim_speed.py (`test_compiled_rule_is_the_policy_call_bit_for_bit`).
    A call of its own per wave (not inlined): `_drive`, `_drive_ordermoe` and the decode path share one
    compiled copy. It calls no other compiled function, allocates nothing and raises nothing (numpy's error
    model), so that LLVM drops numba's reference counting of its ~35 array arguments, an atomic add and
    subtract each per call otherwise (tests/runtime/sim/test_kernel_refcounts.py holds it to that).
    """
    (topk_tab, gates_tab, st_user, st_home, st_loc, st_layer, st_top1, usable, hosts, rt, compute, hold_ptr,
     hold_node, hold_compute, is_cloud, migrate, sorted_on, cand_ptr, cand_node, cand_compute, srt_built, srt_static,
     srt_node, ready) = tables
    out_experts, out_node, out_loc, out_next, out_lat, out_topk, out_layer, out_home, out_pass = out
    K = topk_tab.shape[2]
    E = compute.shape[2]
    has_cloud = False
    for n in range(is_cloud.shape[0]):
        if is_cloud[n]:
            has_cloud = True
    # the load the rule sees (slimcaching: none) as a flag, not as a conditional array (`seen = zeros if ... else load`): numba would
    # keep that variable's reference count, and with it that of every array argument (see the docstring)
    blind = rule == RULE_SLIMCACHING
    for t in range(rows.shape[0]):
        r, lv, tok = rows[t], rlayer[t], rtok[t]
        o = b + t
        loc, home = st_loc[r], st_home[r]
        for k in range(K):
            e = topk_tab[tok, lv, k]
            out_topk[o, k] = e
            if hosts[loc, lv, e]:
                node = loc
            elif rule == RULE_DROP:
                node = -1
            else:  # choose_replicas: the first holder (ascending index) with the least (round trip + compute) +
                # load among the usable ones; "fallback" (exact): the cloud only when no usable non-cloud node
                # holds it (np.argmin's first-index tie-break). Written out here: an inlined call with array
                # arguments would reference-count them per slot.
                u, le = st_user[r], lv * E + e
                if sorted_on and rule != RULE_DROP:
                    if not srt_built[loc]:
                        _sort_candidates(loc, rt, cand_ptr, cand_node, cand_compute, srt_static, srt_node)
                        srt_built[loc] = True
                    # ascending static cost s (ties: lower node first); total = s + load >= s, so once s exceeds
                    # the best total no later candidate can reach it; equal totals go to the lower node index
                    best, node = np.inf, -1
                    for i in range(cand_ptr[le], cand_ptr[le + 1]):
                        s = srt_static[loc, i]
                        if s > best:
                            break
                        n = srt_node[loc, i]
                        c = s + (0.0 if blind else load[n])
                        if c < best or (c == best and n < node):
                            best, node = c, n
                    if node < 0:
                        node = 0
                else:
                    best_all, arg_all = np.inf, 0
                    best_edge, arg_edge = np.inf, -1
                    for i in range(hold_ptr[le], hold_ptr[le + 1]):
                        n = hold_node[i]
                        if not usable[u, n]:
                            continue
                        c = rt[loc, n] + hold_compute[i] + (0.0 if blind else load[n])
                        if c < best_all:
                            best_all, arg_all = c, n
                        if not is_cloud[n] and (arg_edge < 0 or c < best_edge):
                            best_edge, arg_edge = c, n
                    node = arg_edge if rule == RULE_EXACT and has_cloud and arg_edge >= 0 else arg_all
            out_node[o, k] = node
            if nodes_only:
                continue
            # (the sorted search's node is never -1)
            out_experts[o, k] = e if node >= 0 else -1
            ready[k] = (xfer[loc, node] + (0.0 if blind else load[node])) + compute[node, lv, e] if node >= 0 else -np.inf
        if nodes_only:
            continue
        if not migrate or K == 0:  # outputs return to the token's node
            nxt = loc
            lat = 0.0
            for k in range(K):
                node = out_node[o, k]
                v = ready[k] + (xfer[node, loc] if node >= 0 else 0.0)
                if v > lat:
                    lat = v
        else:  # earliest finish among the token's node and the slot nodes (first wins ties)
            nxt, lat = loc, np.inf
            for g in range(K + 1):
                c = loc if g == 0 else out_node[o, g - 1]
                if c < 0:
                    continue
                done = -np.inf
                for k in range(K):
                    node = out_node[o, k]
                    v = ready[k] + xfer[node if node > 0 else 0, c]
                    if v > done:
                        done = v
                if done < 0.0:  # np.maximum(done, 0.0)
                    done = 0.0
                done = done + (xfer[c, home] if lv == num_layers - 1 else 0.0)
                if done < lat:
                    nxt, lat = c, done
        out_loc[o] = loc
        out_next[o] = nxt
        out_lat[o] = lat
        out_layer[o] = lv
        out_home[o] = home
        out_pass[o] = rpass[t]
        st_loc[r] = nxt
        st_layer[r] += 1
        best = 0
        for k in range(1, K):
            if gates_tab[tok, lv, k] > gates_tab[tok, lv, best]:
                best = k
        st_top1[r] = topk_tab[tok, lv, best] if K else -1


@njit(cache=True)
def _drive(chunk_rows, rule, stamp, wave, tables, out, passes, nodes, scenario, cost):
    """Decide (`_decide_rows`) and run (`_wave_step`) waves, starting from the picked wave (ids, rows, pass,
    layer, token), until the run ends, the decision buffers `out` hold >= chunk_rows rows, or the next wave
    does not fit in them or in the job queue. tables: `RuleTables`; out: `DecisionBuffers`; the rest: the engine's groups (`WaveEngine._groups`).
    Returns (next wave's ids, rows, pass, layer, token, stamp, more,
    rows in the buffers); the caller counts the buffered decisions, makes room if needed, and calls again.
    It calls `engine._wave_step` once per wave, whose compiled code numba's disk cache keeps inside this
    function's, and that cache checks only this file: after a change to the engine's compiled parts, clear the
    cache (`__pycache__/*.nbi`) or their old code keeps running here."""
    ids, rows, rpass, rlayer, rtok = wave
    out_experts, out_node, out_loc, out_next, out_lat, out_topk, out_layer, out_home, out_pass = out
    load, jobs_f, counters = nodes.load, nodes.queue.jobs_f, nodes.counters
    xfer, num_layers = cost.xfer, cost.num_layers
    layer, row_start, row_count, row_trace = passes.layer, scenario.pass_row_start, scenario.pass_row_count, scenario.row_trace
    rows_buf, rpass_buf, rlayer_buf, rtok_buf = scenario.wave_rows
    K = tables.topk.shape[2]
    b = np.int64(0)  # not a literal 0: `_decide_rows` would compile again for it
    more = True
    while True:
        T = rows.shape[0]
        if b + T > out_pass.shape[0] or counters[C_PENDING] + T * K > jobs_f.shape[0]:
            break
        _decide_rows(rule, rows, rpass, rlayer, rtok, tables, load, xfer, num_layers, out, b, np.bool_(False))
        e = b + T
        dec = (out_pass[b:e], out_layer[b:e], out_home[b:e], out_node[b:e], out_experts[b:e], out_loc[b:e],
               out_next[b:e])
        # np.bool_(True): the type a Python bool has (a literal True would make numba compile `_wave_step` again)
        ids, stamp, more = _wave_step(np.bool_(True), stamp, ids, dec, passes, nodes, scenario, cost)
        # the next wave's rows, into the scratch `wave_rows` (views valid until the next wave's)
        q = _rows_into(ids, layer, row_start, row_count, row_trace, rows_buf, rpass_buf, rlayer_buf, rtok_buf)
        rows, rpass, rlayer, rtok = rows_buf[:q], rpass_buf[:q], rlayer_buf[:q], rtok_buf[:q]
        b = e
        if not more or b >= chunk_rows:
            break
    return ids, rows, rpass, rlayer, rtok, stamp, more, b


def rule_tables(ctx, state, trace, rule: str, loc=None, layer=None, top1=None) -> RuleTables:
    """`_decide_rows`' tables of `rule` (RULES) on the token state `state` (its location, layer and top-1
    arrays, written in place, unless loc, layer, top1 name others)."""
    xfer = np.ascontiguousarray(ctx.xfer_s, float)
    rt = xfer + xfer.T  # the round trip xfer[c, n] + xfer[n, c] of choose_replicas, the same sum
    hold_ptr, hold_node, hold_compute = holder_lists(ctx.hosts, ctx.compute_s)
    # Every node usable (no device nodes): the search runs over per-location candidate lists sorted by
    # static cost (round trip + compute), built on first use, and stops early (`_decide_rows`).
    cand_ptr, cand_node, cand_compute = holder_lists(ctx.hosts, ctx.compute_s,
                                                     ctx.is_cloud if rule == "exact" else None)
    N = ctx.num_nodes
    sorted_on = bool(ctx.usable.all()) and N * max(cand_node.size, 1) <= SORTED_MAX_CELLS
    shape = (N, cand_node.size) if sorted_on else (1, 1)
    return RuleTables(trace.topk, trace.gates, state.user, state.home,
                      state.location if loc is None else loc, state.layer if layer is None else layer,
                      state.prev_top1 if top1 is None else top1, ctx.usable, ctx.hosts, rt, ctx.compute_s,
                      hold_ptr, hold_node, hold_compute, ctx.is_cloud, ctx.mode == "migrate", sorted_on, cand_ptr,
                      cand_node, cand_compute, np.zeros(N, bool), np.zeros(shape), np.zeros(shape, _I),
                      np.empty(trace.topk.shape[2]))


def run_rule(engine, rule: str, ctx, state, trace, count, chunk_rows: int = 1 << 16) -> None:
    """Run the whole simulation of `engine` (a `WaveEngine`) with a compiled decision rule (RULES) in place of
    the policy's `decide`.

    state: the policy's TokenState of every row (location, layer, top-1 updated in place); count(dec,
    topk, layer, home, row_pass) receives the decisions in chunks of >= chunk_rows rows (the last smaller).
    """
    K = ctx.top_k
    wave = engine.first_wave()
    if wave is None:
        return
    rows, rpass, rlayer, rtok, _ = wave
    ids = engine.ids
    tables = rule_tables(ctx, state, trace, rule)
    cap = 0
    while True:
        if len(rows) > cap or cap == 0:  # decision buffers: a chunk plus the wave that ends it
            cap = max(2 * chunk_rows, 2 * len(rows))
            buf = decision_buffers(cap, K)
        engine._job_room(len(rows) * K)
        ids, rows, rpass, rlayer, rtok, engine.stamp, more, b = _drive(
            chunk_rows, RULES[rule], engine.stamp, (ids, rows, rpass, rlayer, rtok), tables, buf, *engine._groups())
        if b:
            experts, node, loc, nxt, lat, topk, lv, home, row_pass = (a[:b] for a in buf)
            count(Decision(experts=experts, node=node, location=loc, next_location=nxt, quality_cost=np.zeros(b),
                           latency_s=lat), topk, lv, home, row_pass)
        if not more:
            return
