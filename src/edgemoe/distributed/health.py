"""Which servers a home may call: failures exclude a server, probes with exponential backoff readmit it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Backoff:
    """Probe schedule of an excluded server: first after `base_s`, doubling per failed probe, capped."""

    base_s: float = 0.25
    max_s: float = 4.0

    def delay_s(self, failures: int) -> float:
        return float(min(self.base_s * 2.0 ** max(failures - 1, 0), self.max_s))


class Membership:
    """alive [N] plus a version that changes whenever a server leaves or rejoins (thread safe)."""

    def __init__(self, num_nodes: int, backoff: Backoff | None = None):
        self._lock = threading.Lock()
        self.alive = np.ones(num_nodes, bool)
        self.failures = np.zeros(num_nodes, np.int64)
        self.next_probe = np.zeros(num_nodes)
        self.version = 0
        self.backoff = backoff or Backoff()
        self.events: list[tuple[float, str, int]] = []  # (time, "excluded" | "readmitted", node)
        self.wakeup = threading.Event()  # set by exclude(): the prober has work

    def snapshot(self) -> tuple[np.ndarray, int]:
        with self._lock:
            return self.alive.copy(), self.version

    def exclude(self, node: int, now: float | None = None) -> None:
        """A call to `node` failed or timed out: stop using it and schedule a probe."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.failures[node] += 1
            self.next_probe[node] = now + self.backoff.delay_s(int(self.failures[node]))
            if self.alive[node]:
                self.alive[node] = False
                self.version += 1
                self.events.append((now, "excluded", int(node)))
        self.wakeup.set()

    def readmit(self, node: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.failures[node] = 0
            if not self.alive[node]:
                self.alive[node] = True
                self.version += 1
                self.events.append((now, "readmitted", int(node)))

    def next_probe_in(self, now: float | None = None) -> float | None:
        """Seconds until the next excluded server's probe is due (None: nothing is excluded)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            out = self.next_probe[~self.alive]
            return float(out.min() - now) if out.size else None

    def due(self, now: float | None = None) -> list[int]:
        """Excluded servers whose next probe is due."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return [int(n) for n in np.flatnonzero(~self.alive & (self.next_probe <= now))]
