"""The in-process serving engine: the real model, a runtime policy per token and MoE layer, continuous batching.

One engine thread owns the model. Each step it admits waiting sequences (each one's prompt runs alone: its
prefill), then runs one decode pass for every running sequence at once: their last tokens as a batch
[B, 1] over their own KV caches (left-padded to the longest, masked). Sequences join and leave between
steps. At every MoE layer of every pass the adapter hands the real routing to `PolicyBridge`, which asks
the deployment's policy (or `exact`, for requests that ask for it) what runs where, exactly as the `local`
backend does (edgemoe.runtime.local), and counts per row what the decision did.

Admission: at most `max_running` sequences run and `max_queue` wait; `submit` beyond that raises `Busy`.
Each sequence's i-th token is drawn from a generator seeded by (its seed, i) (edgemoe.distributed.sampling), and the
policy's decisions are per row, so a seeded request's text does not depend on what it was batched with (up to float rounding of
the batched arithmetic, about 1e-6 in the logits). The policy's adaptive feedback (`observe`) is not fed:
as in the local backend, one request's latency must not change another's text.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from edgemoe.distributed.batching import (
    SLOT_KINDS,
    append_step,
    batch_caches,
    explain_slots,
    row_allowance,
    slot_kinds,
)
from edgemoe.distributed.sampling import SamplingParams, next_token, top_logprobs
from edgemoe.errors import EdgeMoEError

from .text import TextStream


class Busy(EdgeMoEError):
    """The engine's queue is full (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Closed(EdgeMoEError):
    """The engine is stopped or failed (HTTP 503)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to run. prompt_ids: [S] token ids (checked against the vocabulary by the caller)."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-N alternatives per token (0: only the token's own); None: no logprobs
    user: int = 0  # index into ctx.user_names: whose home the request lives at
    exact: bool = False  # run every routed expert exactly, whatever the deployment's policy
    budget: float | None = None  # quality allowance per token-layer (capped at the deployment's); None: its own
    explain: bool = False  # record, per token and layer, where each slot ran and what stood in
    request_id: str = ""
    allow_degraded: bool = False  # ray backend: a failure may drop slots of an exact request (else 503)
    # (high, share): that share of the token rows runs at budget `high` instead of `budget` (the quality dial's
    # mixture, edgemoe.eval.dial.QualityDial.mix; which rows: edgemoe.distributed.batching.mix_rows)
    budget_mix: tuple[float, float] | None = None


@dataclass
class TokenInfo:
    token: int
    logprob: float | None = None
    top: list = field(default_factory=list)  # [(token id, logprob)]


@dataclass
class Delta:
    """New text and the tokens generated since the last event."""

    text: str
    tokens: list[TokenInfo]


@dataclass
class Finished:
    reason: str  # "stop" (EOS or a stop string), "length" (max_tokens), "cancelled"
    stats: dict


@dataclass
class Failed:
    status: int
    message: str


class Sequence:
    """A running request: its tokens, KV cache, text stream, counters and event sink."""

    def __init__(self, req: GenerationRequest, sink, tokenizer):
        self.req = req
        self.sink = sink  # callable(event), called from the engine thread
        self.stream = TextStream(tokenizer, req.stop)
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per decoder layer, [1, heads, len, dim]
        self.length = 0  # tokens in the cache
        self.generated: list[int] = []
        self.pending: list[TokenInfo] = []
        self.last_token = -1
        self.cancelled = False
        self.done = False
        self.slots = dict.fromkeys(SLOT_KINDS, 0)
        self.spent = 0.0  # quality budget spent (sum of the decisions' quality costs)
        self.granted = 0.0  # budget granted over all passes (allowance x layers per token row)
        self.remote_bytes = 0
        self.modelled_s = 0.0  # the cost model's seconds through the MoE layers, summed over generated tokens
        self.explain: list = []  # per generated token: per layer a list of K slot records (req.explain)
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.token_times: list[float] = []

    def emit(self, event) -> None:
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 - a gone client must not stop the engine
            self.cancelled = True

    def stats(self, ctx, policy_name: str) -> dict:
        """The response's `edgemoe` object: where the slots ran, budget, bytes, measured times."""
        t = np.asarray(self.token_times)
        gaps = np.diff(t) if len(t) > 1 else np.zeros(0)
        n = len(self.generated)
        req = self.req
        out = {
            "request_id": req.request_id, "user": ctx.user_names[req.user],
            "home": ctx.node_names[int(ctx.user_home[req.user])],
            "policy": "exact" if req.exact else policy_name, "seed": req.sampling.seed,
            "expert_slots": dict(self.slots), "budget_spent": self.spent, "budget_granted": self.granted,
            "remote_bytes": int(self.remote_bytes),
            "modelled_ms_per_token": 1e3 * self.modelled_s / n if n else None,
            "measured": {
                "queue_ms": 1e3 * ((self.started or self.submitted) - self.submitted),
                "ttft_ms": 1e3 * (t[0] - self.submitted) if len(t) else None,
                "ms_per_token": 1e3 * float(gaps.mean()) if len(gaps) else None,
            },
        }
        if req.explain:
            out["explain"] = self.explain
        return out


class PolicyBridge:
    """One forward pass's policy decisions for its token rows (flattened batch x sequence, row order).

    rows: per row, its Sequence, its user, whether it runs exactly, its budget allowance per token-layer, and
    whether it is a generated token (its decisions are kept for `explain` and the modelled time)."""

    def __init__(self, engine: Engine, seqs: list[Sequence], per_seq_rows: list[int], generated: list[bool],
                 positions: np.ndarray):
        """positions: [T] each row's token position in its request (which rows of a budget mix run at its high
        budget, and the routing log's positions)."""
        self.engine = engine
        self.positions = positions
        self.seqs = seqs
        self.owner = np.repeat(np.arange(len(seqs)), per_seq_rows)  # [T] which sequence each row belongs to
        self.gen_row = np.repeat(np.asarray(generated, bool), per_seq_rows) & _last_rows(per_seq_rows)
        self.users = np.array([s.req.user for s in seqs], np.int64)[self.owner]
        exact = np.array([s.req.exact for s in seqs], bool)[self.owner]
        self.groups = [(pol, np.flatnonzero(exact == flag)) for pol, flag in
                       ((engine.policy, False), (engine.exact_policy, True))]
        self.groups = [(pol, rows) for pol, rows in self.groups if len(rows)]
        self.allow = engine.row_allowances([s.req for s in seqs], self.owner, positions)  # [T]
        self.states: list = []
        self.layer_records: list = []  # per layer (topk, experts, node, location, zeroed) for explained rows
        self.routing: list = []  # per layer (topk, gates, router logits) when the engine logs routing

    def __call__(self, call):
        from edgemoe.models import Intervention
        from edgemoe.runtime.metrics import decision_bytes

        ctx = self.engine.ctx
        L = ctx.num_layers
        topk = call.topk.cpu().numpy().astype(np.int64)
        gates = call.gates.float().cpu().numpy().astype(np.float64)
        if call.layer == 0:
            self.states = []
            for pol, rows in self.groups:
                st = pol.start(self.users[rows])
                st.budget_total = self.allow[rows] * L  # the request's own budget (<= the deployment's)
                self.states.append(st)
            for r in range(len(self.seqs)):
                s = self.seqs[r]
                s.granted += float(self.allow[self.owner == r].sum() * L)
        experts = topk.copy()
        zeroed = np.zeros(topk.shape, bool)
        node = np.full(topk.shape, -1, np.int64)
        location = np.zeros(len(topk), np.int64)
        for (pol, rows), st in zip(self.groups, self.states, strict=True):
            dec = pol.decide(call.layer, topk[rows], gates[rows], st)
            experts[rows], node[rows], location[rows] = dec.experts, dec.node, dec.location
            zeroed[rows] = dec.zero_mask
            self._count(rows, topk[rows], dec, decision_bytes(dec, call.layer, L, st.home, ctx.wire_bytes))
        if self.gen_row.any():
            self.layer_records.append((topk, experts, node, location, zeroed))
        if self.engine.routing_log is not None:
            self._log(call, topk, gates)
        if np.array_equal(experts, topk):
            return None  # nothing changes: the model runs untouched
        return Intervention.from_numpy(experts, zeroed if zeroed.any() else None)

    def _log(self, call, topk: np.ndarray, gates: np.ndarray) -> None:
        """Keep the model's own routing of this layer; after the last layer, write the pass's trace lines."""
        logits = None if call.router_logits is None else call.router_logits.float().cpu().numpy()
        if call.layer == 0:
            self.routing = []
        self.routing.append((topk, gates, logits))
        if call.layer == self.engine.ctx.num_layers - 1:
            ctx = self.engine.ctx
            req_ids = [self.seqs[o].req.request_id for o in self.owner]
            domains = [self.engine.dep.user_domains[u] if self.engine.dep.user_domains else ctx.user_names[u]
                       for u in self.users]
            have_logits = all(r[2] is not None for r in self.routing)
            self.engine.routing_log.write(req_ids, self.positions, domains, np.stack([r[0] for r in self.routing], 1),
                                          np.stack([r[1] for r in self.routing], 1),
                                          np.stack([r[2] for r in self.routing], 1) if have_logits else None)

    def _count(self, rows: np.ndarray, topk: np.ndarray, dec, nbytes: np.ndarray) -> None:
        kind = slot_kinds(topk, dec.experts, dec.node, dec.location, dec.zero_mask)  # [R, K] index into SLOT_KINDS
        owner = self.owner[rows]
        tele = self.engine.telemetry
        for r in np.unique(owner):
            mine = owner == r
            s = self.seqs[r]
            counts = np.bincount(kind[mine].ravel(), minlength=len(SLOT_KINDS))
            for i, k in enumerate(SLOT_KINDS):
                s.slots[k] += int(counts[i])
            s.spent += float(dec.quality_cost[mine].sum())
            s.remote_bytes += int(nbytes[mine].sum())
            s.modelled_s += float(dec.latency_s[mine & self.gen_row[rows]].sum())
        if tele is not None:
            tele.slots(self.engine.policy_name, kind, dec.node, float(dec.quality_cost.sum()), int(nbytes.sum()))

    def explain_rows(self) -> dict[int, list]:
        """Sequence index -> per layer, K slot records of its generated token of this pass."""
        names = self.engine.ctx.node_names
        return {int(self.owner[row]): [explain_slots(names, topk[row], experts[row], node[row], int(location[row]),
                                                     zeroed[row])
                                       for topk, experts, node, location, zeroed in self.layer_records]
                for row in np.flatnonzero(self.gen_row)}


def _last_rows(per_seq_rows: list[int]) -> np.ndarray:
    """[T] bool: the last row of each sequence's block (the token whose logits are sampled)."""
    ends = np.cumsum(per_seq_rows) - 1
    mask = np.zeros(int(sum(per_seq_rows)), bool)
    mask[ends] = True
    return mask


class Engine:
    """Runs GenerationRequests on a Deployment (edgemoe.serve.setup) with continuous batching.

    max_running: sequences decoded together at most; max_queue: sequences waiting at most;
    max_prefills_per_step: prompts admitted per step (so running streams keep getting tokens); start=False:
    the loop starts at `start()` (tests queue requests first, so that they are batched together); log_routing:
    a trace file the routing of every pass is appended to (edgemoe.serve.routing_log)."""

    def __init__(self, deployment, max_running: int = 16, max_queue: int = 64, max_prefills_per_step: int = 4,
                 telemetry=None, start: bool = True, log_routing: str | None = None):
        from edgemoe.runtime import make_policy

        if max_running < 1 or max_queue < 0:
            raise EdgeMoEError(f"max_running must be >= 1 and max_queue >= 0, got {max_running}, {max_queue}")
        self.dep = deployment
        self.ctx = deployment.ctx
        self.adapter = deployment.adapter
        self.model = deployment.adapter.model
        self.tokenizer = deployment.tokenizer
        self.policy_name = deployment.spec.policy
        self.policy = make_policy(self.policy_name, self.ctx, **deployment.spec.params)
        self.exact_policy = self.policy if self.policy_name == "exact" else make_policy("exact", self.ctx)
        self.max_running, self.max_queue = int(max_running), int(max_queue)
        self.max_prefills = int(max_prefills_per_step)
        self.telemetry = telemetry
        self.routing_log = None
        if log_routing:
            from .routing_log import RoutingLog

            self.routing_log = RoutingLog(log_routing, deployment.spec.model, self.adapter.moe_layer_ids)
        self.eos = _eos_ids(self.tokenizer, self.adapter.config)
        self.device = next(self.model.parameters()).device
        self._cv = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._closed = False
        self.failure: str | None = None
        self._ids = itertools.count()
        self._run_id = secrets.token_hex(4)
        self.recent_s: deque[float] = deque(maxlen=32)  # durations of recently finished requests (Retry-After)
        self._thread = threading.Thread(target=self._loop, name="edgemoe-engine", daemon=True)
        if start:
            self.start()

    # ---- public
    def start(self) -> None:
        self._thread.start()

    def new_request_id(self, prefix: str = "cmpl") -> str:
        """Unique per server run and request: the run's random tag and a counter."""
        return f"{prefix}-{self._run_id}{next(self._ids):06d}"

    def allowance(self, req: GenerationRequest) -> float:
        """Quality allowance per token-layer of a request's first token row (`row_allowances`)."""
        return float(self.row_allowances([req], [0], [0])[0])

    def row_allowances(self, reqs: list[GenerationRequest], owner, positions) -> np.ndarray:
        """[T] quality allowance per token-layer of a pass's token rows (owner [T]: index into reqs; positions
        [T]: each row's token position in its request), budget mixes dealt (edgemoe.distributed.batching)."""
        return row_allowance(self.policy.allowance, reqs, owner, positions)

    def submit(self, req: GenerationRequest, sink) -> Sequence:
        """Queue `req`; events go to sink(event) from the engine thread. Raises Busy or Closed."""
        seq = Sequence(req, sink, self.tokenizer)
        with self._cv:
            if self._closed:
                raise Closed(self.failure or "the engine is shutting down")
            if len(self._running) + len(self._waiting) >= self.max_running + self.max_queue:
                raise Busy(f"{len(self._running)} sequences running and {len(self._waiting)} queued (the limits); "
                           "retry later", self.retry_after_s())
            self._waiting.append(seq)
            self._gauges()
            self._cv.notify()
        return seq

    def retry_after_s(self) -> int:
        """Seconds until a slot is likely free: the mean duration of recent requests, at least 1."""
        mean = float(np.mean(self.recent_s)) if self.recent_s else 1.0
        return max(1, int(np.ceil(mean)))

    def load(self) -> dict:
        with self._cv:
            return {"running": len(self._running), "queued": len(self._waiting)}

    @property
    def alive(self) -> bool:
        return not self._closed and (self._thread.is_alive() or self._thread.ident is None)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine: queued and running sequences end with a 503 event."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.ident is None:  # never started: fail what waits here
            self._loop()
        else:
            self._thread.join(timeout_s)
        if self.routing_log is not None:
            self.routing_log.close()

    # ---- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._closed and not self._waiting and not self._running:
                        self._cv.wait()
                    if self._closed:
                        break
                    room = min(self.max_running - len(self._running), self.max_prefills, len(self._waiting))
                    joining = [self._waiting.popleft() for _ in range(max(room, 0))]
                    self._running.extend(joining)
                    self._gauges()
                for seq in joining:
                    if not seq.cancelled:
                        self._guarded_prefill(seq)
                batch = [s for s in self._running if not s.done and not s.cancelled and s.generated]
                if batch:
                    self._decode(batch)
                self._retire()
        except Exception as exc:  # noqa: BLE001 - a bug or a device failure: every request learns of it
            self.failure = f"the engine failed: {type(exc).__name__}: {exc}"
        finally:
            with self._cv:
                self._closed = True
                rest = list(self._running) + list(self._waiting)
                self._running, self._waiting = [], deque()
                self._gauges()
            for s in rest:
                if not s.done:
                    s.done = True
                    s.emit(Failed(503, self.failure or "the server is shutting down"))

    def _retire(self) -> None:
        with self._cv:
            leaving = [s for s in self._running if s.done or s.cancelled]
            self._running = [s for s in self._running if not (s.done or s.cancelled)]
            self._gauges()
        for s in leaving:
            if not s.done:  # cancelled by its client
                self._finish(s, "cancelled")

    def _gauges(self) -> None:
        if self.telemetry is not None:
            self.telemetry.load(len(self._running), len(self._waiting))

    def _guarded_prefill(self, seq: Sequence) -> None:
        """A prompt that breaks the model fails its own request only."""
        try:
            self._prefill(seq)
        except Exception as exc:  # noqa: BLE001 - reported to that request's client
            seq.done = True
            seq.kv = []
            seq.emit(Failed(500, f"the prompt failed in the model: {type(exc).__name__}: {exc}"))

    @torch.no_grad()
    def _prefill(self, seq: Sequence) -> None:
        """Run seq's prompt alone, fill its KV cache, sample its first token."""
        from transformers import DynamicCache

        seq.started = time.perf_counter()
        ids = torch.tensor([list(seq.req.prompt_ids)], dtype=torch.long, device=self.device)
        cache = DynamicCache(config=self.model.config)
        bridge = PolicyBridge(self, [seq], [ids.shape[1]], [True], np.arange(ids.shape[1]))
        with self.adapter.intervene(bridge):
            logits = self.model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        seq.kv = [(layer.keys, layer.values) for layer in cache.layers]
        seq.length = ids.shape[1]
        self._took(bridge, [seq], logits, time.perf_counter() - seq.started)

    @torch.no_grad()
    def _decode(self, batch: list[Sequence]) -> None:
        """One decode pass for every sequence of `batch`: [B, 1] tokens over their left-padded caches."""
        t0 = time.perf_counter()
        B = len(batch)
        cache, mask = batch_caches([s.kv for s in batch], [s.length for s in batch], self.model.config)
        ids = torch.tensor([[s.last_token] for s in batch], dtype=torch.long, device=self.device)
        pos = torch.tensor([[s.length] for s in batch], dtype=torch.long, device=self.device)
        bridge = PolicyBridge(self, batch, [1] * B, [True] * B, np.array([s.length for s in batch]))
        with self.adapter.intervene(bridge):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
        append_step(cache, [s.kv for s in batch])
        for s in batch:
            s.length += 1
        self._took(bridge, batch, logits, time.perf_counter() - t0)

    def _took(self, bridge: PolicyBridge, seqs: list[Sequence], logits: torch.Tensor, step_s: float) -> None:
        """Sample each sequence's next token from logits [B, V], send its text, finish it when done."""
        now = time.perf_counter()
        explained = bridge.explain_rows() if any(s.req.explain for s in seqs) else {}
        if self.telemetry is not None:
            self.telemetry.step(len(seqs), step_s)
        for b, s in enumerate(seqs):
            row = logits[b]
            tok = next_token(row, s.req.sampling, len(s.generated))
            info = TokenInfo(tok)
            if s.req.logprobs is not None:
                info.logprob, info.top = top_logprobs(row, tok, s.req.logprobs)
            s.generated.append(tok)
            s.last_token = tok
            s.token_times.append(now)
            if s.req.explain and b in explained:
                s.explain.append({"token": tok, "text": self.tokenizer.decode([tok]), "layers": explained[b]})
            if self.telemetry is not None:
                self.telemetry.token(s, now)
            if tok in self.eos:
                self._finish(s, "stop")
                continue
            piece = s.stream.add(tok)
            s.pending.append(info)
            if s.stream.stopped_at is not None:
                self._finish(s, "stop", piece)
                continue
            if len(s.generated) >= s.req.max_tokens or s.length + 1 >= self.dep.context_length:
                self._finish(s, "length", piece)
                continue
            if piece:
                s.emit(Delta(piece, s.pending))
                s.pending = []

    def _finish(self, s: Sequence, reason: str, piece: str = "") -> None:
        piece += s.stream.finish()
        if piece or s.pending:
            s.emit(Delta(piece, s.pending))
            s.pending = []
        s.done = True
        s.kv = []
        self.recent_s.append(time.perf_counter() - s.submitted)
        stats = s.stats(self.ctx, self.policy_name)
        if self.telemetry is not None:
            self.telemetry.finished(s, reason)
        with self._cv:  # its slot is free before its client hears it finished (a next request may take it)
            if s in self._running:
                self._running.remove(s)
            self._gauges()
        s.emit(Finished(reason, stats))


def _eos_ids(tokenizer, config) -> set[int]:
    """Token ids that end a generation: the tokenizer's EOS and the model config's."""
    ids = set()
    for v in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def run_to_end(engine: Engine, req: GenerationRequest, timeout_s: float = 600.0) -> tuple[str, list[TokenInfo], Finished]:
    """The Python client: run `req` on `engine` and wait -> (text, token infos, Finished). Raises EdgeMoEError
    when the request fails or times out."""
    import queue

    events: queue.Queue = queue.Queue()
    seq = engine.submit(req, events.put)
    text, infos = [], []
    end = time.monotonic() + timeout_s
    while True:
        try:
            ev = events.get(timeout=max(end - time.monotonic(), 0.001))
        except queue.Empty:
            seq.cancelled = True
            raise EdgeMoEError(f"request {req.request_id} did not finish within {timeout_s} s") from None
        if isinstance(ev, Delta):
            text.append(ev.text)
            infos.extend(ev.tokens)
        elif isinstance(ev, Finished):
            return "".join(text), infos, ev
        elif isinstance(ev, Failed):
            raise EdgeMoEError(f"request {req.request_id} failed ({ev.status}): {ev.message}")
