"""The expert fan-out of one MoE layer on a home: calls per server, replies gathered, failures repaired.

`SlotDispatch.run` sends every slot of a layer where the decision put it, one `ExpertCall` per destination
server (whatever request or sequence the rows belong to), waits for the replies up to a deadline, and on a
failed call excludes the server, re-routes its slots to a surviving replica (edgemoe.distributed.repair) and
retries, up to `max_attempts`; slots still failing are dropped (their gates renormalised by the caller). A
slot that a failure drops or substitutes on a strict pass (exact execution or nothing) raises `Degraded`.
`Pass` is the book-keeping of one forward pass in progress, which the dispatch fills (counts, events, busy
time) and the home's layer step reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError

from .repair import repair_slots
from .wire import ExpertCall, ExpertReply, decode, encode

COUNT_KEYS = ("slots", "remote", "substituted", "dropped", "repaired", "failed_calls", "calls", "link_bytes",
              "process_bytes", "emulated_s", "degraded")  # degraded: slots a failure dropped or substituted


class Degraded(EdgeMoEError):
    """Exact execution is impossible: some routed expert has no reachable replica (HTTP 503). Raised only for
    requests that did not allow degradation (GenerateRequest.allow_degraded). rows: the pass's token rows
    whose strict slots a failure changed (a batched pass fails only their sequences)."""

    def __init__(self, message: str, rows=()):
        super().__init__(message)
        self.rows = tuple(int(r) for r in rows)


@dataclass
class Pass:
    """Book-keeping of one forward pass in progress on a home (one per thread)."""

    state: object  # TokenState
    prefill: bool
    counts: dict
    topk: list
    gates: list
    tally: object
    t: float  # nominal time the next MoE layer may start (the last layer's end so far)
    index: int = 0  # pass number within its request (0 = prefill)
    events: list = field(default_factory=list)  # [J, 10] arrays, see GenerateResult.events
    dense_events: list = field(default_factory=list)  # (pass, layer, node, arrival, start, end) per layer
    busy: np.ndarray = None  # [N] emulated accelerator seconds used per node
    estimate_s: float = 0.0  # the policy's own estimate of the pass (per layer its slowest row's latency_s)
    spent: float = 0.0  # quality budget the pass's rows spent
    late_s: float = 0.0  # host lateness: how much later than their deadlines the layers started (and the pass ended)
    strict: bool | np.ndarray = False  # exact execution or nothing (per pass, or [T] per row): a slot that a failure
    # would drop or substitute raises Degraded
    groups: list | None = None  # batched passes with per-request budgets or exact rows: [(kind, rows [R], state)]
    # (HomePolicies.decide); None: the deployment's policy decides every row on `state`
    observer: object = None  # batched passes: observer(layer, topk [T, K], final Decision) after each MoE layer
    row_degraded: np.ndarray = None  # batched passes: [T] slots a failure dropped or substituted, per row


class SlotDispatch:
    """Sends a home's expert slots to the servers that run them (`transport`), with failover.

    node: the home; cfg: the ServerConfig (wire, max_attempts, call_timeout_s); links: the home's LinkTable;
    clock: its Clock; policies: its HomePolicies (replies update the load estimate)."""

    def __init__(self, node: int, cfg, transport, membership, links, clock, policies):
        self.node, self.cfg, self.ctx = int(node), cfg, cfg.ctx
        self.transport, self.membership, self.links, self.clock, self.policies = (transport, membership, links, clock,
                                                                                   policies)

    def retime(self, cfg, clock) -> None:
        self.cfg, self.clock = cfg, clock

    def run(self, layer, hidden, experts, node, src, meet, st, p: Pass, sent: float):
        """Run every slot where node [T, K] says; failed calls are re-routed (repair) and retried up to
        max_attempts, then dropped. Returns (outputs [T, K, H] gate 1, experts, node, meet, done [T, K]) as
        executed; done: nominal time each slot's output is at the meeting node (home after the last layer),
        nan where nothing ran."""
        T, K = experts.shape
        out = torch.zeros(T, K, hidden.shape[1], device=hidden.device)
        done = np.full((T, K), np.nan)
        experts, node, meet = experts.copy(), node.copy(), meet.copy()
        counts, users = p.counts, st.user
        last = layer == self.ctx.num_layers - 1
        pending = np.argwhere(node >= 0)  # [S, 2] (row, slot)
        for _attempt in range(self.cfg.max_attempts):
            if len(pending) == 0:
                break
            calls = []
            for n in np.unique(node[pending[:, 0], pending[:, 1]]):
                mine = pending[node[pending[:, 0], pending[:, 1]] == n]
                t = mine[:, 0]
                msg = ExpertCall(layer, encode(hidden[torch.from_numpy(t)], self.cfg.wire), experts[t, mine[:, 1]],
                                 src[t], meet[t], self.cfg.wire, sent)
                calls.append((int(n), mine, self.transport.submit(int(n), msg), msg.hidden.nbytes))
            failed = self._collect(calls, layer, out, done, meet, st, p, sent, last)
            if not failed:
                pending = pending[:0]
                break
            pending = np.concatenate(failed)
            alive, _ = self.membership.snapshot()
            before = experts.copy()
            experts, node, _ = repair_slots(self.ctx, layer, experts, node, src, users, alive)
            self.degraded(layer, before, experts, p)
            meet = np.where(alive[meet], meet, src)
            counts["repaired"] += len(pending)
            pending = pending[node[pending[:, 0], pending[:, 1]] >= 0]
            sent = self.clock.stamp(sent)  # the retry leaves now
        if len(pending):  # still failing after every attempt: drop those slots (gates renormalised)
            before = experts.copy()
            experts[pending[:, 0], pending[:, 1]] = -1
            self.degraded(layer, before, experts, p)
            node[pending[:, 0], pending[:, 1]] = -1
        return out, experts, node, meet, done

    def degraded(self, layer: int, planned: np.ndarray, executed: np.ndarray, p: Pass) -> None:
        """Count the slots [T, K] a failure changed (planned an expert, now another or none); on a strict pass,
        raise Degraded naming the first such expert instead."""
        changed = (planned >= 0) & (executed != planned)
        if not changed.any():
            return
        strict = changed & np.asarray(p.strict, bool).reshape(-1, 1)  # [T, K] (a pass-wide flag broadcasts)
        if strict.any():
            t, k = np.argwhere(strict)[0]
            alive, _ = self.membership.snapshot()
            down = [self.ctx.node_names[n] for n in np.flatnonzero(~alive)]
            raise Degraded(f"exact execution impossible: expert {int(planned[t, k])} of layer {layer} has no reachable "
                           f"replica (servers down: {', '.join(down) or 'none'}); send edgemoe.allow_degraded: true "
                           "to accept dropped or substituted slots", np.flatnonzero(strict.any(axis=1)))
        p.counts["degraded"] += int(changed.sum())
        if p.row_degraded is not None:
            p.row_degraded += changed.sum(axis=1)

    def _collect(self, calls, layer, out, done, meet, st, p: Pass, sent: float, last: bool) -> list:
        """Wait for the replies of `calls`, fill out/done, record events; returns the failed calls' slots.
        A call may take its emulated time (dilated) plus `call_timeout_s` of wall time before it counts as failed."""
        counts = p.counts
        slack = self.clock.dilation * (2.0 * float(self.links.xfer_s.max(initial=0.0))
                                       + float(self.ctx.compute_s.max(initial=0.0)) * max(len(c[1]) for c in calls))
        deadline = time.monotonic() + self.cfg.call_timeout_s + (0.0 if self.clock.virtual else slack)
        failed = []
        for n, mine, fut, sent_bytes in calls:
            counts["calls"] += 1
            try:
                reply: ExpertReply = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
            except Exception:  # noqa: BLE001 - actor died, unavailable, or timed out: all mean "not now"
                counts["failed_calls"] += 1
                self.membership.exclude(n, why=f"an expert call of layer {layer} failed")
                failed.append(mine)
                continue
            r, k = mine[:, 0], mine[:, 1]
            out[r, k] = decode(reply.out, self.cfg.wire).to(out.device)
            trip = self.links.legs_s(meet[r], st.home[r]) if last else np.zeros(len(r))
            done[r, k] = reply.end + (reply.back_s + trip)  # the simulator's finish + back, in its order
            counts["link_bytes"] += reply.bytes_in + reply.bytes_out
            counts["emulated_s"] += reply.inbound_s + reply.outbound_s
            if n != self.node:
                counts["process_bytes"] += sent_bytes + reply.out.nbytes
            p.busy[n] += float((reply.end - reply.start).sum())
            p.events.append(np.column_stack([np.full(len(r), p.index), np.full(len(r), layer), np.full(len(r), n), r, k,
                                             np.full(len(r), sent), reply.arrival, reply.start, reply.end, done[r, k]]))
            if np.isfinite(reply.free_at):
                self.policies.busy_until(n, reply.free_at)
        return failed
