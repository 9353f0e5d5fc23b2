"""Emulated hardware: nominal time, link legs and each node's virtual accelerator (deadlines, not sleeps).

On one machine every "edge server" is a local process: a hidden state crosses a Unix socket in
microseconds and an expert runs at host speed, phone and H200 alike. The runtime therefore emulates the
cluster file's hardware with the simulator's own cost model, as deadlines on a machine-wide clock:

- the sender stamps each expert call with its send time `sent` (nominal seconds);
- every row (one hidden state) arrives at `sent + xfer_s[src, dst]` (latency + wire bytes / bandwidth,
  the closure's path, `RuntimeContext.xfer_s`); rows travel in parallel, without contention, exactly
  as the simulator charges them;
- the callee waits until the arrival, then queues the row on its node's FIFO `VirtualAccelerator`:
  `start = max(arrival, free_at)`, `end = start + roofline seconds` of the node's nominal hardware
  (`RuntimeContext.call_s`; rows of one call for the same expert share one batched call, split evenly);
- the row's output is ready at the meeting node at `end + xfer_s[node, meet]`; the caller waits until
  the latest ready time of its layer, which is when the layer ends.

Real CPU work still produces every output, but it never sets the clock: it only has to finish before
the deadline it serves. `Clock` turns nominal seconds into waits. In `real` mode nominal time is the
machine-wide monotonic clock divided by the dilation k (every emulated delay lasts k times longer in wall
time, so the host's own overheads shrink k-fold relative to it); in `virtual` mode nothing waits and every
time is pure arithmetic, which makes a run's emulated times exactly the simulator's (tested).

On a real cluster (`emulate=False`) no delay is added: arrival, start and end are the real times.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np

CLOCKS = ("real", "virtual")


@dataclass(frozen=True)
class Clock:
    """Nominal time. real: monotonic seconds / dilation, waits sleep; virtual: now() is -inf, waits return."""

    mode: str = "real"
    dilation: float = 1.0

    def __post_init__(self):
        if self.mode not in CLOCKS:
            raise ValueError(f"clock mode {self.mode!r}; expected one of {CLOCKS}")
        if not (self.dilation >= 1.0 and math.isfinite(self.dilation)):
            raise ValueError(f"dilation must be a finite number >= 1, got {self.dilation}")

    @property
    def virtual(self) -> bool:
        return self.mode == "virtual"

    def now(self) -> float:
        """Nominal seconds now (machine-wide: CLOCK_MONOTONIC is shared by every process)."""
        return -math.inf if self.virtual else time.monotonic() / self.dilation

    def stamp(self, deadline: float) -> float:
        """The nominal time of an event due at `deadline`: the deadline, or now if the host is late."""
        return max(self.now(), float(deadline))

    def wait_until(self, deadline: float) -> None:
        if not self.virtual and math.isfinite(deadline):
            sleep_until(float(deadline) * self.dilation)


def sleep_until(deadline: float) -> None:
    """Sleep to a time.monotonic() deadline; the last ~1 ms is spun out in short sleeps so that the
    emulated delay does not inherit the scheduler's oversleep."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(left - 1e-3 if left > 2e-3 else min(left, 2e-4))


@dataclass(frozen=True)
class LinkTable:
    """Emulated links between N nodes: seconds of one row (one hidden state on the wire) per pair."""

    xfer_s: np.ndarray  # [N, N] seconds of one row src -> dst, 0 on the diagonal
    row_bytes: int  # bytes of one row on the wire
    enabled: bool = True

    @classmethod
    def from_context(cls, ctx, row_bytes: int, enabled: bool = True) -> LinkTable:
        """The simulator's transfer table for rows of `row_bytes` (latency + bytes / bandwidth)."""
        from edgemoe.cluster.cost import transfer_s

        xfer = np.array(transfer_s(int(row_bytes), ctx.lat_s, ctx.bw_Bps), float)
        if int(row_bytes) == ctx.wire_bytes:
            xfer = np.array(ctx.xfer_s, float)  # the very numbers the simulator adds
        np.fill_diagonal(xfer, 0.0)
        xfer.setflags(write=False)
        return cls(xfer, int(row_bytes), enabled)

    def legs_s(self, src, dst) -> np.ndarray:
        """[R] seconds of rows src [R] -> dst [R] (0 where src == dst or links are off)."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        return self.xfer_s[src, dst] if self.enabled else np.zeros(src.shape)

    def bytes_moved(self, src, dst) -> int:
        """Bytes of the rows src [R] -> dst [R] that cross a link."""
        return int((np.asarray(src) != np.asarray(dst)).sum()) * self.row_bytes


class VirtualAccelerator:
    """One node's nominal hardware as a FIFO queue (thread safe): jobs in the order they are served."""

    def __init__(self):
        self._lock = threading.Lock()
        self.free_at = -math.inf
        self.busy_s = 0.0

    def serve(self, arrival: np.ndarray, service: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
        """Queue jobs arrival [J] / service [J] (already in arrival order) -> (start [J], end [J], free_at after)."""
        start, end = np.empty(len(arrival)), np.empty(len(arrival))
        with self._lock:
            free = self.free_at
            for j in range(len(arrival)):
                s = max(float(arrival[j]), free)
                free = s + float(service[j])
                start[j], end[j] = s, free
                self.busy_s += float(service[j])
            self.free_at = free
        return start, end, free

    def reset(self) -> None:
        with self._lock:
            self.free_at, self.busy_s = -math.inf, 0.0
