"""What one edge server does, independent of Ray: serve its experts, and (on a home) run requests.

`ServerCore` holds only the experts its placement row names, read by key from the checkpoint, and
answers `ExpertCall`s with the emulated link delays applied on the way in and out.
`HomeEngine` holds the dense backbone (the HF model with every sparse block's experts module replaced
by a `RemoteExperts` stub). At each MoE layer it runs the router (the model's own), asks the runtime
policy where each slot runs, batches the rows per destination server, calls them in parallel, gathers,
and combines the outputs with the gates (dropped slots renormalised as the local backend does). The KV
cache of a request never leaves its home. `Transport` is how calls reach other servers: Ray actors in
`edgemoe.distributed.serve`, plain objects in threads for the in-process tests.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError

from .health import Backoff, Membership
from .links import LinkTable
from .repair import degraded_context, repair_slots
from .weights import ExpertWeights
from .wire import ExpertCall, ExpertReply, GenerateRequest, GenerateResult, decode, encode, row_bytes


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server needs; the same object goes to every server (each reads its own row)."""

    ctx: object  # edgemoe.runtime.RuntimeContext
    model_path: str
    policy: str = "exact"
    policy_params: tuple = ()  # ((key, value), ...) so the config stays hashable
    links_enabled: bool = True
    wire: str = "bf16"
    call_timeout_s: float = 5.0
    max_attempts: int = 3
    backoff_base_s: float = 0.25
    backoff_max_s: float = 4.0
    version: int = 0

    @property
    def params(self) -> dict:
        return dict(self.policy_params)

    def home_nodes(self) -> np.ndarray:
        """[N] bool: nodes that are some user's home (they load the dense backbone)."""
        homes = np.zeros(self.ctx.num_nodes, bool)
        homes[np.asarray(self.ctx.user_home)] = True
        return homes


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
    """Serves the experts `hosts [L, E]` of node `node` with emulated links."""

    def __init__(self, node: int, model_path: str, hosts: np.ndarray, links: LinkTable, hidden_size: int):
        self.node = int(node)
        pairs = [tuple(p) for p in np.argwhere(np.asarray(hosts, bool))]
        self.weights = ExpertWeights.load(model_path, pairs)
        self.links = links
        self.hidden_size = int(hidden_size)

    def run_experts(self, call: ExpertCall) -> ExpertReply:
        R = len(call.experts)
        here = np.full(R, self.node)
        nbytes = row_bytes(self.hidden_size, call.wire)
        inbound_s, bytes_in = self.links.hold(call.src, here, nbytes)  # the bytes arrive
        x = decode(call.hidden, call.wire)
        t0 = time.perf_counter()
        out = torch.empty_like(x)
        for e in np.unique(call.experts):  # one batched call per expert, as the simulator charges
            rows = torch.from_numpy(np.flatnonzero(call.experts == e))
            out[rows] = self.weights.forward(call.layer, int(e), x[rows])
        compute_s = time.perf_counter() - t0
        payload = encode(out, call.wire)
        outbound_s, bytes_out = self.links.hold(here, call.dst, nbytes)  # the answer leaves
        return ExpertReply(payload, self.node, inbound_s, outbound_s, bytes_in, bytes_out, compute_s)

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


@dataclass
class _Pass:
    """Book-keeping of the forward pass in progress on this home."""

    state: object  # TokenState
    prefill: bool
    counts: dict
    topk: list
    gates: list
    tally: object


COUNT_KEYS = ("slots", "remote", "substituted", "dropped", "repaired", "failed_calls", "calls", "link_bytes",
              "process_bytes", "emulated_s")


class HomeEngine:
    """The dense backbone of node `node` plus the dispatch of its users' expert slots."""

    def __init__(self, cfg: ServerConfig, node: int, transport: Transport, membership: Membership | None = None,
                 finished_cache: int = 4096):
        from edgemoe.models import load_moe

        self.cfg, self.node, self.transport = cfg, int(node), transport
        self.ctx = cfg.ctx
        self.links = LinkTable.from_context(self.ctx, cfg.links_enabled)
        self.membership = membership or Membership(self.ctx.num_nodes, Backoff(cfg.backoff_base_s, cfg.backoff_max_s))
        # The backbone: the HF model with its experts modules dropped (their weights are freed; the
        # peak while loading still holds them once, see docs/distributed.md).
        self.adapter = load_moe(cfg.model_path)
        self.adapter.remove_hooks()
        if self.adapter.num_layers != self.ctx.num_layers or self.adapter.num_experts != self.ctx.num_experts:
            raise EdgeMoEError(f"model {cfg.model_path} has L={self.adapter.num_layers}, E={self.adapter.num_experts}; "
                               f"the deployment's profile has L={self.ctx.num_layers}, E={self.ctx.num_experts}")
        for layer, block in enumerate(self.adapter.blocks):
            block.experts = RemoteExperts(self, layer)
        self.backbone_bytes = sum(p.numel() * p.element_size() for p in self.adapter.model.parameters())
        self.hidden_size = self.adapter.hidden_size
        self.lock = threading.Lock()  # one forward pass at a time on this home's backbone
        self._policies: dict[int, object] = {}
        self._current: _Pass | None = None
        self.finished: OrderedDict[str, GenerateResult] = OrderedDict()
        self.finished_cache = finished_cache
        self.served = 0

    # ---- policy per membership ----------------------------------------------------------------
    def policy(self):
        from edgemoe.runtime import make_policy

        alive, version = self.membership.snapshot()
        if version not in self._policies:
            ctx = self.ctx if alive.all() else degraded_context(self.ctx, alive)
            try:
                self._policies = {version: make_policy(self.cfg.policy, ctx, **self.cfg.params)}
            except EdgeMoEError:  # e.g. look-ahead tables on a context with holes: exact + repair instead
                self._policies = {version: make_policy("exact", ctx)}
        return self._policies[version], alive

    # ---- one MoE layer ------------------------------------------------------------------------
    def moe_layer(self, layer: int, hidden: torch.Tensor, index, weights) -> torch.Tensor:
        from edgemoe.models.base import Intervention, LayerCall, apply_intervention

        p = self._current
        topk_t, gates_t = self.adapter._to_canonical(index, weights)
        topk = topk_t.cpu().numpy().astype(np.int64)
        gates = gates_t.float().cpu().numpy().astype(np.float64)
        policy, alive = self.policy()
        st = p.state
        stranded = ~alive[st.location]  # the token's (emulated) node left: its state is at home anyway
        st.location[stranded] = st.home[stranded]
        dec = policy.decide(layer, topk, gates, st)
        experts, node, fixed = repair_slots(self.ctx, layer, dec.experts, dec.node, dec.location, st.user, alive)
        meet = np.where(alive[dec.next_location], dec.next_location, dec.location)
        out, experts, node, meet = self._dispatch(layer, hidden, experts, node, dec.location, meet, st.user, p.counts)
        st.location[:] = meet
        if layer == self.ctx.num_layers - 1:  # the hidden state comes home for the LM head (migrate mode)
            held, nbytes = self.links.hold(meet, st.home, row_bytes(self.hidden_size, self.cfg.wire))
            p.counts["emulated_s"] += held
            p.counts["link_bytes"] += nbytes
        final = replace(dec, experts=experts, node=node, next_location=meet)
        p.tally.add(final, topk, layer, st.home, p.prefill)
        p.counts["repaired"] += fixed
        p.topk.append(topk)
        p.gates.append(gates)
        call = LayerCall(layer, hidden, None, topk_t, gates_t)
        _, new_gates = apply_intervention(self.adapter, call, Intervention(torch.from_numpy(experts)))
        return (new_gates.to(out.dtype)[..., None] * out).sum(dim=1).to(hidden.dtype)

    def _dispatch(self, layer, hidden, experts, node, src, meet, users, counts):
        """Run every slot where node [T, K] says; failed calls are re-routed (repair) and retried up to
        max_attempts, then dropped. Returns (outputs [T, K, H] gate 1, experts, node, meet) as executed."""
        T, K = experts.shape
        out = torch.zeros(T, K, hidden.shape[1])
        experts, node, meet = experts.copy(), node.copy(), meet.copy()
        pending = np.argwhere(node >= 0)  # [S, 2] (row, slot)
        for _attempt in range(self.cfg.max_attempts):
            if len(pending) == 0:
                break
            calls = []
            for n in np.unique(node[pending[:, 0], pending[:, 1]]):
                mine = pending[node[pending[:, 0], pending[:, 1]] == n]
                t = mine[:, 0]
                msg = ExpertCall(layer, encode(hidden[torch.from_numpy(t)], self.cfg.wire), experts[t, mine[:, 1]],
                                 src[t], meet[t], self.cfg.wire)
                calls.append((int(n), mine, self.transport.submit(int(n), msg), msg.hidden.nbytes))
            deadline = time.monotonic() + self.cfg.call_timeout_s
            failed = []
            for n, mine, fut, sent in calls:
                counts["calls"] += 1
                try:
                    reply: ExpertReply = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
                except Exception:  # noqa: BLE001 - actor died, unavailable, or timed out: all mean "not now"
                    counts["failed_calls"] += 1
                    self.membership.exclude(n)
                    failed.append(mine)
                    continue
                out[mine[:, 0], mine[:, 1]] = decode(reply.out, self.cfg.wire)
                counts["link_bytes"] += reply.bytes_in + reply.bytes_out
                counts["emulated_s"] += reply.inbound_s + reply.outbound_s
                if n != self.node:
                    counts["process_bytes"] += sent + reply.out.nbytes
            if not failed:
                pending = pending[:0]
                break
            pending = np.concatenate(failed)
            alive, _ = self.membership.snapshot()
            experts, node, _ = repair_slots(self.ctx, layer, experts, node, src, users, alive)
            meet = np.where(alive[meet], meet, src)
            counts["repaired"] += len(pending)
            pending = pending[node[pending[:, 0], pending[:, 1]] >= 0]
        if len(pending):  # still failing after every attempt: drop those slots (gates renormalised)
            experts[pending[:, 0], pending[:, 1]] = -1
            node[pending[:, 0], pending[:, 1]] = -1
        return out, experts, node, meet

    # ---- requests -----------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, cache, user: int, prefill: bool, counts: dict, tally, rec) -> tuple[int, float, float]:
        """One pass over ids [1, S] under the backbone lock -> (greedy next token, wall seconds, seconds queued)."""
        policy, _ = self.policy()
        rows = ids.shape[1]
        state = policy.start(np.full(rows, user))
        state.home[:] = self.node  # the row lives here, even when this home stands in for another
        state.location[:] = self.node
        t_wait = time.perf_counter()
        with self.lock:
            t0 = time.perf_counter()
            self._current = _Pass(state, prefill, counts, [], [], tally)
            try:
                logits = self.adapter.model(input_ids=ids, cache=cache, use_cache=True).logits
            finally:
                p, self._current = self._current, None
            seconds = time.perf_counter() - t0
        rec[0].append(np.stack(p.topk, 1))
        rec[1].append(np.stack(p.gates, 1))
        return int(logits[0, -1].argmax()), seconds, t0 - t_wait

    @torch.no_grad()
    def generate(self, req: GenerateRequest) -> GenerateResult:
        """Greedy generation for one request; a request id seen before is answered from the cache."""
        from transformers import DynamicCache

        from edgemoe.eval.metrics import DecisionTally

        done = self.finished.get(req.request_id)
        if done is not None:
            return replace(done, replayed=True)
        if not 0 <= req.user < self.ctx.num_users:
            raise EdgeMoEError(f"request {req.request_id}: user {req.user} outside [0, {self.ctx.num_users})")
        if req.gen_tokens < 1 or len(req.prompt) < 1:
            raise EdgeMoEError(f"request {req.request_id}: needs a prompt and gen_tokens >= 1")
        counts = dict.fromkeys(COUNT_KEYS, 0)
        tally = DecisionTally(self.ctx.num_layers, row_bytes(self.hidden_size, self.cfg.wire))
        rec: tuple[list, list] = ([], [])
        cache = DynamicCache(config=self.adapter.model.config)
        prompt = torch.as_tensor(np.asarray(req.prompt, np.int64))[None]
        token, prefill_s, queued_s = self._forward(prompt, cache, req.user, True, counts, tally, rec)
        tokens, decode_s = [token], []
        for _ in range(req.gen_tokens - 1):
            token, sec, _ = self._forward(torch.tensor([[token]]), cache, req.user, False, counts, tally, rec)
            tokens.append(token)
            decode_s.append(sec)
        counts.update(slots=tally.slots, remote=tally.remote, substituted=tally.substituted, dropped=tally.dropped,
                      predicted_bytes=tally.prefill_bytes + tally.decode_bytes, quality_cost=tally.quality_cost)
        result = GenerateResult(req.request_id, req.user, np.asarray(tokens, np.int64), self.node, queued_s, prefill_s,
                                np.asarray(decode_s), counts, np.concatenate(rec[0]), np.concatenate(rec[1]))
        self.finished[req.request_id] = result
        while len(self.finished) > self.finished_cache:
            self.finished.popitem(last=False)
        self.served += 1
        return result
