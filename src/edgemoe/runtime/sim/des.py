"""Reference engine of the simulator: an exact heapq discrete-event loop (small scenarios, tests).

Same model as the fast engine (edgemoe.runtime.sim.simulate): events are START (a pass starts a layer: its
dense work joins its home's backbone FIFO), DECIDE (the dense work is done: the policy decides), DONE (a
job's output reached the meeting node) and ARRIVE (a job reaches its node and joins the FIFO). At equal
times START, DECIDE and DONE come before ARRIVE, then creation order; a job's service starts at
max(arrival, the node's previous finish) in arrival order, which is a FIFO queue; so does a layer's dense
work on its home's backbone. With the dense part off, START is DECIDE.
"""

from __future__ import annotations

import heapq

import numpy as np

from .run import Feedback, Run, make_jobs, pass_stage_s

DECIDE, DONE, ARRIVE = 0, 0, 1  # priorities at equal times


def run_reference(ctx, policy, trace, sc, record: list | None = None, record_dense: list | None = None) -> Run:
    """record: if a list, each job's (pass, layer, node, arrival, start, finish, done) is appended to it (the
    Ray backend's virtual clock is checked against these event times); record_dense: each layer's dense work
    (pass, layer, home, arrival, start, end)."""
    P, L, N = sc.num_passes, ctx.num_layers, ctx.num_nodes
    run = Run(ctx, sc)
    state = policy.start(sc.row_user, tokens=sc.row_trace)
    run.budget_total = float(state.budget_total.sum())
    dense, staged = pass_stage_s(ctx, sc, policy)  # [P] seconds of one layer's dense work (+ decision, charged)
    feedback = Feedback(policy, sc, state, run, dense_s=dense)
    pass_home = ctx.user_home[sc.request_user[sc.pass_request]]
    backbone_free = np.full(N, -np.inf)  # each home's backbone queue (dense work, one layer of one pass at a time)
    layer = np.zeros(P, np.int64)
    done_t = np.zeros(P)
    outstanding = np.zeros(P, np.int64)
    node_free = np.zeros(N)
    heap: list = []
    seq = 0

    def push(t, prio, kind, data):
        nonlocal seq
        heapq.heappush(heap, (float(t), prio, seq, kind, data))
        seq += 1

    start_kind = "start" if staged else "decide"
    for r in np.flatnonzero(np.isfinite(sc.request_arrival)):
        push(sc.request_arrival[r], DECIDE, start_kind, int(sc.request_first_pass[r]))

    def layer_done(p: int, t: float) -> None:
        layer[p] += 1
        if layer[p] < L:
            push(t, DECIDE, start_kind, p)
            return
        run.pass_end[p] = t
        nxt = sc.pass_next[p]
        if nxt >= 0:
            push(t, DECIDE, start_kind, int(nxt))
        elif sc.closed:
            r = sc.request_next[sc.pass_request[p]]
            if r >= 0:
                run.request_arrival[r] = t + sc.think_s
                push(t + sc.think_s, DECIDE, start_kind, int(sc.request_first_pass[r]))

    while heap:
        t, _, _, kind, data = heapq.heappop(heap)
        if kind == "start":  # the layer's dense work queues on the home's backbone; the policy decides after it
            p = data
            if layer[p] == 0:
                run.pass_begin[p] = t
            h = int(pass_home[p])
            begin = max(t, backbone_free[h])
            backbone_free[h] = end = begin + dense[p]
            if record_dense is not None:
                record_dense.append((p, int(layer[p]), h, t, begin, end))
            push(end, DECIDE, "decide", p)
        elif kind == "decide":
            p = data
            lv = int(layer[p])
            rows = sc.rows_of(np.array([p]))
            part = state.take(rows)
            tok = sc.row_trace[rows]
            topk, gates = trace.topk[tok, lv], trace.gates[tok, lv]
            dec = policy.decide(lv, topk, gates, part, np.maximum(node_free - t, 0.0))
            state.put(rows, part)
            run.tally.add(dec, topk, lv, part.home, sc.pass_prefill[p])
            feedback.add(np.full(len(rows), p), dec)
            feedback.flush()
            if lv == 0 and not staged:
                run.pass_begin[p] = t
            row_pass = np.full(len(rows), p)
            jpass, node, arrival, service, back, floor = make_jobs(ctx, lv, dec, row_pass, np.full(len(rows), t), part.home)
            done_t[p] = max(t, float(floor.max()))
            outstanding[p] = len(jpass)
            if outstanding[p] == 0:
                layer_done(p, done_t[p])
            for j in range(len(jpass)):
                push(arrival[j], ARRIVE, "arrive", (p, int(node[j]), float(service[j]), float(back[j])))
        elif kind == "arrive":
            p, n, service, back = data
            begin = max(t, node_free[n])
            finish = begin + service
            if record is not None:
                record.append((p, int(layer[p]), n, t, begin, finish, finish + back))
            node_free[n] = finish
            run.node_busy[n] += service
            push(finish + back, DONE, "done", p)
        else:  # done
            p = data
            done_t[p] = max(done_t[p], t)
            outstanding[p] -= 1
            if outstanding[p] == 0:
                layer_done(p, done_t[p])
    feedback.flush(force=True)
    return run
