"""Measured (Ray) vs replayed simulation per method, from the Ray demo's results files.

    edgemoe demo --backend ray --quick --out bench/results/demo-ray   # regenerates the files
    python -m bench.ray.ray_demo_table [bench/results/demo-ray]

Per method: measured mean / p99 (nominal ms), the simulator's replay of the very requests Ray ran, their
ratios, the dilation k, host lateness, host CPU and Ray cores, validity; then whether the methods' order by
mean is the same in both (pairs whose simulated means are within 1% of each other count as ties).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TIE = 0.01


def table(doc: dict) -> tuple[list[str], bool]:
    lines = ["| method | measured mean ms | simulated mean ms | ratio | measured p99 ms | simulated p99 ms | p99 ratio | k | "
             "late | host CPU | Ray cores | valid |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for name, m in measured(doc).items():
        ray, sim = m["ray"], m["simulated"]
        rows.append((name, m["latency_ms"]["mean"], sim["latency_ms"]["mean"]))
        lines.append(f"| {name} | {m['latency_ms']['mean']:.2f} | {sim['latency_ms']['mean']:.2f} | "
                     f"{m['latency_ms']['mean'] / sim['latency_ms']['mean']:.3f} | {m['latency_ms']['p99']:.2f} | "
                     f"{sim['latency_ms']['p99']:.2f} | {m['latency_ms']['p99'] / sim['latency_ms']['p99']:.3f} | "
                     f"{ray['dilation']:.0f} | {100 * ray['late_share']:.2f}% | {100 * ray['cpu']['host_util']:.0f}% | "
                     f"{ray['cpu']['ray_cores_busy']:.2f} | {'yes' if ray['valid'] else 'no'} |")
    # Same ranking: no pair of methods in the opposite order, except pairs the simulation itself puts within
    # TIE of each other (their order is noise in both backends).
    flips = [(a[0], b[0]) for i, a in enumerate(rows) for b in rows[i + 1:]
             if (a[1] - b[1]) * (a[2] - b[2]) < 0 and abs(a[2] - b[2]) > TIE * min(a[2], b[2])]
    return lines, flips


def measured(doc: dict) -> dict:
    """The methods Ray measured (the oracle and the budget sweep stay simulated: `ray_skipped` says why)."""
    return {name: m for name, m in doc["methods"].items() if "ray" in m}


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "results" / "demo-ray")
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("config", {}).get("backend") != "ray":
            continue
        lines, flips = table(doc)
        ties = "pairs within 1% in the simulation count as ties"
        worst = max(abs(m["latency_ms"]["mean"] / m["simulated"]["latency_ms"]["mean"] - 1) for m in measured(doc).values())
        print(f"\n{doc['config']['name']} ({doc['config']['cluster']}, {doc['config']['mode']} mode): worst mean error "
              f"{100 * worst:.1f}%, ranking by mean {'the same' if not flips else f'DIFFERENT {flips}'} ({ties})")
        print("\n".join(lines))
        skipped = {n: m.get("ray_skipped", "") for n, m in doc["methods"].items() if "ray" not in m}
        if skipped:
            print("\nsimulated only: " + "; ".join(f"{n} ({why})" for n, why in skipped.items()))


if __name__ == "__main__":
    main()
