"""The policy's own decision time, charged as CPU time at the home (docs/runtime.md, "Decision time").

A layer's decision for a pass (its rows, decided together at their home) costs the home's CPU
`DecisionCost.seconds(rows)` = fixed_s + per_row_s x rows. The backends charge it after the layer's dense
work, in the same FIFO stage on the home's backbone queue (the decision needs the router's output and the
experts need the decision), so a slow policy pays for its slowness in every latency it reports. The
charge comes from this model, never from a clock read during the run: the simulator stays deterministic.

Where the model comes from: `bench/speed/policies.py` times every policy's `decide` at 1 and 64 rows per
call (CPU seconds of the benchmark process, on the benchmark's host: an assumption, the edge home's CPU is
taken to be as fast as that host) and writes the two-point fit per policy to
`edgemoe/assets/decision_cost.json` (with the commit and the load it was measured on).

Off by default: a policy's `decision_cost` is None (no charge) until `charge_decisions` sets it, so runs
made without it keep their numbers. The Ray backend charges a DecisionCost given as
`ServerConfig.decision_cost` the same way, where it emulates nominal time (`distributed/layer_step.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.io import read_json

DEFAULT_PATH = Path(__file__).resolve().parents[1] / "assets" / "decision_cost.json"


@dataclass(frozen=True)
class DecisionCost:
    """Seconds of one decide call for `rows` token rows: fixed_s + per_row_s x rows."""

    fixed_s: float
    per_row_s: float

    def __post_init__(self):
        for name in ("fixed_s", "per_row_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise EdgeMoEError(f"DecisionCost.{name} must be a finite number >= 0 (seconds), got {v!r}")

    def seconds(self, rows) -> np.ndarray:
        """Seconds of calls of `rows` (int or [P] ints) rows each; 0 for a call of no rows."""
        rows = np.asarray(rows, dtype=float)
        return np.where(rows > 0, self.fixed_s + self.per_row_s * rows, 0.0)

    @classmethod
    def fit(cls, rows_a: int, seconds_a: float, rows_b: int, seconds_b: float) -> DecisionCost:
        """The line through two measured calls (rows_a < rows_b, seconds per call), clipped at 0 (a per-row
        cost cannot be negative; a fixed part below 0 is measurement noise)."""
        if not 0 < rows_a < rows_b:
            raise EdgeMoEError(f"DecisionCost.fit: needs 0 < rows_a < rows_b, got {rows_a}, {rows_b}")
        per_row = max((seconds_b - seconds_a) / (rows_b - rows_a), 0.0)
        return cls(fixed_s=max(seconds_a - per_row * rows_a, 0.0), per_row_s=per_row)


def policy_label(policy) -> str:
    """The benchmark's name of a policy: its name, with the look-ahead depth for ordermoe ("ordermoe(H=2)")."""
    horizon = getattr(policy, "horizon", None)
    return f"{policy.name}(H={horizon})" if policy.name == "ordermoe" and horizon is not None else policy.name


def measured_costs(path: str | Path = DEFAULT_PATH) -> dict[str, DecisionCost]:
    """{policy label: DecisionCost} from a decision-cost file (`bench/speed/policies.py` writes it)."""
    doc = read_json(path, "decision-cost file")
    costs = doc.get("costs") if isinstance(doc, dict) else None
    if not isinstance(costs, dict) or not costs:
        raise EdgeMoEError(f"{path}: expected a JSON object with a non-empty 'costs' object "
                           "{policy: {'fixed_s': s, 'per_row_s': s}}")
    out = {}
    for label, entry in costs.items():
        if not isinstance(entry, dict) or set(entry) < {"fixed_s", "per_row_s"}:
            raise EdgeMoEError(f"{path}: costs[{label!r}] must hold 'fixed_s' and 'per_row_s' (seconds)")
        try:
            out[label] = DecisionCost(float(entry["fixed_s"]), float(entry["per_row_s"]))
        except (TypeError, ValueError, EdgeMoEError) as exc:
            raise EdgeMoEError(f"{path}: costs[{label!r}]: {exc}") from None
    return out


def cost_for(policy, costs: dict[str, DecisionCost]) -> DecisionCost:
    """The policy's entry in `costs`: its own label, else the slowest measured variant of the same policy
    (e.g. an unmeasured look-ahead depth: charged as the most expensive depth measured, never less)."""
    label = policy_label(policy)
    if label in costs:
        return costs[label]
    same = [c for name, c in costs.items() if name.split("(")[0] == policy.name]
    if not same:
        raise EdgeMoEError(f"no measured decision cost for policy {label!r}; measured: {sorted(costs)} "
                           "(run bench/speed/policies.py, or pass a DecisionCost)")
    return max(same, key=lambda c: c.seconds(1)[()] + c.seconds(64)[()])


def charge_decisions(policy, cost: DecisionCost | str | Path | None = DEFAULT_PATH):
    """Turn the decision charge on for `policy` (cost: a DecisionCost, or a decision-cost file to look the
    policy up in) or off (None). Returns the policy."""
    if cost is None or isinstance(cost, DecisionCost):
        policy.decision_cost = cost
    else:
        policy.decision_cost = cost_for(policy, measured_costs(cost))
    return policy


def checked_cost(cost, owner: str) -> DecisionCost | None:
    """`cost` when it is a DecisionCost or None (not charged), else an error naming `owner`'s decision_cost."""
    if cost is not None and not isinstance(cost, DecisionCost):
        raise EdgeMoEError(f"{owner}.decision_cost must be a DecisionCost or None, got {cost!r}")
    return cost


def decision_cost_of(policy) -> DecisionCost | None:
    """The policy's decision-cost model, None when its decisions are not charged (the default)."""
    return checked_cost(getattr(policy, "decision_cost", None), type(policy).__name__)
