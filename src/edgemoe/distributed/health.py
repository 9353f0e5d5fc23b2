"""Which servers a home may call: failures exclude a server, probes with exponential backoff readmit it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("edgemoe.distributed")
EVENTS_KEPT = 256  # exclusions and readmissions a Membership remembers (the latest; `event_total` counts them all)


@dataclass(frozen=True)
class Backoff:
    """Probe schedule of an excluded server: first after `base_s`, doubling per failed probe, capped."""

    base_s: float = 0.25
    max_s: float = 4.0

    def delay_s(self, failures: int) -> float:
        return float(min(self.base_s * 2.0 ** max(failures - 1, 0), self.max_s))


class Membership:
    """alive [N] plus a version that changes whenever a server leaves or rejoins (thread safe).

    Each exclusion and readmission is one log line (logger `edgemoe.distributed`, WARNING and INFO) naming
    the node: `names` [N] its names, `owner` who keeps this view (e.g. "home b", "ingress"). `events` holds the
    latest EVENTS_KEPT of them (a server that flaps for days must not grow the view); `event_total` counts every
    one, so a reader that remembers how many it has seen takes only the new ones (`events_since`)."""

    def __init__(self, num_nodes: int, backoff: Backoff | None = None, names=None, owner: str = ""):
        self.names = tuple(names) if names is not None else tuple(f"node {n}" for n in range(num_nodes))
        self.owner = owner
        self._lock = threading.Lock()
        self.alive = np.ones(num_nodes, bool)
        self.failures = np.zeros(num_nodes, np.int64)
        self.next_probe = np.zeros(num_nodes)
        self.version = 0
        self.backoff = backoff or Backoff()
        self.events: deque[tuple[float, str, int]] = deque(maxlen=EVENTS_KEPT)  # (time, "excluded" | "readmitted", node)
        self.event_total = 0  # events ever recorded (`events` keeps the latest EVENTS_KEPT)
        self.wakeup = threading.Event()  # set by exclude(): the prober has work

    def snapshot(self) -> tuple[np.ndarray, int]:
        with self._lock:
            return self.alive.copy(), self.version

    def exclude(self, node: int, now: float | None = None, why: str = "") -> None:
        """A call to `node` failed or timed out: stop using it and schedule a probe."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.failures[node] += 1
            self.next_probe[node] = now + self.backoff.delay_s(int(self.failures[node]))
            changed = bool(self.alive[node])
            if changed:
                self.alive[node] = False
                self.version += 1
                self._event(now, "excluded", node)
        if changed:
            log.warning("%sexcluded %s%s; probing it with backoff", self._who(), self.names[node],
                        f" ({why})" if why else "")
        self.wakeup.set()

    def readmit(self, node: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.failures[node] = 0
            changed = not self.alive[node]
            if changed:
                self.alive[node] = True
                self.version += 1
                self._event(now, "readmitted", node)
        if changed:
            log.info("%sreadmitted %s: it answered a probe", self._who(), self.names[node])

    def _event(self, now: float, kind: str, node: int) -> None:  # with the lock held
        self.events.append((now, kind, int(node)))
        self.event_total += 1

    def events_since(self, seen: int) -> tuple[list[tuple[float, str, int]], int]:
        """The events after the first `seen` ever recorded (those still kept: at most EVENTS_KEPT), and the total
        to remember for the next call."""
        with self._lock:
            new = max(min(self.event_total - int(seen), len(self.events)), 0)
            return list(self.events)[len(self.events) - new:], self.event_total

    def _who(self) -> str:
        return f"{self.owner}: " if self.owner else ""

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
