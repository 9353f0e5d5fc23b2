"""Link emulation: each node pair's latency and bandwidth applied where the bytes move.

On one machine every "edge server" is a local process, so a hidden state crosses a Unix socket in
microseconds. `LinkTable.hold(...)` makes the transfer take as long as the cluster file says, at the
point where the bytes are handed over: the receiving server sleeps for the inbound leg before it
computes, and the sending server sleeps for the outbound leg before it answers. On a real cluster the
table is built with `enabled=False` and the network supplies the delay itself.

One message over the path a -> b of B bytes takes `lat_s[a, b] + B / bw_Bps[a, b]` (the closure's
path latency and bottleneck bandwidth, the simulator's `transfer_s`). Rows that reach a server from
several sources in one call are parallel messages, so the call waits for the slowest of them.
Links carry no contention (as in the simulator): concurrent transfers on one link do not slow each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinkTable:
    """Emulated links between N nodes."""

    lat_s: np.ndarray  # [N, N] one-way latency, 0 on the diagonal
    bw_Bps: np.ndarray  # [N, N] bandwidth in bytes/s, inf on the diagonal
    enabled: bool = True

    @classmethod
    def from_context(cls, ctx, enabled: bool = True) -> LinkTable:
        return cls(np.asarray(ctx.lat_s, float), np.asarray(ctx.bw_Bps, float), enabled)

    def transfer_s(self, src: np.ndarray, dst: np.ndarray, nbytes) -> np.ndarray:
        """[M] seconds of messages src [M] -> dst [M] of nbytes [M] (0 where src == dst)."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        nbytes = np.broadcast_to(np.asarray(nbytes, float), src.shape)
        t = self.lat_s[src, dst] + nbytes / self.bw_Bps[src, dst]
        return np.where(src == dst, 0.0, t)

    def leg_s(self, src: np.ndarray, dst: np.ndarray, row_bytes: int) -> tuple[float, int]:
        """(seconds, bytes) of one call's leg: rows src [R] -> dst [R], each row_bytes long.

        Rows sharing a (src, dst) pair form one message; distinct pairs travel in parallel, so the leg
        lasts as long as its slowest message. Bytes count only rows that cross a link (src != dst).
        """
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        cross = src != dst
        if not cross.any():
            return 0.0, 0
        pairs, counts = np.unique(np.stack([src[cross], dst[cross]]), axis=1, return_counts=True)
        seconds = self.transfer_s(pairs[0], pairs[1], counts * row_bytes)
        return float(seconds.max()), int(cross.sum()) * int(row_bytes)

    def hold(self, src: np.ndarray, dst: np.ndarray, row_bytes: int) -> tuple[float, int]:
        """Apply one leg: sleep its duration (when enabled); return (seconds emulated, bytes moved)."""
        seconds, nbytes = self.leg_s(src, dst, row_bytes)
        if self.enabled and seconds > 0:
            sleep_until(time.perf_counter() + seconds)
        return (seconds if self.enabled else 0.0), nbytes


def sleep_until(deadline: float) -> None:
    """Sleep to a perf_counter deadline; the last ~1 ms is spun out in short sleeps so that the
    emulated delay does not inherit the scheduler's oversleep."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left - 1e-3 if left > 2e-3 else min(left, 2e-4))
