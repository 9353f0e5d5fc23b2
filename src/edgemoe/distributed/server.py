"""What one edge server does, independent of Ray: serve its experts, and (on a home) run requests.

`ServerCore` holds only the experts its placement row names, read by key from the checkpoint, and
answers `ExpertCall`s with the emulated link delays applied on the way in and out.
`HomeEngine` holds the dense backbone (the HF model with every sparse block's experts module replaced
by a `RemoteExperts` stub) and runs passes over it. At each MoE layer it runs the router (the model's own),
asks its policies where each slot runs (`HomePolicies`, edgemoe.distributed.home_policy), hands the slots
to `SlotDispatch` (edgemoe.distributed.dispatch: one call per destination server, replies gathered,
failures repaired), and combines the outputs with the gates (dropped slots renormalised as the local
backend does). Requests run one by one (`generate`) are checked and kept by a `RequestLedger`
(edgemoe.distributed.ledger); streams are batched by edgemoe.distributed.batching. The KV cache of a
request never leaves its home. `Transport` is how calls reach other servers: Ray actors in
`edgemoe.distributed.serve`, plain objects in threads for the in-process tests.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError

from .dispatch import COUNT_KEYS, Pass, SlotDispatch
from .health import Backoff, Membership
from .home_policy import HomePolicies
from .ledger import RequestLedger
from .links import Clock, LinkTable, VirtualAccelerator
from .repair import repair_slots
from .weights import ExpertWeights
from .wire import ExpertCall, ExpertReply, GenerateRequest, GenerateResult, decode, encode, row_bytes


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server needs; the same object goes to every server (each reads its own row)."""

    ctx: object  # edgemoe.runtime.RuntimeContext
    model_path: str
    policy: str = "exact"
    policy_params: tuple = ()  # ((key, value), ...) so the config stays hashable
    links_enabled: bool = True  # emulate the cluster's links and nominal hardware (off on a real cluster)
    wire: str = "bf16"
    call_timeout_s: float = 5.0  # wall seconds a call may take beyond its emulated duration
    max_attempts: int = 3
    backoff_base_s: float = 0.25
    backoff_max_s: float = 4.0
    version: int = 0
    clock: str = "real"  # "real" (deadlines on the monotonic clock) or "virtual" (pure arithmetic, no waits)
    dilation: float = 1.0  # every emulated delay lasts this many times longer in wall time (real clock)
    use_load: bool = True  # policies see node backlogs estimated from replies (the simulator gives backlogs)
    namespace: str = "edgemoe"  # the deployment's Ray namespace (its actors' names live there; Deployment.launch sets it)
    dtype: str = "float32"  # what experts and backbone are held and computed in: float32, bfloat16, float16, or
    # "checkpoint" (the checkpoint's own dtype: the bytes the planner charged a server)
    device: str = "cpu"  # the torch device of experts and backbone (cuda, cuda:1, ...)

    @property
    def params(self) -> dict:
        return dict(self.policy_params)

    def home_nodes(self) -> np.ndarray:
        """[N] bool: nodes that are some user's home (they load the dense backbone)."""
        homes = np.zeros(self.ctx.num_nodes, bool)
        homes[np.asarray(self.ctx.user_home)] = True
        return homes

    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype ("checkpoint": the config's torch_dtype / dtype, float32 when it names none)."""
        return resolve_dtype(self.dtype, self.model_path)

    def make_clock(self) -> Clock:
        return Clock(self.clock, self.dilation)

    def links(self, hidden_size: int) -> LinkTable:
        return LinkTable.from_context(self.ctx, row_bytes(hidden_size, self.wire), self.links_enabled)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, model_path: str) -> torch.dtype:
    """A dtype name (DTYPES, or "checkpoint": the one the checkpoint's config.json names) -> torch dtype."""
    if name == "checkpoint":
        from edgemoe.io import read_json

        config = read_json(Path(model_path) / "config.json", "model config")
        name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if name not in DTYPES:
        raise EdgeMoEError(f"dtype {name!r}: expected one of {', '.join(DTYPES)} or checkpoint")
    return DTYPES[name]


def process_rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ServerCore:
    """Serves the experts `ctx.hosts[node]` of node `node`, emulating its links and nominal hardware.

    A call's rows arrive `sent + inbound leg`; each waits for its arrival, then queues on the node's FIFO
    `VirtualAccelerator` for the roofline time of the node's nominal hardware (the simulator's cost); the
    reply says when each row started and ended and how long its outbound leg is. The host CPU computes the
    outputs meanwhile; it sets no clock. With links off (a real cluster) the times are the real ones."""

    def __init__(self, node: int, model_path: str, ctx, links: LinkTable, clock: Clock | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.node = int(node)
        self.ctx = ctx
        self.device = torch.device(device)
        pairs = [tuple(p) for p in np.argwhere(np.asarray(ctx.hosts[self.node], bool))]
        self.weights = ExpertWeights.load(model_path, pairs, dtype, self.device)
        self.links = links
        self.clock = clock or Clock()
        self.accelerator = VirtualAccelerator()

    def service_s(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """[R] nominal seconds of each row: rows for the same expert share one batched roofline call."""
        _, inverse, counts = np.unique(experts, return_inverse=True, return_counts=True)
        count = counts[inverse.ravel()]
        return self.ctx.call_s(np.full(len(experts), self.node), np.full(len(experts), layer), experts, count) / count

    def run_experts(self, call: ExpertCall) -> ExpertReply:
        R = len(call.experts)
        here = np.full(R, self.node)
        sent = self.clock.now() if np.isnan(call.sent) else float(call.sent)
        inbound = self.links.legs_s(call.src, here)
        arrival = sent + inbound
        start, end = np.empty(R), np.empty(R)
        free_at = float("nan")
        if self.links.enabled:
            order = np.argsort(arrival, kind="stable")  # FIFO: arrival order, then the call's (row, slot) order
            service = self.service_s(call.layer, call.experts)
            for a in np.unique(arrival):
                idx = order[arrival[order] == a]
                self.clock.wait_until(a)  # the rows are here: only now may they join the queue
                start[idx], end[idx], free_at = self.accelerator.serve(arrival[idx], service[idx])
        x = decode(call.hidden, call.wire).to(self.device)
        t0 = time.perf_counter()
        out = torch.empty_like(x)
        for e in np.unique(call.experts):  # one batched call per expert, as the simulator charges
            rows = torch.from_numpy(np.flatnonzero(call.experts == e))
            out[rows] = self.weights.forward(call.layer, int(e), x[rows])
        compute_s = time.perf_counter() - t0
        if not self.links.enabled:  # real hardware: the real times
            start[:] = sent
            end[:] = self.clock.now()
            free_at = float(end[0]) if R else free_at
        back = self.links.legs_s(here, call.dst)
        return ExpertReply(encode(out, call.wire), self.node, float(inbound.max(initial=0.0)), float(back.max(initial=0.0)),
                           self.links.bytes_moved(call.src, here), self.links.bytes_moved(here, call.dst), compute_s,
                           arrival, start, end, back, free_at)

    def memory(self) -> dict:
        return {"node": self.node, "experts": len(self.weights.tensors), "expert_bytes": self.weights.nbytes(),
                "rss_bytes": process_rss_bytes()}


class Transport:
    """submit(node, call) -> Future[ExpertReply]; any exception from the future means the call failed."""

    def submit(self, node: int, call: ExpertCall) -> Future:
        raise NotImplementedError


class LocalTransport(Transport):
    """Servers as plain objects called from threads (tests; the `in-process` rows of the benchmark)."""

    def __init__(self, servers: dict[int, ServerCore], threads: int = 16):
        self.servers = servers
        self.pool = ThreadPoolExecutor(threads)

    def submit(self, node, call):
        server = self.servers.get(node)
        if server is None:
            f: Future = Future()
            f.set_exception(ConnectionError(f"node {node} is down"))
            return f
        return self.pool.submit(server.run_experts, call)


class RemoteExperts(torch.nn.Module):
    """Stands in for a sparse block's experts module: `forward(hidden, index, weights)` dispatches."""

    def __init__(self, engine: HomeEngine, layer: int):
        super().__init__()
        self.engine, self.layer = engine, layer

    def forward(self, hidden, index, weights):
        return self.engine.moe_layer(self.layer, hidden, index, weights)


class HomeEngine:
    """The dense backbone of node `node` and the passes over it: one MoE layer's step (`moe_layer`: the
    dense part's emulated time, the decision, the fan-out, the combination), a request's passes (`generate`),
    a batch of streams' pass (`forward_batch`).

    Passes of different requests run concurrently (one thread each), as the simulator runs them; each pass
    carries its own nominal clock (`Pass.t`): a layer's calls are stamped with the layer's start, and the
    layer ends at the latest time any of its outputs is ready at the meeting node (links.py)."""

    def __init__(self, cfg: ServerConfig, node: int, transport: Transport, membership: Membership | None = None,
                 finished_cache: int = 512, adapter=None):
        """finished_cache: results kept for a retried request id (RequestLedger; each holds its per-job event
        arrays); adapter: the backbone of a previous engine on the same model (a reconfiguration keeps it)."""
        from edgemoe.models import load_moe

        self.cfg, self.node, self.transport = cfg, int(node), transport
        self.ctx = cfg.ctx
        self.clock = cfg.make_clock()
        self.membership = membership or Membership(self.ctx.num_nodes, Backoff(cfg.backoff_base_s, cfg.backoff_max_s),
                                                   self.ctx.node_names, f"home {self.ctx.node_names[self.node]}")
        # The backbone: the HF model with its experts modules dropped (their weights are freed; the
        # peak while loading still holds them once, see docs/distributed.md).
        if adapter is None:
            adapter = load_moe(cfg.model_path, cfg.torch_dtype())
            adapter.remove_hooks()
            adapter.model.to(cfg.device)
        self.adapter = adapter
        if self.adapter.num_layers != self.ctx.num_layers or self.adapter.num_experts != self.ctx.num_experts:
            raise EdgeMoEError(f"model {cfg.model_path} has L={self.adapter.num_layers}, E={self.adapter.num_experts}; "
                               f"the deployment's profile has L={self.ctx.num_layers}, E={self.ctx.num_experts}")
        for layer, block in enumerate(self.adapter.blocks):
            block.experts = RemoteExperts(self, layer)
        self.backbone_bytes = sum(p.numel() * p.element_size() for p in self.adapter.model.parameters())
        self.hidden_size = self.adapter.hidden_size
        self.links = cfg.links(self.hidden_size)
        # The dense part's nominal hardware (docs/runtime.md, "Dense part"): this home's backbone runs one layer
        # of one pass at a time (FIFO), each for ctx.dense_s(home, rows) seconds, before the layer's expert calls.
        self.backbone = VirtualAccelerator()
        self.emulate_dense = bool(self.links.enabled and self.ctx.dense_on)
        self._local = threading.local()  # the pass this thread is running
        self.policies = HomePolicies(cfg, self.membership)
        self.dispatch = SlotDispatch(self.node, cfg, transport, self.membership, self.links, self.clock, self.policies)
        self.requests = RequestLedger(finished_cache)

    def retime(self, cfg: ServerConfig) -> None:
        """Take cfg's clock (mode, dilation) and load setting; the emulated backbone queue starts empty."""
        self.cfg, self.clock = cfg, cfg.make_clock()
        self.policies.retime(cfg)
        self.dispatch.retime(cfg, self.clock)
        self.backbone.reset()

    # ---- one MoE layer ------------------------------------------------------------------------
    def moe_layer(self, layer: int, hidden: torch.Tensor, index, weights) -> torch.Tensor:
        from edgemoe.models.base import Intervention, LayerCall, apply_intervention

        p = self._local.current
        topk_t, gates_t = self.adapter._to_canonical(index, weights)
        topk = topk_t.cpu().numpy().astype(np.int64)
        gates = gates_t.float().cpu().numpy().astype(np.float64)
        _, alive = self.policies.get()
        st = p.state
        stranded = ~alive[st.location]  # the token's (emulated) node left: its state is at home anyway
        st.location[stranded] = st.home[stranded]
        ready = self._dense(layer, len(topk), p)  # the layer's dense work, then the router's slots may leave
        dec = self.policies.decide(layer, topk, gates, st, p.groups, self.policies.load_s(ready))
        p.estimate_s += float(dec.latency_s.max(initial=0.0))
        p.spent += float(dec.quality_cost.sum())
        experts, node, fixed = repair_slots(self.ctx, layer, dec.experts, dec.node, dec.location, st.user, alive)
        self.dispatch.degraded(layer, dec.experts, experts, p)
        meet = np.where(alive[dec.next_location], dec.next_location, dec.location)
        sent = self.clock.stamp(ready)  # the calls leave now: their deadline, or later if the host ran late
        p.late_s += sent - ready
        out, experts, node, meet, done = self.dispatch.run(layer, hidden, experts, node, dec.location, meet, st, p, sent)
        st.location[:] = meet
        # The layer ends when its slowest output has reached the meeting node (and, after the last layer, the
        # token is home again for the LM head, as in the simulator); rows without a job end at their floor.
        trip = self.links.legs_s(meet, st.home) if layer == self.ctx.num_layers - 1 else np.zeros(len(meet))
        end = max(sent, float((sent + trip).max(initial=sent)), float(np.nanmax(done, initial=-np.inf)))
        if layer == self.ctx.num_layers - 1:
            p.counts["emulated_s"] += float(trip.max(initial=0.0))
            p.counts["link_bytes"] += self.links.bytes_moved(meet, st.home)
        self.clock.wait_until(end)
        p.t = end
        final = replace(dec, experts=experts, node=node, next_location=meet)
        p.tally.add(final, topk, layer, st.home, p.prefill)
        p.counts["repaired"] += fixed
        if p.observer is not None:
            p.observer(layer, topk, final)
        p.topk.append(topk)
        p.gates.append(gates)
        call = LayerCall(layer, hidden, None, topk_t, gates_t)
        # Zeroed slots keep the other gates as they are (a drop renormalises them), as in the local backend;
        # repair never touches them (it only re-routes slots that ran), so the policy's mask still holds.
        _, new_gates = apply_intervention(self.adapter, call, Intervention.from_numpy(experts, dec.zeroed))
        return (new_gates.to(out.dtype)[..., None] * out).sum(dim=1).to(hidden.dtype)

    def _dense(self, layer: int, rows: int, p: Pass) -> float:
        """Queue this layer's dense work (attention, norms, router: `ctx.dense_s` of `rows` rows on this home's
        hardware) on the home's backbone FIFO from the layer's start; returns when it ends, the earliest the
        layer's expert calls may leave (the layer's start when the dense part is not emulated). The host's real
        attention and router ran just before this call, inside the dense work's nominal time: they set no clock
        (the work is queued from the layer's deadline, not from when the host got here); only what the host
        still has to do after the dense work's end counts as lateness (at the calls' send, `moe_layer`)."""
        if not self.emulate_dense:
            return p.t
        service = float(self.ctx.dense_s(self.node, rows))
        start, end, _ = self.backbone.serve(np.array([p.t]), np.array([service]))
        p.dense_events.append((p.index, layer, self.node, p.t, float(start[0]), float(end[0])))
        p.estimate_s += service  # the policy prices experts only; the feedback's estimate includes the dense part
        return float(end[0])

    # ---- requests -----------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, cache, user: int, index: int, t: float, counts: dict, tally, rec,
                 busy: np.ndarray, events: list, dense_events: list, strict: bool = False) -> tuple[int, float, float, float]:
        """One pass over ids [1, S] due at nominal time t -> (greedy next token, begin, end, end - host lateness).

        Host lateness: the time by which the layers' starts and the pass's end missed their deadlines (the
        host's CPU work ran past them); with none, end is exactly the emulated end."""
        policy, _ = self.policies.get()
        rows = ids.shape[1]
        state = policy.start(np.full(rows, user))
        state.home[:] = self.node  # the row lives here, even when this home stands in for another
        state.location[:] = self.node
        begin = self.clock.stamp(t)
        p = Pass(state, index == 0, counts, [], [], tally, begin, index, events, dense_events, busy, strict=strict)
        self._local.current = p
        try:
            logits = self.adapter.model(input_ids=ids, cache=cache, use_cache=True).logits
        finally:
            self._local.current = None
        rec[0].append(np.stack(p.topk, 1))
        rec[1].append(np.stack(p.gates, 1))
        end = self.clock.stamp(p.t)
        p.late_s += end - p.t
        if getattr(policy, "wants_feedback", False):
            # As the simulator does: the user's observed pass latency and spent budget
            # go back to the policy, which adapts that user's latency/quality weights.
            policy.observe(np.array([user]), np.array([end - begin]), np.array([p.estimate_s]), np.array([p.spent]),
                           np.array([float(state.budget_total.sum())]))
        return int(logits[0, -1].argmax()), begin, end, end - p.late_s

    @torch.no_grad()
    def forward_batch(self, ids: torch.Tensor, cache, users: np.ndarray, strict: np.ndarray, observer,
                      attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                      allowance: np.ndarray | None = None, exact: np.ndarray | None = None):
        """One pass of several sequences at once (edgemoe.distributed.batching): ids [B, S] (a prefill is
        B = 1; a decode step S = 1), users [B] and strict [B] per sequence, observer(layer, topk, final) per MoE
        layer (rows in batch-major order, B x S). Every MoE layer's slots bound for one server leave as one
        call, whichever sequence they belong to. allowance: [B] each sequence's quality allowance per
        token-layer (`HomePolicies.allowances`; None: the policy's own); exact: [B] bool, sequences the exact policy decides
        (None: none). Returns (logits [B, V] at each sequence's last position, degraded slots per row [B x S]).
        Real clock only; the policy's adaptive feedback is not fed (one request's latency must not change
        another's text, as in the in-process engine)."""
        if self.clock.virtual:
            raise EdgeMoEError("batched serving runs on the real clock (the virtual clock needs request-by-request "
                               "arrivals: HomeEngine.generate)")
        policy, _ = self.policies.get()
        B, S = ids.shape
        state = policy.start(np.repeat(np.asarray(users, np.int64), S))
        state.home[:] = self.node
        state.location[:] = self.node
        from edgemoe.runtime.metrics import DecisionTally

        counts = dict.fromkeys(COUNT_KEYS, 0)
        tally = DecisionTally(self.ctx.num_layers, row_bytes(self.hidden_size, self.cfg.wire))
        begin = self.clock.stamp(self.clock.now())
        dev = self.cfg.device
        ids = ids.to(dev)
        attention_mask = None if attention_mask is None else attention_mask.to(dev)
        position_ids = None if position_ids is None else position_ids.to(dev)
        p = Pass(state, S > 1, counts, [], [], tally, begin, 0 if S > 1 else 1, [], [], np.zeros(self.ctx.num_nodes),
                  strict=np.repeat(np.asarray(strict, bool), S), observer=observer,
                  row_degraded=np.zeros(B * S, np.int64), groups=self.policies.row_groups(self.node, state, S, allowance, exact))
        self._local.current = p
        try:
            out = self.adapter.model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                                     cache=cache, use_cache=True)
        finally:
            self._local.current = None
        return out.logits[:, -1], p.row_degraded

    @torch.no_grad()
    def generate(self, req: GenerateRequest) -> GenerateResult:
        """Greedy generation for one request; a request id seen before is answered from the cache."""
        done = self.requests.replay(req.request_id)
        if done is not None:
            return done
        submit = self.requests.check(req, self.ctx.num_users, self.clock.virtual)
        arrival = self.clock.now() if np.isnan(submit) else submit
        with self.requests.running():
            return self._generate(req, arrival)

    def _generate(self, req: GenerateRequest, arrival: float) -> GenerateResult:
        from transformers import DynamicCache

        from edgemoe.runtime.metrics import DecisionTally

        counts = dict.fromkeys(COUNT_KEYS, 0)
        tally = DecisionTally(self.ctx.num_layers, row_bytes(self.hidden_size, self.cfg.wire))
        rec: tuple[list, list] = ([], [])
        busy, events, dense_events = np.zeros(self.ctx.num_nodes), [], []
        cache = DynamicCache(config=self.adapter.model.config)
        ids = torch.as_tensor(np.asarray(req.prompt, np.int64))[None].to(self.cfg.device)
        tokens, begin, end, emulated = [], [], [], []
        t = arrival
        # Exact execution never silently degrades: with the exact policy, a slot that a failure would drop or
        # substitute fails the request (Degraded) unless the request allows it.
        strict = self.cfg.policy == "exact" and not req.allow_degraded
        for i in range(req.gen_tokens):
            token, b, e, d = self._forward(ids, cache, req.user, i, t, counts, tally, rec, busy, events, dense_events,
                                           strict)
            tokens.append(token)
            begin.append(b)
            end.append(e)
            emulated.append(d)
            ids, t = torch.tensor([[token]], device=self.cfg.device), e  # the next pass starts when this one ends
        begin_a, end_a = np.asarray(begin), np.asarray(end)
        counts.update(slots=tally.slots, remote=tally.remote, substituted=tally.substituted, dropped=tally.dropped,
                      predicted_bytes=tally.prefill_bytes + tally.decode_bytes, quality_cost=tally.quality_cost)
        result = GenerateResult(
            req.request_id, req.user, np.asarray(tokens, np.int64), self.node, float(begin_a[0] - arrival),
            float(end_a[0] - begin_a[0]), end_a[1:] - begin_a[1:], counts, np.concatenate(rec[0]), np.concatenate(rec[1]),
            arrival_s=arrival, pass_begin_s=begin_a, pass_end_s=end_a, pass_deadline_s=np.asarray(emulated),
            events=np.concatenate(events) if events else np.zeros((0, 10)), node_busy_s=busy,
            dense_events=np.array(dense_events, float).reshape(-1, 6))
        return self.requests.record(result)
