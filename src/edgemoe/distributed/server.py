"""What one edge server does, independent of Ray: serve its experts, and (on a home) run requests.

`ServerCore` holds only the experts its placement row names, read by key from the checkpoint, and
answers `ExpertCall`s with the emulated link delays applied on the way in and out.
`HomeEngine` holds the dense backbone (the HF model with every sparse block's experts module replaced
by a `RemoteExperts` stub) and runs passes over it. At each MoE layer the stub hands the router's choice (the
model's own) to the home's `LayerStep` (edgemoe.distributed.layer_step), which asks its policies where each
slot runs (`HomePolicies`, edgemoe.distributed.home_policy), hands the slots to `SlotDispatch`
(edgemoe.distributed.dispatch: one call per destination server, replies gathered, failures repaired), and
combines the outputs with the gates (dropped slots renormalised as the local backend does). Requests run one
by one (`generate`) are checked and kept by a `RequestLedger` (edgemoe.distributed.ledger), their passes
collected by a `RequestRecord`; streams are batched by edgemoe.distributed.batching. The KV cache of a
request never leaves its home. `Transport` is how calls reach other servers: Ray actors in
`edgemoe.distributed.serve`, plain objects in threads for the in-process tests.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError

from .dispatch import COUNT_KEYS, Pass, SlotDispatch
from .health import Backoff, Membership
from .home_policy import HomePolicies
from .layer_step import LayerStep
from .ledger import RequestLedger
from .links import Clock, LinkTable, VirtualAccelerator
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
    # The policy's decision, charged as CPU time at the home after each layer's dense work, in the same stage of
    # its emulated backbone queue, as the simulator charges it (`edgemoe.runtime.decision_cost`: a DecisionCost,
    # or None: not charged, both backends' default). Only where nominal time is emulated (links on)
    decision_cost: object = None

    def __post_init__(self):
        from edgemoe.runtime.decision_cost import checked_cost

        # checked here, on the caller's side, so that a bad value stops the launch before any actor starts
        checked_cost(self.decision_cost, "ServerConfig")

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


# (engine, pass) of the pass each thread is running through a backbone (`HomeEngine._run`). One for the process,
# not one per engine: a reconfigured server builds a new HomeEngine on the same loaded backbone, whose stubs then
# belong to the new engine, while a pass of the old engine may still be running in another thread; each stub
# hands its layer to the engine of the pass in its own thread, so that pass finishes on its own engine.
_RUNNING = threading.local()


class RemoteExperts(torch.nn.Module):
    """Stands in for a sparse block's experts module: `forward(hidden, index, weights)` dispatches to the engine
    whose pass this thread is running (`_RUNNING`)."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def forward(self, hidden, index, weights):
        current = getattr(_RUNNING, "current", None)
        if current is None:
            raise EdgeMoEError(f"MoE layer {self.layer} ran outside a pass: a backbone with remote experts runs "
                               "only through HomeEngine (its stubs have no experts of their own)")
        engine, p = current
        return engine.step(p, self.layer, hidden, index, weights)


class HomeEngine:
    """The dense backbone of node `node` and the passes over it, in three parts: each MoE layer's remote-expert
    call (`LayerStep`, edgemoe.distributed.layer_step), reached through the backbone's `RemoteExperts` stubs; the
    passes (`forward_batch`: a batch of streams, edgemoe.distributed.batching; `_forward`: one pass of a request
    run alone); and the requests run one by one (`generate`: checks and kept answers in a `RequestLedger`, each
    request's passes collected by a `RequestRecord`).

    Passes of different requests run concurrently (one thread each), as the simulator runs them; each pass
    carries its own nominal clock (`Pass.t`): a layer's calls are stamped with the layer's start, and the
    layer ends at the latest time any of its outputs is ready at the meeting node (links.py)."""

    def __init__(self, cfg: ServerConfig, node: int, transport: Transport, membership: Membership | None = None,
                 finished_cache: int = 512, adapter=None):
        """finished_cache: results kept for a retried request id (RequestLedger; each holds its per-job event
        arrays); adapter: the backbone of a previous engine on the same model (a reconfiguration keeps it)."""
        self.cfg, self.node, self.transport = cfg, int(node), transport
        self.ctx = cfg.ctx
        self.clock = cfg.make_clock()
        self.membership = membership or Membership(self.ctx.num_nodes, Backoff(cfg.backoff_base_s, cfg.backoff_max_s),
                                                   self.ctx.node_names, f"home {self.ctx.node_names[self.node]}")
        self.adapter = self._backbone(adapter)
        self.backbone_bytes = sum(p.numel() * p.element_size() for p in self.adapter.model.parameters())
        self.hidden_size = self.adapter.hidden_size
        self.links = cfg.links(self.hidden_size)
        self.policies = HomePolicies(cfg, self.membership)
        self.dispatch = SlotDispatch(self.node, cfg, transport, self.membership, self.links, self.clock, self.policies)
        self.step = LayerStep(self.ctx, self.node, self.adapter, self.links, self.clock, self.policies, self.dispatch,
                              cfg.decision_cost)
        self.requests = RequestLedger(finished_cache)

    def _backbone(self, adapter):
        """The HF model with its experts modules replaced by RemoteExperts stubs (their weights are freed; the
        peak while loading still holds them once, see docs/distributed.md); `adapter`: a loaded one to reuse."""
        from edgemoe.models import load_moe

        cfg = self.cfg
        if adapter is None:
            adapter = load_moe(cfg.model_path, cfg.torch_dtype())
            adapter.remove_hooks()
            adapter.model.to(cfg.device)
        if adapter.num_layers != self.ctx.num_layers or adapter.num_experts != self.ctx.num_experts:
            raise EdgeMoEError(f"model {cfg.model_path} has L={adapter.num_layers}, E={adapter.num_experts}; "
                               f"the deployment's profile has L={self.ctx.num_layers}, E={self.ctx.num_experts}")
        for layer, block in enumerate(adapter.blocks):
            block.experts = RemoteExperts(layer)
        return adapter

    def retime(self, cfg: ServerConfig) -> None:
        """Take cfg's clock (mode, dilation) and load setting; the emulated backbone queue starts empty."""
        self.cfg, self.clock = cfg, cfg.make_clock()
        self.policies.retime(cfg)
        self.dispatch.retime(cfg, self.clock)
        self.step.retime(self.clock)

    def _run(self, p: Pass, **model_inputs):
        """The backbone's forward over model_inputs with `p` as this thread's pass on this engine (`_RUNNING`, which
        the stubs read)."""
        outer = getattr(_RUNNING, "current", None)
        _RUNNING.current = (self, p)
        try:
            return self.adapter.model(use_cache=True, **model_inputs)
        finally:
            _RUNNING.current = outer

    # ---- passes -------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, cache, user: int, index: int, t: float, record: RequestRecord,
                 strict: bool = False) -> tuple[int, float, float, float]:
        """One pass of a request run alone over ids [1, S] due at nominal time t, its book-keeping into `record`
        -> (greedy next token, begin, end, end - host lateness).

        Host lateness: the time by which the layers' starts and the pass's end missed their deadlines (the
        host's CPU work ran past them); with none, end is exactly the emulated end."""
        policy, _ = self.policies.get()
        rows = ids.shape[1]
        state = policy.start(np.full(rows, user))
        state.home[:] = self.node  # the row lives here, even when this home stands in for another
        state.location[:] = self.node
        begin = self.clock.stamp(t)
        p = Pass(state, index == 0, record.counts, [], [], record.tally, begin, index, record.events,
                 record.dense_events, record.busy, strict=strict)
        logits = self._run(p, input_ids=ids, cache=cache).logits
        record.routing(p)
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
        call, whichever sequence they belong to. allowance: [B x S] each row's quality allowance per
        token-layer (`HomePolicies.row_allowances`; None: the policy's own); exact: [B] bool, sequences the exact policy decides
        (None: none). Returns (logits [B, V] at each sequence's last position, degraded slots per row [B x S]).
        Real clock only; the policy's adaptive feedback is not fed (one request's latency must not change
        another's text, as in the in-process engine)."""
        if self.clock.virtual:
            raise EdgeMoEError("batched serving runs on the real clock (the virtual clock needs request-by-request "
                               "arrivals: HomeEngine.generate)")
        from edgemoe.runtime.metrics import DecisionTally

        policy, _ = self.policies.get()
        B, S = ids.shape
        state = policy.start(np.repeat(np.asarray(users, np.int64), S))
        state.home[:] = self.node
        state.location[:] = self.node
        counts = dict.fromkeys(COUNT_KEYS, 0)
        tally = DecisionTally(self.ctx.num_layers, row_bytes(self.hidden_size, self.cfg.wire))
        begin = self.clock.stamp(self.clock.now())
        dev = self.cfg.device
        p = Pass(state, S > 1, counts, [], [], tally, begin, 0 if S > 1 else 1, [], [], np.zeros(self.ctx.num_nodes),
                 strict=np.repeat(np.asarray(strict, bool), S), observer=observer,
                 row_degraded=np.zeros(B * S, np.int64), groups=self.policies.row_groups(self.node, state, S, allowance, exact))
        out = self._run(p, input_ids=ids.to(dev), cache=cache,
                        attention_mask=None if attention_mask is None else attention_mask.to(dev),
                        position_ids=None if position_ids is None else position_ids.to(dev))
        return out.logits[:, -1], p.row_degraded

    # ---- requests run one by one --------------------------------------------------------------
    @torch.no_grad()
    def generate(self, req: GenerateRequest) -> GenerateResult:
        """Greedy generation for one request; a request id seen before is answered from the cache."""
        done = self.requests.replay(req.request_id)
        if done is not None:
            return done
        submit = self.requests.check(req, self.ctx.num_users, self.clock.virtual)
        arrival = self.clock.now() if np.isnan(submit) else submit
        with self.requests.running():
            return self.requests.record(self._generate(req, arrival))

    def _generate(self, req: GenerateRequest, arrival: float) -> GenerateResult:
        """req's gen_tokens greedy passes, each due when the previous one ended (the first at `arrival`)."""
        from transformers import DynamicCache

        record = RequestRecord(self.ctx, row_bytes(self.hidden_size, self.cfg.wire))
        cache = DynamicCache(config=self.adapter.model.config)
        ids = torch.as_tensor(np.asarray(req.prompt, np.int64))[None].to(self.cfg.device)
        t = arrival
        # Exact execution never silently degrades: with the exact policy, a slot that a failure would drop or
        # substitute fails the request (Degraded) unless the request allows it.
        strict = self.cfg.policy == "exact" and not req.allow_degraded
        for i in range(req.gen_tokens):
            token, b, e, d = self._forward(ids, cache, req.user, i, t, record, strict)
            record.passed(token, b, e, d)
            ids, t = torch.tensor([[token]], device=self.cfg.device), e  # the next pass starts when this one ends
        return record.result(req, self.node, arrival)


class RequestRecord:
    """What the passes of one request run alone leave behind (HomeEngine.generate): the counts and decision
    tally its passes fill, the router's topk and gates per pass, the expert jobs' and dense work's events, the
    emulated busy time per node, and per pass its token, begin, end and emulated end."""

    def __init__(self, ctx, wire_row_bytes: int):
        from edgemoe.runtime.metrics import DecisionTally

        self.counts = dict.fromkeys(COUNT_KEYS, 0)
        self.tally = DecisionTally(ctx.num_layers, wire_row_bytes)
        self.topk: list[np.ndarray] = []  # per pass [S, L, K]
        self.gates: list[np.ndarray] = []
        self.busy = np.zeros(ctx.num_nodes)
        self.events: list = []  # [J, 10] arrays per layer call (dispatch.Pass.events)
        self.dense_events: list = []
        self.tokens: list[int] = []
        self.begin: list[float] = []
        self.end: list[float] = []
        self.emulated: list[float] = []

    def routing(self, p: Pass) -> None:
        """The router's choice of a finished pass (its layers' topk and gates, stacked per row)."""
        self.topk.append(np.stack(p.topk, 1))
        self.gates.append(np.stack(p.gates, 1))

    def passed(self, token: int, begin: float, end: float, emulated: float) -> None:
        self.tokens.append(token)
        self.begin.append(begin)
        self.end.append(end)
        self.emulated.append(emulated)

    def result(self, req: GenerateRequest, node: int, arrival: float) -> GenerateResult:
        tally, counts = self.tally, self.counts
        begin, end = np.asarray(self.begin), np.asarray(self.end)
        counts.update(slots=tally.slots, remote=tally.remote, substituted=tally.substituted, dropped=tally.dropped,
                      predicted_bytes=tally.prefill_bytes + tally.decode_bytes, quality_cost=tally.quality_cost)
        return GenerateResult(
            req.request_id, req.user, np.asarray(self.tokens, np.int64), node, float(begin[0] - arrival),
            float(end[0] - begin[0]), end[1:] - begin[1:], counts, np.concatenate(self.topk), np.concatenate(self.gates),
            arrival_s=arrival, pass_begin_s=begin, pass_end_s=end, pass_deadline_s=np.asarray(self.emulated),
            events=np.concatenate(self.events) if self.events else np.zeros((0, 10)), node_busy_s=self.busy,
            dense_events=np.array(self.dense_events, float).reshape(-1, 6))
