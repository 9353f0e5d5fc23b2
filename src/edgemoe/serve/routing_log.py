"""`edgemoe serve --log-routing FILE`: the routing of the requests served, in the trace format that
`edgemoe profile --trace` reads (docs/traces.md), so a deployment can be re-planned from its own traffic.

One line per token row and MoE layer, with the model's own routing (before any policy decision):
`req_id` (the server's request id), `token_idx` (the token's position in its request: prompt tokens
0..S-1, then each generated token as it is fed back), `layer` (the model's block index), `topk_ids`,
`topk_weights`, `router_logits` and `domain` (the cluster user's domain). A server appends to the file (a
gzip member per run when the name ends in .gz); request ids carry the run's random tag, so runs never mix.
"""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import numpy as np

from edgemoe.io import file_target

DECIMALS = 4  # as edgemoe.profile.trace.write_trace rounds


class RoutingLog:
    """Appends trace lines. layer_ids: [L] the model's block index of each MoE layer."""

    def __init__(self, path: str | Path, model: str, layer_ids):
        target = file_target(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fresh = not target.exists() or target.stat().st_size == 0
        self.path = target
        self.layer_ids = [int(x) for x in layer_ids]
        self._f = gzip.open(target, "at", encoding="utf-8") if target.suffix == ".gz" else open(target, "a", encoding="utf-8")
        self._lock = threading.Lock()
        if fresh:
            self._f.write(json.dumps({"type": "meta", "model": model}) + "\n")

    def write(self, req_ids, token_idx, domains, topk: np.ndarray, gates: np.ndarray, logits: np.ndarray | None) -> None:
        """One pass's rows: req_ids, token_idx, domains [T]; topk, gates [T, L, K]; logits [T, L, E] or None."""
        lines = []
        for t in range(topk.shape[0]):
            for j, layer in enumerate(self.layer_ids):
                d = {"type": "route", "req_id": str(req_ids[t]), "token_idx": int(token_idx[t]), "layer": layer,
                     "topk_ids": [int(e) for e in topk[t, j]],
                     "topk_weights": [round(float(w), DECIMALS) for w in gates[t, j]]}
                if logits is not None:
                    d["router_logits"] = [round(float(x), DECIMALS) for x in logits[t, j]]
                d["domain"] = str(domains[t])
                lines.append(json.dumps(d, separators=(",", ":")) + "\n")
        with self._lock:
            self._f.writelines(lines)
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            self._f.close()
