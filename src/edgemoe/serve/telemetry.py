"""Prometheus metrics of one server (prometheus_client), in a registry of its own so several servers (tests)
can live in one process. The engine thread updates them; `/metrics` renders them.

Membership (the Ray backend): `edgemoe_exclusions_total{by, node}` and `edgemoe_readmissions_total{by, node}` count
each exclusion and readmission of a node by its keeper (`ingress` for homes, `home <name>` for the servers a
home calls), the same events the log lines name; `edgemoe_failovers_total` counts streams moved to another home.

Tokens per second is `rate(edgemoe_generation_tokens_total[1m])` in Prometheus; the remote share is
`edgemoe_expert_slots_total{kind="remote"}` over the sum of all kinds.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from edgemoe.distributed.batching import SLOT_KINDS

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class HttpTelemetry:
    """The HTTP side's metrics (requests by endpoint and status, 429s), in a registry of their own: with the
    front in its own process (edgemoe.serve.front) they live there and the engine's families are appended."""

    def __init__(self):
        self.http_registry = CollectorRegistry()
        r = self.http_registry
        self.requests = Counter("edgemoe_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("edgemoe_rejected_requests", "requests refused at admission (queue full)", registry=r)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self, engine_text: bytes = b"") -> bytes:
        """Prometheus text: these families, then the engine's (engine_text, rendered elsewhere)."""
        return generate_latest(self.http_registry) + engine_text


class Telemetry(HttpTelemetry):
    """The server's metrics. node_names: [N] the cluster's nodes (labels of the per-node counters); policies: the
    policy labels whose series exist from the start."""

    def __init__(self, node_names, policies=("exact",)):
        super().__init__()
        self.registry = CollectorRegistry()
        r = self.registry
        self.node_names = tuple(node_names)
        self.ttft = Histogram("edgemoe_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("edgemoe_inter_token_latency_seconds", "time between a sequence's generated tokens",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("edgemoe_request_duration_seconds", "arrival to last token", buckets=LATENCY_BUCKETS_S,
                             registry=r)
        self.tokens = Counter("edgemoe_generation_tokens", "generated tokens", registry=r)
        self.prompt_tokens = Counter("edgemoe_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.running = Gauge("edgemoe_running_sequences", "sequences in the running batch", registry=r)
        self.queued = Gauge("edgemoe_queued_sequences", "sequences waiting to join the batch", registry=r)
        self.batch = Histogram("edgemoe_batch_size", "sequences per forward pass", buckets=BATCH_BUCKETS, registry=r)
        self.step_s = Histogram("edgemoe_step_seconds", "wall seconds of one forward pass", buckets=LATENCY_BUCKETS_S,
                                registry=r)
        self.slot_count = Counter("edgemoe_expert_slots", "expert slots by policy and what happened to them "
                                  "(local, remote, substituted, dropped, zeroed)", ["policy", "kind"], registry=r)
        self.node_calls = Counter("edgemoe_node_expert_slots", "expert slots each node ran (as the policy decided)",
                                  ["node"], registry=r)
        self.budget = Counter("edgemoe_budget_spent", "quality budget spent by policy", ["policy"], registry=r)
        self.remote_bytes = Counter("edgemoe_remote_bytes", "hidden-state bytes the decisions put on the links",
                                    registry=r)
        self.finished_count = Counter("edgemoe_finished_sequences", "sequences by finish reason", ["reason"],
                                      registry=r)
        self.exclusions = Counter("edgemoe_exclusions", "nodes excluded after a failure, by who excluded them",
                                  ["by", "node"], registry=r)
        self.readmissions = Counter("edgemoe_readmissions", "excluded nodes readmitted after a probe, by who readmitted "
                                    "them", ["by", "node"], registry=r)
        self.failovers = Counter("edgemoe_failovers", "streams resumed on another home after theirs failed", registry=r)
        self.before_render = None  # a callable run before each scrape (the ray engine syncs membership events)
        for policy in policies:  # every series exists from the start (a scrape sees zeros, not gaps)
            for kind in SLOT_KINDS:
                self.slot_count.labels(policy=policy, kind=kind)
        for n in self.node_names:
            self.node_calls.labels(node=n)

    # ---- engine hooks (engine thread) ----------------------------------------------------------
    def load(self, running: int, queued: int) -> None:
        self.running.set(running)
        self.queued.set(queued)

    def step(self, batch: int, seconds: float) -> None:
        self.batch.observe(batch)
        self.step_s.observe(seconds)

    def slots(self, policy: str, kind: np.ndarray, node: np.ndarray, spent: float, nbytes: int) -> None:
        """kind [T, K] index into SLOT_KINDS; node [T, K] node running each slot (-1: none)."""
        counts = np.bincount(kind.ravel(), minlength=len(SLOT_KINDS))
        for i, k in enumerate(SLOT_KINDS):
            if counts[i]:
                self.slot_count.labels(policy=policy, kind=k).inc(int(counts[i]))
        ran = node[node >= 0]
        for n, c in enumerate(np.bincount(ran, minlength=len(self.node_names))):
            if c:
                self.node_calls.labels(node=self.node_names[n]).inc(int(c))
        if spent:
            self.budget.labels(policy=policy).inc(spent)
        if nbytes:
            self.remote_bytes.inc(nbytes)

    def token(self, seq, now: float) -> None:
        self.tokens.inc()
        if len(seq.token_times) == 1:
            self.ttft.observe(now - seq.submitted)
            self.prompt_tokens.inc(len(seq.req.prompt_ids))
        else:
            self.itl.observe(now - seq.token_times[-2])

    def finished(self, seq, reason: str) -> None:
        self.finished_count.labels(reason=reason).inc()
        if seq.token_times:
            self.e2e.observe(seq.token_times[-1] - seq.submitted)

    def membership_event(self, by: str, kind: str, node: str) -> None:
        """One exclusion ("excluded") or readmission ("readmitted") of `node` by `by`."""
        (self.exclusions if kind == "excluded" else self.readmissions).labels(by=by, node=node).inc()

    # ---- rendering ------------------------------------------------------------------------------
    def render_engine(self) -> bytes:
        """The engine's families only (the front process asks for these)."""
        if self.before_render is not None:
            self.before_render()
        return generate_latest(self.registry)

    def render(self, engine_text: bytes | None = None) -> bytes:
        return super().render(self.render_engine() if engine_text is None else engine_text)
