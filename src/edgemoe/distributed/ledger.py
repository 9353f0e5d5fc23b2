"""A home's record of the requests it runs one by one (`HomeEngine.generate`): checks, counters, answers kept.

A request id seen before is answered from the kept results (a retried call must not run twice: the client
retries within seconds, so the latest `keep` results cover it); the home's health reports how many requests it
started, has in flight and served.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from edgemoe.errors import EdgeMoEError

from .wire import GenerateRequest, GenerateResult


class RequestLedger:
    """Finished results by request id (the latest `keep`), and the started / in-flight / served counters."""

    def __init__(self, keep: int = 512):
        self.keep = keep
        self._lock = threading.Lock()
        self.finished: OrderedDict[str, GenerateResult] = OrderedDict()
        self.served = 0
        self.started = 0  # requests begun (not answered from the kept results)
        self.in_flight = 0

    def replay(self, request_id: str) -> GenerateResult | None:
        """The kept result of a request id seen before (marked replayed), or None."""
        with self._lock:
            done = self.finished.get(request_id)
        return None if done is None else replace(done, replayed=True)

    @staticmethod
    def check(req: GenerateRequest, num_users: int, virtual: bool) -> float:
        """Refuse a request this home cannot run (EdgeMoEError naming it); returns its nominal arrival
        (submit_s, which the virtual clock needs; nan: now)."""
        if not 0 <= req.user < num_users:
            raise EdgeMoEError(f"request {req.request_id}: user {req.user} outside [0, {num_users})")
        if req.gen_tokens < 1 or len(req.prompt) < 1:
            raise EdgeMoEError(f"request {req.request_id}: needs a prompt and gen_tokens >= 1")
        if virtual and not np.isfinite(req.submit_s):
            raise EdgeMoEError(f"request {req.request_id}: the virtual clock needs submit_s (the nominal arrival)")
        return float(req.submit_s)

    @contextmanager
    def running(self):
        """Count a request as started and in flight while it runs."""
        with self._lock:
            self.started += 1
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def record(self, result: GenerateResult) -> GenerateResult:
        """Keep a finished result (the oldest beyond `keep` are forgotten) and count it served."""
        with self._lock:
            self.finished[result.request_id] = result
            while len(self.finished) > self.keep:
                self.finished.popitem(last=False)
            self.served += 1
        return result
