"""Continuous batching on a Ray home: streams of this home's users join and leave between steps.

`HomeBatcher` runs one loop thread beside the home's `HomeEngine`. Each step it admits waiting streams (each
prompt runs alone: its prefill), then one decode pass for every running stream at once: their last tokens as
a batch [B, 1] over their own KV caches, left-padded to the longest and masked. Inside that pass every MoE
layer's slots bound for one server leave as one `ExpertCall` (SlotDispatch groups by server, not
by stream), so the expert calls of a step meet at each node as one batched call.

A stream samples its i-th token from a generator seeded by (seed, i) (edgemoe.distributed.sampling), stops
at EOS, at `max_tokens` or at the model's context, and is polled by the ingress (edgemoe.serve.ray_engine)
for its new tokens (`poll` waits up to a bound for one). Stop strings are the ingress's (it holds the
tokenizer): it cancels the stream when one appears. A stream that resumes on another home after a failure
starts at `first_index`, with the draws the first home would have made.

The per-sequence cache handling (`batch_caches`, `append_step`) and the slot kinds are the in-process
engine's too (edgemoe.serve.engine): one copy of each.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError

from .sampling import SamplingParams, next_token, top_logprobs
from .wire import row_bytes

SLOT_KINDS = ("local", "remote", "substituted", "dropped", "zeroed")


def slot_kinds(topk, experts, node, location, zeroed) -> np.ndarray:
    """[T, K] index into SLOT_KINDS: zeroed; dropped (not run, renormalised); substituted (another expert ran);
    remote (the routed expert ran away from the token's node); local. topk/experts/node/zeroed: [T, K];
    location: [T]."""
    kind = np.where(node == location[:, None], 0, 1)
    kind = np.where((experts >= 0) & (experts != topk), 2, kind)
    kind = np.where(experts < 0, 3, kind)
    return np.where(zeroed, 4, kind)


def request_allowance(ceiling: np.ndarray, exact: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """[B] quality allowance per token-layer of B requests: 0 when exact, else the request's budget capped at the
    deployment's allowance for its user (the operator's ceiling), or that allowance when it names none.
    ceiling: [B] the deployment policy's allowance of each request's user; exact: [B] bool; budget: [B] float,
    nan where the request names none (`row_allowance` applies it to each token row)."""
    ceiling = np.asarray(ceiling, float)
    budget = np.asarray(budget, float)
    own = np.where(np.isnan(budget), ceiling, np.minimum(budget, ceiling))
    return np.where(np.asarray(exact, bool), 0.0, own)


GOLDEN = (np.sqrt(5.0) - 1.0) / 2.0  # the Weyl step of `mix_rows`: its points spread evenly in every window


def mix_rows(low, high, share, positions) -> np.ndarray:
    """[T] each token row's budget in a mixture (edgemoe.eval.dial.QualityDial.mix): `high` where frac(0.5 + position x GOLDEN)
    < share, else `low`. low, high, share: scalars or [T]; positions [T]: each row's token position in its
    request. Deterministic and spread out: of any n consecutive positions, share x n run at `high` up to a count
    that grows like log n (a Weyl sequence with the golden ratio), so a short request gets its share too, the same
    request gets the same rows on every server, and a stream resumed elsewhere keeps them."""
    pos = np.asarray(positions, dtype=np.float64)
    u = np.mod(0.5 + pos * GOLDEN, 1.0)
    return np.where(u < np.asarray(share, float), np.asarray(high, float), np.asarray(low, float))


def row_allowance(ceiling_of_user: np.ndarray, reqs, owner, positions) -> np.ndarray:
    """[T] quality allowance per token-layer of each token row of the requests `reqs` [B] (each with `user`,
    `exact`, `budget` and `budget_mix`: a GenerationRequest or a StreamRequest): `request_allowance` of its request
    under ceiling_of_user [U] (the deployment policy's allowance per user), or, for a request with a budget mix
    (high, share), its rows dealt between its capped budget and its capped `high` by `mix_rows`. owner: [T] each
    row's request; positions: [T] each row's token position in its request. The in-process engine and the Ray
    homes both grant budgets by this rule."""
    ceiling = np.asarray(ceiling_of_user, float)[[r.user for r in reqs]]
    exact = [r.exact for r in reqs]
    budget = np.array([np.nan if r.budget is None else r.budget for r in reqs], float)
    high = np.array([np.nan if r.budget_mix is None else r.budget_mix[0] for r in reqs], float)
    share = np.array([0.0 if r.budget_mix is None else r.budget_mix[1] for r in reqs], float)
    low = request_allowance(ceiling, exact, budget)
    high = request_allowance(ceiling, exact, np.where(np.isnan(high), budget, high))
    owner = np.asarray(owner, np.int64)
    return mix_rows(low[owner], high[owner], share[owner], positions)


def explain_slots(names, topk, experts, node, location, zeroed) -> list[dict]:
    """The K slot records of one token row at one layer (the `explain` of a response): the routed expert, the
    one that ran (None: not run), the node it ran on, where the token was, and the slot's kind (SLOT_KINDS).
    names: node names; topk/experts/node/zeroed: [K]; location: the row's node."""
    kinds = slot_kinds(topk[None], experts[None], node[None], np.array([location]), zeroed[None])[0]
    return [{"routed": int(topk[k]), "ran": int(experts[k]) if experts[k] >= 0 else None,
             "node": names[node[k]] if node[k] >= 0 else None, "at": names[location], "kind": SLOT_KINDS[kinds[k]]}
            for k in range(len(topk))]


def batch_caches(kvs: list, lengths: list[int], config):
    """Per-sequence KV caches -> one DynamicCache for a decode step, and its attention mask.

    kvs: per sequence, per decoder layer (keys, values) [1, heads, len_b, dim]; lengths: [B] len_b.
    Returns (cache [B, heads, W, dim] per layer, left-padded to W = max len_b; mask [B, W + 1] long, 1 where
    a position is real, the last column the step's own token)."""
    from transformers import DynamicCache

    B, width = len(kvs), max(lengths)
    layers = []
    for i in range(len(kvs[0])):
        k0 = kvs[0][i][0]
        keys = k0.new_zeros((B, k0.shape[1], width, k0.shape[3]))
        values = keys.clone()
        for b in range(B):
            keys[b, :, width - lengths[b]:] = kvs[b][i][0][0]
            values[b, :, width - lengths[b]:] = kvs[b][i][1][0]
        layers.append((keys, values))
    mask = torch.zeros((B, width + 1), dtype=torch.long, device=kvs[0][0][0].device)
    for b in range(B):
        mask[b, width - lengths[b]:] = 1
    return DynamicCache(layers, config=config), mask


def append_step(cache, kvs: list) -> None:
    """After a decode step over `batch_caches(kvs, ...)`: append each sequence's new position to its own cache
    (kvs is updated in place; the padded batch cache is dropped)."""
    for i, layer in enumerate(cache.layers):
        new_k, new_v = layer.keys[:, :, -1:], layer.values[:, :, -1:]
        for b, kv in enumerate(kvs):
            k, v = kv[i]
            kv[i] = (torch.cat([k, new_k[b:b + 1]], dim=2), torch.cat([v, new_v[b:b + 1]], dim=2))


@dataclass(frozen=True)
class StreamRequest:
    """One stream for a home to run. prompt: [S] int64 token ids (a resumed stream: the prompt plus the tokens
    generated before the failure); first_index: the index of its first token to generate (the sampler's)."""

    request_id: str
    user: int
    prompt: np.ndarray
    max_tokens: int
    sampling: SamplingParams = SamplingParams(temperature=0.0)
    first_index: int = 0
    logprobs: int | None = None  # top-N alternatives per token (0: only the token's own); None: no logprobs
    eos: tuple[int, ...] = ()
    context_length: int = 1 << 30
    allow_degraded: bool = False
    exact: bool = False  # the exact policy decides this stream's rows, whatever the deployment's policy
    budget: float | None = None  # quality allowance per token-layer (capped at the deployment's); None: its own
    explain: bool = False  # record, per token and layer, where each slot ran and what stood in (poll's "explain")
    budget_mix: tuple[float, float] | None = None  # (high, share): that share of the rows at budget high (mix_rows)


class _Stream:
    """A stream on this home: its KV cache, generated tokens, counts, and the condition its poller waits on."""

    def __init__(self, req: StreamRequest, num_nodes: int):
        self.req = req
        self.kv: list = []
        self.length = 0
        self.tokens: list[tuple] = []  # (token, logprob or None, [(token, logprob)])
        self.reason: str | None = None  # "stop" (EOS), "length", "cancelled"
        self.error: tuple[int, str] | None = None  # (HTTP status, message)
        self.cancelled = False
        self.slots = dict.fromkeys(SLOT_KINDS, 0)
        self.node_slots = np.zeros(num_nodes, np.int64)  # slots each node ran for this stream
        self.degraded = 0
        self.spent = 0.0
        self.granted = 0.0  # budget granted over all passes (allowance x layers per token row)
        self.explain: list = []  # per generated token (req.explain): per layer, K slot records (explain_slots)
        self.remote_bytes = 0
        self.touched = time.monotonic()  # last poll: a stream nobody polls any more is cancelled

    @property
    def finished(self) -> bool:
        return self.reason is not None or self.error is not None

    def strict(self, policy: str) -> bool:
        """Exact execution or nothing: an exact stream (the deployment's policy or the request's flag) that did
        not allow degradation."""
        return (policy == "exact" or self.req.exact) and not self.req.allow_degraded


class HomeBatcher:
    """The batching loop of one home. home_of(): the actor's current HomeEngine (a reconfiguration replaces it).

    max_running: streams decoded together at most (the rest wait); max_prefills: prompts admitted per step;
    keep: finished streams remembered for their last poll; orphan_s: a stream not polled for this long is
    cancelled (its ingress is gone), and a finished one is forgotten (no ingress waits that long between two
    polls: edgemoe.serve.ray_engine gives a home up after POLL_S + CALL_SLACK_S). So the streams this home
    remembers are bounded by `keep` and by the requests of the last `orphan_s` seconds."""

    def __init__(self, home_of, max_running: int = 32, max_prefills: int = 4, keep: int = 1024,
                 orphan_s: float = 60.0):
        self.home_of = home_of
        self.max_running, self.max_prefills, self.keep, self.orphan_s = max_running, max_prefills, keep, orphan_s
        self._cv = threading.Condition()
        self._waiting: deque[_Stream] = deque()
        self._running: list[_Stream] = []
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._closed = False
        self.steps = 0  # decode steps run
        self.batched_rows = 0  # sequences over all decode steps (batched_rows / steps: the mean batch)
        self._thread = threading.Thread(target=self._loop, name="edgemoe-home-batcher", daemon=True)
        self._thread.start()

    # ---- the ingress's calls (actor threads) ----------------------------------------------------
    def start(self, req: StreamRequest) -> None:
        """Queue a stream; a request id seen before is not started twice (a retried call)."""
        home = self.home_of()
        if home is None:
            raise EdgeMoEError("this server is no user's home (it has no backbone)")
        if not 0 <= req.user < home.ctx.num_users:
            raise EdgeMoEError(f"stream {req.request_id}: user {req.user} outside [0, {home.ctx.num_users})")
        if req.max_tokens < 1 or len(req.prompt) < 1:
            raise EdgeMoEError(f"stream {req.request_id}: needs a prompt and max_tokens >= 1")
        with self._cv:
            if self._closed:
                raise EdgeMoEError("the home's batcher is stopped")
            if req.request_id in self._streams:
                return
            s = _Stream(req, home.ctx.num_nodes)
            self._streams[req.request_id] = s
            self._waiting.append(s)
            self._forget()
            self._cv.notify_all()

    def poll(self, request_id: str, have: int, timeout_s: float) -> dict:
        """The stream's tokens after the first `have`, waiting up to timeout_s for one (or its end).

        Returns {"tokens": [(token, logprob, top)], "done", "reason", "error": (status, message) or None,
        "explain" (an explained stream): per new token, per layer K slot records; "stats" (when done): slot
        counts, node_slots, degraded, budget_spent, budget_granted, remote_bytes}."""
        end = time.monotonic() + timeout_s
        with self._cv:
            s = self._streams.get(request_id)
            if s is None:
                raise EdgeMoEError(f"stream {request_id} is unknown here (this home restarted, or forgot it)")
            s.touched = time.monotonic()
            while len(s.tokens) <= have and not s.finished and not self._closed:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            s.touched = time.monotonic()
            out = {"tokens": list(s.tokens[have:]), "done": s.finished, "reason": s.reason, "error": s.error}
            if s.req.explain:
                out["explain"] = list(s.explain[have:])
            if self._closed and not s.finished:
                out.update(done=True, error=(503, "the home is shutting down"))
            if out["done"]:
                out["stats"] = self._stats(s)
            return out

    @staticmethod
    def _stats(s: _Stream) -> dict:
        """The stream's counts so far: slots by kind (and in all, and degraded), per node, budget, bytes."""
        return {"expert_slots": dict(s.slots, degraded=s.degraded, slots=int(sum(s.slots.values()))),
                "node_slots": s.node_slots.tolist(), "budget_spent": s.spent, "budget_granted": s.granted,
                "remote_bytes": int(s.remote_bytes)}

    def cancel(self, request_id: str) -> dict | None:
        """Stop the stream at its next step; returns its counts so far (None: unknown here)."""
        with self._cv:
            s = self._streams.get(request_id)
            if s is None:
                return None
            s.cancelled = True
            self._cv.notify_all()
            return self._stats(s)

    def load(self) -> dict:
        with self._cv:
            return {"running": len(self._running), "queued": len(self._waiting), "steps": self.steps,
                    "batched_rows": self.batched_rows}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _forget(self, now: float | None = None) -> None:
        """Drop the finished streams not polled for `orphan_s` seconds, then the oldest finished ones beyond
        `keep` (their pollers have had their answer). Called with the lock held."""
        now = time.monotonic() if now is None else now
        for rid in [r for r, s in self._streams.items() if s.finished and now - s.touched > self.orphan_s]:
            del self._streams[rid]
        excess = len(self._streams) - self.keep
        for rid in [r for r, s in self._streams.items() if s.finished][:max(excess, 0)]:
            del self._streams[rid]

    def remembered(self) -> int:
        """Streams this home holds (waiting, running, and finished ones kept for their last poll)."""
        with self._cv:
            return len(self._streams)

    # ---- the loop ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._running:
                    self._cv.wait()
                if self._closed:
                    return
                now = time.monotonic()
                for s in self._running + list(self._waiting):
                    if now - s.touched > self.orphan_s:
                        s.cancelled = True
                room = min(self.max_running - len(self._running), self.max_prefills, len(self._waiting))
                joining = [self._waiting.popleft() for _ in range(max(room, 0))]
                self._running.extend(joining)
            home = self.home_of()
            for s in joining:
                if not s.cancelled:
                    self._guarded(home, [s], prefill=True)
            batch = [s for s in self._running if not s.finished and not s.cancelled and s.tokens]
            if batch:
                self._guarded(home, batch, prefill=False)
            with self._cv:
                for s in self._running:
                    if s.cancelled and not s.finished:
                        s.reason = "cancelled"
                    if s.finished:
                        s.kv = []
                self._running = [s for s in self._running if not s.finished]
                self._cv.notify_all()

    def _guarded(self, home, batch: list[_Stream], prefill: bool) -> None:
        """Run one pass; a Degraded error fails the strict streams it names (the others take the next step),
        any other error fails the pass's streams with a 503 naming it."""
        from .dispatch import Degraded

        try:
            self._pass(home, batch, prefill)
        except Degraded as exc:
            rows = set(exc.rows)
            per = 1 if not prefill else len(batch[0].req.prompt)
            hit = {r // per for r in rows} or set(range(len(batch)))
            with self._cv:
                for b in hit:
                    batch[b].error = (503, str(exc))
                self._cv.notify_all()
        except Exception as exc:  # noqa: BLE001 - reported to those streams' clients
            with self._cv:
                for s in batch:
                    s.error = (503, f"the home failed a forward pass: {type(exc).__name__}: {exc}")
                self._cv.notify_all()

    def _pass(self, home, batch: list[_Stream], prefill: bool) -> None:
        """A prefill (one stream, its whole prompt) or a decode step ([B, 1]), then one token per stream."""
        from transformers import DynamicCache

        from edgemoe.runtime.metrics import decision_bytes

        config = home.adapter.model.config
        users = np.array([s.req.user for s in batch], np.int64)
        strict = np.array([s.strict(home.cfg.policy) for s in batch], bool)
        exact = np.array([s.req.exact for s in batch], bool)
        overrides = exact.any() or any(s.req.budget is not None or s.req.budget_mix is not None for s in batch)
        per = len(batch[0].req.prompt) if prefill else 1
        owner = np.repeat(np.arange(len(batch)), per)  # [B x S] which stream each row is
        positions = np.arange(per) if prefill else np.array([s.length for s in batch])  # [B x S] in its stream
        allowance = home.policies.row_allowances([s.req for s in batch], owner, positions)  # [B x S]
        last = np.arange(len(batch)) * per + per - 1  # [B] the row whose logits each stream samples from
        layers: dict[int, list] = {b: [] for b, s in enumerate(batch) if s.req.explain}  # explained streams' slots

        wire_bytes = row_bytes(home.hidden_size, home.cfg.wire)
        here = np.full(len(owner), home.node)
        names = home.ctx.node_names

        def observe(layer, topk, final) -> None:
            kind = slot_kinds(topk, final.experts, final.node, final.location, final.zero_mask)
            nbytes = decision_bytes(final, layer, home.ctx.num_layers, here, wire_bytes)  # [T]
            zeroed = final.zero_mask
            for b, s in enumerate(batch):
                mine = owner == b
                counts = np.bincount(kind[mine].ravel(), minlength=len(SLOT_KINDS))
                for i, k in enumerate(SLOT_KINDS):
                    s.slots[k] += int(counts[i])
                ran = final.node[mine]
                s.node_slots += np.bincount(ran[ran >= 0], minlength=len(s.node_slots))
                s.spent += float(final.quality_cost[mine].sum())
                s.remote_bytes += int(nbytes[mine].sum())
                if b in layers:
                    r = last[b]
                    layers[b].append(explain_slots(names, topk[r], final.experts[r], final.node[r],
                                                   int(final.location[r]), zeroed[r]))

        policy_rows = {"allowance": allowance if overrides else None, "exact": exact if exact.any() else None}
        if prefill:
            s = batch[0]
            ids = torch.as_tensor(np.asarray(s.req.prompt, np.int64))[None]
            cache = DynamicCache(config=config)
            logits, degraded = home.forward_batch(ids, cache, users, strict, observe, **policy_rows)
            s.kv = [(layer.keys, layer.values) for layer in cache.layers]
            s.length = ids.shape[1]
        else:
            cache, mask = batch_caches([s.kv for s in batch], [s.length for s in batch], config)
            ids = torch.tensor([[s.tokens[-1][0]] for s in batch], dtype=torch.long)
            pos = torch.tensor([[s.length] for s in batch], dtype=torch.long)
            logits, degraded = home.forward_batch(ids, cache, users, strict, observe, mask, pos, **policy_rows)
            append_step(cache, [s.kv for s in batch])
            for s in batch:
                s.length += 1
            self.steps += 1
            self.batched_rows += len(batch)
        with self._cv:
            for b, s in enumerate(batch):
                s.degraded += int(degraded[owner == b].sum())
                s.granted += float(allowance[owner == b].sum()) * home.ctx.num_layers
                self._sample(s, logits[b])
                if b in layers:
                    s.explain.append(layers[b])
            self._cv.notify_all()

    @staticmethod
    def _sample(s: _Stream, row: torch.Tensor) -> None:
        req = s.req
        index = req.first_index + len(s.tokens)
        tok = next_token(row, req.sampling, index)
        logprob, top = (None, [])
        if req.logprobs is not None:
            logprob, top = top_logprobs(row, tok, req.logprobs)
        s.tokens.append((tok, logprob, top))
        if tok in req.eos:
            s.reason = "stop"
        elif len(s.tokens) >= req.max_tokens or s.length + 1 >= req.context_length:
            s.reason = "length"
