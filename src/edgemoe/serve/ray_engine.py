"""The Ray deployment (edgemoe.distributed) behind the same HTTP app as the in-process engine.

Each request runs whole on its user's home actor through `distributed.serve.Client` (failover to the
nearest other home included): the home's own generation, greedy and exactly `max_tokens` passes; the text
is cut here at EOS or a stop string and sent in one piece when the request ends (no token streaming, no
batching across requests: the Ray home runs one thread per request). What the Ray home cannot do is a 400
naming the field: temperature > 0 (and so top_p / top_k / seed), logprobs, per-request budgets, `exact`
and `explain`. The response's `edgemoe` object carries the home's own counts (`backend: "ray"`).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError

from .engine import Busy, Closed, Delta, Failed, Finished, GenerationRequest, TokenInfo, _eos_ids
from .text import TextStream


class Unsupported(EdgeMoEError):
    """A request field the Ray backend cannot honour (HTTP 400)."""


@dataclass(frozen=True)
class ModelFacts:
    """What the HTTP app reads of a deployment besides the context: the model's limits."""

    context_length: int
    vocab_size: int


class _Request:
    """The app's handle of one request (the fields it reads of an engine Sequence)."""

    def __init__(self, req: GenerationRequest, sink):
        self.req, self.sink = req, sink
        self.generated: list[int] = []
        self.done = False
        self.cancelled = False


class RayEngine:
    """Serves GenerationRequests on a running `edgemoe.distributed.serve.Deployment`.

    max_running: requests in flight at most (one home thread each); max_queue: requests waiting at most."""

    def __init__(self, deployment, tokenizer, max_running: int = 16, max_queue: int = 64, telemetry=None):
        from transformers import AutoConfig

        from edgemoe.distributed.serve import Client

        self.deployment = deployment
        self.client = Client(deployment)
        self.ctx = deployment.cfg.ctx
        self.tokenizer = tokenizer
        self.policy_name = deployment.cfg.policy
        cfg = AutoConfig.from_pretrained(deployment.cfg.model_path)
        self.dep = ModelFacts(int(getattr(cfg, "max_position_embeddings", None) or 2048), int(cfg.vocab_size))
        self.eos = _eos_ids(tokenizer, cfg)
        self.telemetry = telemetry
        self.max_running, self.max_queue = int(max_running), int(max_queue)
        self.pool = ThreadPoolExecutor(self.max_running, thread_name_prefix="edgemoe-ray")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self.failure: str | None = None
        self._ids = itertools.count()
        self._run_id = secrets.token_hex(4)

    def new_request_id(self, prefix: str = "cmpl") -> str:
        return f"{prefix}-{self._run_id}{next(self._ids):06d}"

    @property
    def alive(self) -> bool:
        return not self._closed

    def load(self) -> dict:
        with self._lock:
            running = min(self._in_flight, self.max_running)
            return {"running": running, "queued": self._in_flight - running}

    def submit(self, req: GenerationRequest, sink) -> _Request:
        for field, bad in (("temperature", req.sampling.temperature != 0.0), ("logprobs", req.logprobs is not None),
                           ("edgemoe.budget", req.budget is not None), ("edgemoe.exact", req.exact),
                           ("edgemoe.explain", req.explain)):
            if bad:
                raise Unsupported(f"{field}: the ray backend generates greedily with the deployment's policy "
                                  "(give temperature 0; no logprobs, budget, exact or explain)")
        with self._lock:
            if self._closed:
                raise Closed(self.failure or "the server is shutting down")
            if self._in_flight >= self.max_running + self.max_queue:
                raise Busy(f"{self._in_flight} requests in flight (the limit); retry later", 1)
            self._in_flight += 1
        handle = _Request(req, sink)
        self.pool.submit(self._run, handle)
        return handle

    def _run(self, h: _Request) -> None:
        req = h.req
        t0 = time.perf_counter()
        try:
            if self.telemetry is not None:
                self.telemetry.load(*self.load().values())
            result = self.client.generate(req.user, np.asarray(req.prompt_ids, np.int64), req.max_tokens)
        except Exception as exc:  # noqa: BLE001 - every home failed, or a bad request the home refused
            h.done = True
            h.sink(Failed(503, f"the ray deployment did not answer: {exc}"))
            return
        finally:
            with self._lock:
                self._in_flight -= 1
        wall = time.perf_counter() - t0
        stream = TextStream(self.tokenizer, req.stop)
        reason, text = "length", []
        for tok in result.tokens.tolist():
            h.generated.append(int(tok))
            if tok in self.eos:
                reason = "stop"
                break
            text.append(stream.add(tok))
            if stream.stopped_at is not None:
                reason = "stop"
                break
        text.append(stream.finish())
        counts = result.counts
        stats = {
            "request_id": req.request_id, "backend": "ray", "user": self.ctx.user_names[req.user],
            "home": self.ctx.node_names[result.served_by], "policy": self.policy_name,
            "expert_slots": {k: int(counts.get(k, 0)) for k in ("slots", "remote", "substituted", "dropped",
                                                                   "repaired", "failed_calls")},
            "budget_spent": float(counts.get("quality_cost", 0.0)), "remote_bytes": int(counts.get("link_bytes", 0)),
            "modelled_ms_per_token": None,
            "measured": {"queue_ms": None, "ttft_ms": None,
                         "ms_per_token": 1e3 * wall / max(len(result.tokens), 1)},
        }
        h.done = True
        if self.telemetry is not None:
            self.telemetry.tokens.inc(len(h.generated))
            self.telemetry.finished_count.labels(reason=reason).inc()
        h.sink(Delta("".join(text), [TokenInfo(t) for t in h.generated]))
        h.sink(Finished(reason, stats))

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)
