"""One MoE layer of a pass on a home: the dense part's emulated time, the decision, the fan-out, the combination.

A home's backbone runs the HF model with every sparse block's experts module replaced by a stub
(edgemoe.distributed.server.RemoteExperts); at each block the stub hands the router's output to `LayerStep`,
which
1. queues the layer's dense work on the home's emulated backbone (`dense`): the calls may leave at its end;
2. asks the home's policies where each slot runs (edgemoe.distributed.home_policy), then repairs the slots whose
   server is down (edgemoe.distributed.repair);
3. sends the slots, one call per destination server, and gathers the replies (edgemoe.distributed.dispatch);
4. waits until the layer's slowest output has reached its meeting node (the layer's nominal end);
5. records the executed decision in the pass's book-keeping (`Pass`) and combines the outputs with the gates
   (dropped slots renormalised, zeroed ones not, as the local backend does).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from .links import VirtualAccelerator
from .repair import repair_slots


class LayerStep:
    """The per-layer remote-expert call of home `node` (steps 1-5 above), one call per MoE layer of a pass.

    ctx: the RuntimeContext; adapter: the backbone's MoEAdapter (the router's canonical form, interventions);
    links: the home's LinkTable; clock: its Clock; policies: its HomePolicies; dispatch: its SlotDispatch;
    decision_cost: a DecisionCost charging the policy's decision after the dense work, in the same backbone
    stage (`ServerConfig.decision_cost`; None: not charged). Where nominal time is emulated (links on), each
    layer's backbone stage runs when the context charges a dense part or the decision is charged, as the
    simulator's `pass_stage_s` has it."""

    def __init__(self, ctx, node: int, adapter, links, clock, policies, dispatch, decision_cost=None):
        self.ctx, self.node, self.adapter, self.links, self.clock = ctx, int(node), adapter, links, clock
        self.policies, self.dispatch = policies, dispatch
        self.decision_cost = decision_cost if links.enabled else None
        self.emulate_dense = links.enabled and (ctx.dense_on or self.decision_cost is not None)
        # The dense part's nominal hardware (docs/runtime.md, "Dense part"): this home's backbone runs one layer
        # of one pass at a time (FIFO), each for ctx.dense_s(home, rows) seconds, before the layer's expert calls.
        self.backbone = VirtualAccelerator()

    def retime(self, clock) -> None:
        """A new clock: the emulated backbone queue starts empty."""
        self.clock = clock
        self.backbone.reset()

    def __call__(self, p, layer: int, hidden: torch.Tensor, index, weights) -> torch.Tensor:
        """The layer's output [T, H] for the pass `p` (dispatch.Pass) from the block's hidden states [T, H] and
        its router's choice (index, weights in the model's own form)."""
        topk_t, gates_t = self.adapter._to_canonical(index, weights)
        topk = topk_t.cpu().numpy().astype(np.int64)
        gates = gates_t.float().cpu().numpy().astype(np.float64)
        dec, alive, ready = self.decide(p, layer, topk, gates)
        out, final, fixed = self.execute(p, layer, hidden, dec, alive, ready)
        self.record(p, layer, topk, gates, final, fixed)
        return self.combine(layer, hidden, out, topk_t, gates_t, final.experts, dec.zeroed)

    def decide(self, p, layer: int, topk: np.ndarray, gates: np.ndarray):
        """Steps 1-2a: the policy's Decision for the rows topk, gates [T, K] after the layer's dense work; returns
        (decision, alive [N] of the membership it was made on, nominal time the calls may leave)."""
        _, alive = self.policies.get()
        st = p.state
        stranded = ~alive[st.location]  # the token's (emulated) node left: its state is at home anyway
        st.location[stranded] = st.home[stranded]
        ready = self.dense(layer, len(topk), p)  # the layer's dense work, then the router's slots may leave
        dec = self.policies.decide(layer, topk, gates, st, p.groups, self.policies.load_s(ready))
        p.estimate_s += float(dec.latency_s.max(initial=0.0))
        p.spent += float(dec.quality_cost.sum())
        return dec, alive, ready

    def execute(self, p, layer: int, hidden: torch.Tensor, dec, alive: np.ndarray, ready: float):
        """Steps 2b-4: repair, send, gather, wait for the layer's end. Returns (outputs [T, K, H] of gate 1, the
        decision as executed, slots repaired before sending)."""
        st = p.state
        experts, node, fixed = repair_slots(self.ctx, layer, dec.experts, dec.node, dec.location, st.user, alive)
        self.dispatch.degraded(layer, dec.experts, experts, p)
        meet = np.where(alive[dec.next_location], dec.next_location, dec.location)
        sent = self.clock.stamp(ready)  # the calls leave now: their deadline, or later if the host ran late
        p.late_s += sent - ready
        out, experts, node, meet, done = self.dispatch.run(layer, hidden, experts, node, dec.location, meet, st, p, sent)
        st.location[:] = meet
        end = self.layer_end(p, layer, sent, meet, done)
        self.clock.wait_until(end)
        p.t = end
        return out, replace(dec, experts=experts, node=node, next_location=meet), fixed

    def layer_end(self, p, layer: int, sent: float, meet: np.ndarray, done: np.ndarray) -> float:
        """Nominal end of the layer: when its slowest output has reached the meeting node (and, after the last
        layer, the token is home again for the LM head, as in the simulator); rows without a job end at their
        floor, the send time. done: [T, K] each slot's ready time (nan: nothing ran)."""
        last = layer == self.ctx.num_layers - 1
        st = p.state
        trip = self.links.legs_s(meet, st.home) if last else np.zeros(len(meet))
        end = max(sent, float((sent + trip).max(initial=sent)), float(np.nanmax(done, initial=-np.inf)))
        if last:
            p.counts["emulated_s"] += float(trip.max(initial=0.0))
            p.counts["link_bytes"] += self.links.bytes_moved(meet, st.home)
        return end

    @staticmethod
    def record(p, layer: int, topk: np.ndarray, gates: np.ndarray, final, fixed: int) -> None:
        """Step 5a: the executed decision into the pass's tally, counts, observer and routing record."""
        p.tally.add(final, topk, layer, p.state.home, p.prefill)
        p.counts["repaired"] += fixed
        if p.observer is not None:
            p.observer(layer, topk, final)
        p.topk.append(topk)
        p.gates.append(gates)

    def combine(self, layer: int, hidden, out, topk_t, gates_t, experts: np.ndarray, zeroed) -> torch.Tensor:
        """Step 5b: the gate-weighted sum [T, H] of the slots' outputs out [T, K, H]. Zeroed slots keep the other
        gates as they are (a drop renormalises them), as in the local backend; repair never touches them (it only
        re-routes slots that ran), so the policy's mask still holds."""
        from edgemoe.models.base import Intervention, LayerCall, apply_intervention

        call = LayerCall(layer, hidden, None, topk_t, gates_t)
        _, new_gates = apply_intervention(self.adapter, call, Intervention.from_numpy(experts, zeroed))
        return (new_gates.to(out.dtype)[..., None] * out).sum(dim=1).to(hidden.dtype)

    def dense(self, layer: int, rows: int, p) -> float:
        """Queue this layer's dense work (attention, norms, router: `ctx.dense_s` of `rows` rows on this home's
        hardware) on the home's backbone FIFO from the layer's start; returns when it ends, the earliest the
        layer's expert calls may leave (the layer's start when the dense part is not emulated). The host's real
        attention and router ran just before this call, inside the dense work's nominal time: they set no clock
        (the work is queued from the layer's deadline, not from when the host got here); only what the host
        still has to do after the dense work's end counts as lateness (at the calls' send, `execute`)."""
        if not self.emulate_dense:
            return p.t
        service = float(self.ctx.dense_s(self.node, rows))
        if self.decision_cost is not None:  # the decision follows the dense work in the same stage (`pass_stage_s`)
            service = service + float(self.decision_cost.seconds(rows))
        start, end, _ = self.backbone.serve(np.array([p.t]), np.array([service]))
        p.dense_events.append((p.index, layer, self.node, p.t, float(start[0]), float(end[0])))
        p.estimate_s += service  # the policy prices experts only; the feedback's estimate includes the dense part
        return float(end[0])
