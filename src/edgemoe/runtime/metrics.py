"""Run metrics: what every backend reports per method (definitions in docs/runtime.md, "Metrics").

`DecisionTally` counts what the decisions did (remote, substituted and dropped slots, bytes on the wire,
budget); backends feed it every `Decision`. `RunMetrics` is the summary of one run; `method_entry` turns
it into one method of the results file (edgemoe.results).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


def latency_summary_ms(seconds) -> dict:
    """{"mean", "p50", "p95", "p99"} in milliseconds of a sample in seconds (NaN for an empty sample)."""
    x = np.asarray(seconds, dtype=float).ravel()
    if x.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    return {"mean": float(x.mean() * 1e3), "p50": float(p50 * 1e3), "p95": float(p95 * 1e3), "p99": float(p99 * 1e3)}


def decision_bytes(dec, layer, num_layers: int, home: np.ndarray, wire_bytes: int) -> np.ndarray:
    """[T] bytes one layer's decision puts on the wire (one hidden state = wire_bytes per leg).

    Legs: the token's node -> each slot's node (when different); each slot's node -> the meeting node (when
    different); after the last layer, the meeting node -> home (migrate mode). In home mode this is 2 x
    wire_bytes per remote slot, the accounting of ARCHITECTURE.md.
    """
    ran = dec.node >= 0
    out_leg = ran & (dec.node != dec.location[:, None])
    back_leg = ran & (dec.node != dec.next_location[:, None])
    legs = out_leg.sum(axis=1) + back_leg.sum(axis=1)
    last = np.asarray(layer) == num_layers - 1  # layer: int or [T]
    legs = legs + (last & (dec.next_location != home))
    return legs.astype(np.int64) * int(wire_bytes)


@dataclass
class DecisionTally:
    """Running counts over decisions, split by prefill (prompt rows) and decode (generated rows)."""

    num_layers: int
    wire_bytes: int
    slots: int = 0
    remote: int = 0
    substituted: int = 0
    dropped: int = 0  # slots not run (dropped and renormalised, or zeroed)
    zeroed: int = 0  # of those, zeroed
    token_layers: int = 0
    quality_cost: float = 0.0
    prefill_bytes: int = 0
    decode_bytes: int = 0
    prefill_tokens: int = 0  # rows that finished the last layer
    decode_tokens: int = 0

    def add(self, dec, topk: np.ndarray, layer, home: np.ndarray, prefill) -> None:
        """Count one decision for T rows. layer: int or [T]; topk: [T, K]; home: [T]; prefill: bool or [T] bool."""
        T = dec.experts.shape[0]
        prefill = np.broadcast_to(np.asarray(prefill, dtype=bool), (T,))
        self.slots += int(dec.experts.size)
        self.remote += int(dec.remote.sum())
        self.substituted += int(dec.substituted(np.asarray(topk)).sum())
        self.dropped += int(dec.dropped.sum())
        if getattr(dec, "zeroed", None) is not None:
            self.zeroed += int(dec.zeroed.sum())
        self.token_layers += T
        self.quality_cost += float(dec.quality_cost.sum())
        nbytes = decision_bytes(dec, layer, self.num_layers, home, self.wire_bytes)
        self.prefill_bytes += int(nbytes[prefill].sum())
        self.decode_bytes += int(nbytes[~prefill].sum())
        last = np.broadcast_to(np.asarray(layer) == self.num_layers - 1, (T,))
        n_pre = int((last & prefill).sum())
        self.prefill_tokens += n_pre
        self.decode_tokens += int(last.sum()) - n_pre

    def ratios(self) -> dict:
        ran = max(self.slots - self.dropped, 1)
        slots = max(self.slots, 1)
        return {"remote_ratio": self.remote / ran, "substitution_ratio": self.substituted / slots,
                "drop_ratio": self.dropped / slots, "zero_ratio": self.zeroed / slots}

    def traffic_per_1k(self) -> dict:
        def per_1k(nbytes: int, tokens: int) -> float:
            return 1000.0 * nbytes / tokens if tokens else 0.0

        return {
            "traffic_bytes_per_1k_tokens": per_1k(self.prefill_bytes + self.decode_bytes, self.prefill_tokens + self.decode_tokens),
            "traffic_prefill_bytes_per_1k_tokens": per_1k(self.prefill_bytes, self.prefill_tokens),
            "traffic_decode_bytes_per_1k_tokens": per_1k(self.decode_bytes, self.decode_tokens),
        }


@dataclass(frozen=True)
class RunMetrics:
    """Summary of one run of one method. Latencies in ms, traffic in bytes per 1000 tokens."""

    latency_ms: dict  # per generated token (decode step): mean, p50, p95, p99
    ttft_ms: dict  # time to first token (arrival -> end of the prefill pass)
    throughput_tokens_per_s: float  # generated tokens / makespan
    traffic_bytes_per_1k_tokens: float  # all bytes per 1000 tokens through the model (prompt + generated)
    traffic_prefill_bytes_per_1k_tokens: float
    traffic_decode_bytes_per_1k_tokens: float
    remote_ratio: float  # remote slots / slots that ran
    substitution_ratio: float  # substituted slots / all slots
    drop_ratio: float
    utilisation: dict  # node name -> busy time / makespan
    budget_used: float  # mean quality cost per token-layer
    budget_used_fraction: float | None  # quality cost spent / budget granted (None when no budget)
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    token_layers: int = 0
    makespan_s: float = 0.0
    extra: dict = field(default_factory=dict)
    zero_ratio: float = 0.0  # zeroed slots / all slots (included in drop_ratio)

    def to_dict(self) -> dict:
        return asdict(self)


def method_entry(metrics: RunMetrics, placement: str, policy: str, ppl: float | None = None,
                 quality_retention: float | None = None, **extra) -> dict:
    """One entry of results["methods"] (schema edgemoe.results/1), with the optional fields after the required."""
    d = metrics.to_dict()
    entry = {
        "placement": placement, "policy": policy, "latency_ms": d["latency_ms"], "ttft_ms": d["ttft_ms"],
        "traffic_bytes_per_1k_tokens": d["traffic_bytes_per_1k_tokens"], "remote_ratio": d["remote_ratio"],
        "substitution_ratio": d["substitution_ratio"], "ppl": ppl, "quality_retention": quality_retention,
        "throughput_tokens_per_s": d["throughput_tokens_per_s"],
    }
    for key in ("traffic_prefill_bytes_per_1k_tokens", "traffic_decode_bytes_per_1k_tokens", "drop_ratio", "zero_ratio",
                "utilisation", "budget_used", "budget_used_fraction", "requests", "prompt_tokens",
                "generated_tokens", "token_layers", "makespan_s"):
        entry[key] = d[key]
    entry.update(d["extra"])
    entry.update(extra)
    return entry
