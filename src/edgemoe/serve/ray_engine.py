"""The Ray deployment (edgemoe.distributed) behind the same HTTP app as the in-process engine.

Each request is a stream on its user's home actor (edgemoe.distributed.batching): the home batches the
decode steps of all its running streams (continuous batching; the expert calls of a step meet at each
server as one call), samples each stream's tokens (temperature / top-p / top-k, seeded per token, as the
in-process engine does), stops at EOS and `max_tokens`. A thread here long-polls the home for new tokens and
sends them as they come (SSE streaming); stop strings are cut here (the tokenizer is here) and the stream is
then cancelled at the home. A home that dies or stops answering mid-stream is excluded (the ingress's
`Client.homes`) and the stream resumes on the next home by latency from where it was: the prompt plus the
tokens already sent, with the draws the first home would have made; after `max_attempts` homes it fails
with a 503 naming the last error. With the exact policy no slot is degraded silently: a stream that would
lose one fails with 503 unless it sends `edgemoe.allow_degraded: true`.

The home runs the policy, so a request's own `budget` (capped at the deployment's allowance for its user) and
`exact: true` travel with the stream to the home's decisions, by the in-process engine's rule
(edgemoe.distributed.batching.row_allowance); with `explain: true` the home records, per token and layer,
where each slot ran and what stood in, and the response carries it as the in-process engine's does. The
response's `edgemoe` object carries the home's counts (`backend: "ray"`), among them `expert_slots.degraded`:
slots a failed server dropped or substituted.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from edgemoe.distributed.batching import SLOT_KINDS, StreamRequest
from edgemoe.errors import EdgeMoEError

from .engine import Busy, Closed, Delta, Failed, Finished, GenerationRequest, TokenInfo, _eos_ids
from .text import TextStream

log = logging.getLogger("edgemoe.distributed")
POLL_S = 1.0  # how long one poll waits at the home for a new token
CALL_SLACK_S = 20.0  # beyond POLL_S, how long a start or poll call may take before its home counts as failed


@dataclass(frozen=True)
class ModelFacts:
    """What the HTTP app reads of a deployment besides the context: the model's limits."""

    context_length: int
    vocab_size: int


class _Request:
    """The app's handle of one request (the fields it and the telemetry read of an engine Sequence)."""

    def __init__(self, req: GenerationRequest, sink):
        self.req, self.sink = req, sink
        self.generated: list[int] = []
        self.token_times: list[float] = []
        self.explain: list = []  # per generated token (req.explain): {"token", "text", "layers"}
        self.submitted = time.perf_counter()
        self.done = False
        self.cancelled = False
        self._once = threading.Lock()

    def end(self, event) -> bool:
        """Send the request's last event (Finished or Failed) once; False if it was already sent."""
        with self._once:
            if self.done:
                return False
            self.done = True
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 - a gone client
            pass
        return True


class RayEngine:
    """Serves GenerationRequests on a running `edgemoe.distributed.serve.Deployment`.

    max_running + max_queue: requests in flight at most (beyond: 429); each home batches its own streams."""

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
        self.pool = ThreadPoolExecutor(self.max_running + self.max_queue, thread_name_prefix="edgemoe-ray")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False
        self.failure: str | None = None
        self._ids = itertools.count()
        self._run_id = secrets.token_hex(4)
        self._events_seen: dict[int, tuple[int, int]] = {}  # home -> (its process id, membership events counted)
        self._ingress_seen = 0
        if telemetry is not None:
            telemetry.before_render = self._sync_ingress_events

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
        with self._lock:
            if self._closed:
                raise Closed(self.failure or "the server is shutting down")
            if self._in_flight >= self.max_running + self.max_queue:
                raise Busy(f"{self._in_flight} requests in flight (the limit); retry later", 1)
            self._in_flight += 1
        handle = _Request(req, sink)
        self._gauges()
        self.pool.submit(self._run, handle)
        return handle

    def _gauges(self) -> None:
        if self.telemetry is not None:
            self.telemetry.load(*self.load().values())

    # ---- one request ------------------------------------------------------------------------------
    def _run(self, h: _Request) -> None:
        try:
            self._stream(h)
        except Exception as exc:  # noqa: BLE001 - a bug here must still answer the client
            h.end(Failed(503, f"the ray ingress failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._lock:
                self._in_flight -= 1
            self._gauges()

    def _stream(self, h: _Request) -> None:
        """Run h on its home, failing over to the next home (resuming where it was) when a home fails."""
        import ray

        req, client = h.req, self.client
        names = self.ctx.node_names
        stream = TextStream(self.tokenizer, req.stop)
        pending: list[TokenInfo] = []
        totals: dict = {}
        last: BaseException | None = None
        homes = client.homes_for(req.user)
        for attempt in range(client.max_attempts):
            home = homes[min(attempt, len(homes) - 1)]
            if attempt:
                log.warning("ingress: stream %s of user %s fails over to home %s at token %d (attempt %d)",
                            req.request_id, self.ctx.user_names[req.user], names[home], len(h.generated), attempt + 1)
                with client._lock:
                    client.failovers += 1
                if self.telemetry is not None:
                    self.telemetry.failovers.inc()
                time.sleep(client.backoff.delay_s(attempt))
            key = f"{req.request_id}.{attempt}"
            actor = client.dep.handles[home]
            sreq = StreamRequest(key, int(req.user), np.asarray(req.prompt_ids + tuple(h.generated), np.int64),
                                 req.max_tokens - len(h.generated), req.sampling, len(h.generated), req.logprobs,
                                 tuple(sorted(self.eos)), self.dep.context_length, req.allow_degraded, req.exact,
                                 req.budget, req.explain, req.budget_mix)
            try:
                ray.get(actor.stream_start.remote(sreq), timeout=CALL_SLACK_S)
                have = 0
                while True:
                    if h.cancelled:
                        actor.stream_cancel.remote(key)
                        h.end(Finished("cancelled", self._stats(h, home, totals, attempt)))
                        return
                    r = ray.get(actor.stream_poll.remote(key, have, POLL_S, self._seen(home)),
                                timeout=POLL_S + CALL_SLACK_S)
                    have += len(r["tokens"])
                    self._count_home_events(home, r.get("membership"))
                    reason = self._take(h, r["tokens"], stream, pending, r.get("explain"))
                    if reason is None and r["done"] and r["error"] is None:
                        reason = r["reason"] or "length"
                    if r.get("stats"):
                        _add(totals, r["stats"])
                    if reason is not None:
                        if not r["done"]:  # a stop string: the home need not go on; its counts so far
                            try:
                                _add(totals, ray.get(actor.stream_cancel.remote(key), timeout=CALL_SLACK_S) or {})
                            except Exception:  # noqa: BLE001 - the text is whole; only this home's counts are lost
                                pass
                        self._finish(h, reason, stream, pending, home, totals, attempt)
                        return
                    if r["error"] is not None:
                        status, message = r["error"]
                        h.end(Failed(int(status), message))
                        return
            except (EdgeMoEError, ray.exceptions.RayTaskError) as exc:
                if "is unknown here" not in str(exc):  # a refusal of this request, not a failed home
                    h.end(Failed(503, f"the ray deployment refused the request: {_message(exc)}"))
                    return
                last = exc  # the home restarted and forgot the stream: resume elsewhere
                client._exclude_home(home, exc)
            except Exception as exc:  # noqa: BLE001 - the home died, or did not answer in time: fail over
                last = exc
                client._exclude_home(home, exc)
                try:  # a home that is only slow stops the stream too (else its orphan timeout does)
                    actor.stream_cancel.remote(key)
                except Exception:  # noqa: BLE001 - gone
                    pass
        h.end(Failed(503, f"request {req.request_id} failed on {client.max_attempts} homes; last: {_message(last)}"))

    def _take(self, h: _Request, tokens: list, stream: TextStream, pending: list, explain: list | None = None) -> str | None:
        """Add new tokens [(token, logprob, top)] to h, sending text as it forms; returns a finish reason
        ("stop" at EOS or a stop string, "length" at max_tokens) or None. explain: per token, the home's slot
        records per layer (explained requests)."""
        now = time.perf_counter()
        piece = ""
        for i, (tok, logprob, top) in enumerate(tokens):
            tok = int(tok)
            if explain is not None:
                h.explain.append({"token": tok, "text": self.tokenizer.decode([tok]), "layers": explain[i]})
            h.generated.append(tok)
            h.token_times.append(now)
            if self.telemetry is not None:
                self.telemetry.token(h, now)
            if tok in self.eos:
                self._send(h, piece, pending)
                return "stop"
            pending.append(TokenInfo(tok, logprob, [tuple(x) for x in top]))
            piece += stream.add(tok)
            if stream.stopped_at is not None:
                self._send(h, piece, pending)
                return "stop"
            if len(h.generated) >= h.req.max_tokens:
                self._send(h, piece, pending)
                return "length"
        self._send(h, piece, pending)
        return None

    @staticmethod
    def _send(h: _Request, piece: str, pending: list) -> None:
        if piece and not h.done:
            h.sink(Delta(piece, list(pending)))
            pending.clear()

    def _finish(self, h: _Request, reason: str, stream: TextStream, pending: list, home: int, totals: dict,
                attempt: int) -> None:
        piece = stream.finish()
        if (piece or pending) and not h.done:
            h.sink(Delta(piece, list(pending)))
            pending.clear()
        stats = self._stats(h, home, totals, attempt)
        if h.end(Finished(reason, stats)) and self.telemetry is not None:
            tele = self.telemetry
            tele.finished(h, reason)
            for k in SLOT_KINDS:
                if stats["expert_slots"].get(k):
                    tele.slot_count.labels(policy=self.policy_name, kind=k).inc(stats["expert_slots"][k])
            for n, c in enumerate(totals.get("node_slots", [])):
                if c:
                    tele.node_calls.labels(node=self.ctx.node_names[n]).inc(c)
            if stats["budget_spent"]:
                tele.budget.labels(policy=self.policy_name).inc(stats["budget_spent"])
            if stats["remote_bytes"]:
                tele.remote_bytes.inc(stats["remote_bytes"])

    def _stats(self, h: _Request, home: int, totals: dict, attempt: int) -> dict:
        req = h.req
        t = np.asarray(h.token_times)
        gaps = np.diff(t) if len(t) > 1 else np.zeros(0)
        slots = dict.fromkeys((*SLOT_KINDS, "slots", "degraded"), 0)
        slots.update(totals.get("expert_slots", {}))
        out = {
            "request_id": req.request_id, "backend": "ray", "user": self.ctx.user_names[req.user],
            "home": self.ctx.node_names[home], "policy": "exact" if req.exact else self.policy_name,
            "seed": req.sampling.seed, "failovers": attempt, "expert_slots": slots, "allow_degraded": req.allow_degraded,
            "budget_spent": float(totals.get("budget_spent", 0.0)),
            "budget_granted": float(totals.get("budget_granted", 0.0)), "remote_bytes": int(totals.get("remote_bytes", 0)),
            "node_slots": dict(zip(self.ctx.node_names, (int(x) for x in totals.get("node_slots", [])), strict=False)),
            "modelled_ms_per_token": None,
            "measured": {"queue_ms": None, "ttft_ms": 1e3 * (t[0] - h.submitted) if len(t) else None,
                         "ms_per_token": 1e3 * float(gaps.mean()) if len(gaps) else None},
        }
        if req.explain:
            out["explain"] = list(h.explain)
        return out

    # ---- membership metrics -----------------------------------------------------------------------
    def _seen(self, home: int) -> tuple[int, int]:
        """(process id, events counted) of `home`'s membership events: what its next poll need not send again."""
        with self._lock:
            return self._events_seen.get(home, (0, 0))

    def _count_home_events(self, home: int, info: dict | None) -> None:
        """A home's exclusions and readmissions of servers that this ingress has not counted -> counters. One
        entry per home (its latest process): a restarted home's events count from its own start."""
        if info is None:
            return
        pid, total = int(info["pid"]), int(info["total"])
        with self._lock:
            old_pid, seen = self._events_seen.get(home, (0, 0))
            if old_pid == pid and total <= seen:  # concurrent polls of one home: these events are counted
                return
            self._events_seen[home] = (pid, total)
        if self.telemetry is None:
            return
        events = info["events"]  # those after the count this poll sent (a concurrent poll may have counted some)
        new = events[max(len(events) - (total - seen if old_pid == pid else total), 0):]
        for kind, n in new:
            self.telemetry.membership_event(f"home {self.ctx.node_names[home]}", kind, self.ctx.node_names[n])

    def _sync_ingress_events(self) -> None:
        """The ingress's own exclusions and readmissions of homes -> counters (called before each scrape)."""
        with self._lock:
            new, self._ingress_seen = self.client.homes.events_since(self._ingress_seen)
        for _, kind, n in new:
            self.telemetry.membership_event("ingress", kind, self.ctx.node_names[n])

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _add(totals: dict, stats: dict) -> None:
    """Add one attempt's home counts to the request's totals."""
    if not stats:
        return
    slots = totals.setdefault("expert_slots", {})
    for k, v in stats["expert_slots"].items():
        slots[k] = slots.get(k, 0) + int(v)
    node = np.asarray(stats["node_slots"], np.int64)
    totals["node_slots"] = (np.asarray(totals["node_slots"]) + node).tolist() if "node_slots" in totals else node.tolist()
    totals["budget_spent"] = totals.get("budget_spent", 0.0) + float(stats["budget_spent"])
    totals["budget_granted"] = totals.get("budget_granted", 0.0) + float(stats.get("budget_granted", 0.0))
    totals["remote_bytes"] = totals.get("remote_bytes", 0) + int(stats["remote_bytes"])


def _message(exc: BaseException | None) -> str:
    """The first line of an error's own message (Ray's task errors carry the remote traceback)."""
    if exc is None:
        return "no attempt made"
    text = str(getattr(exc, "cause", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
