"""How long does `make test` take? Runs the Makefile's test command once and writes bench/results/test_time.json.

The command is `python -m pytest -n 3 --dist worksteal` (the Makefile's `test` target) from the repository root.
By default numba's on-disk caches of the package are removed first (`__pycache__/*.nbi`, `*.nbc` under src/),
so the run pays every compile, as CI's fresh clone does. Recorded: wall seconds, the CPU seconds of pytest and
all its children (workers, Ray, servers), the 1-minute load before and after, pytest's summary line and its
exit status. The README's test time is generated from this file (`bench.tools.tables`), never typed.

Run from the repository root: `python -m bench.tools.test_time [--keep-cache] [--out FILE]` (minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, environment
from edgemoe.io import atomic_write_json

COMMAND = [sys.executable, "-m", "pytest", "-n", "3", "--dist", "worksteal"]
TARGET_S = 240.0  # issue 21 item 4: `make test` within 4 minutes
# Three xdist workers on two cores: the session-Ray tests and the multi-node check spend most of their wall
# blocked on Ray's processes (tests/conftest.py, EDGEMOE_TEST_TIMELINE), so a third worker keeps both cores busy.


def clear_numba_cache(src: Path) -> int:
    """Remove numba's cache files under `src`; returns how many were removed."""
    files = [p for pattern in ("*.nbi", "*.nbc") for p in src.rglob(f"__pycache__/{pattern}")]
    for path in files:
        path.unlink()
    return len(files)


def summary_counts(line: str) -> dict[str, int]:
    """pytest's last line ("1235 passed, 1 xfailed in 247.1s") -> {"passed": 1235, "xfailed": 1}."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|xfailed|xpassed|skipped)", line)}


LOG = Path("runs/test_time.log")  # pytest's output of the last run
TIMELINE = Path("runs/test_time_timeline")  # tests/conftest.py writes TIMELINE.<worker> (JSON lines, not committed)


def worker_timelines(prefix: Path, start_epoch: float, top: int = 8) -> dict:
    """Per xdist worker, from the conftest's timeline files: tests run, the worker's own CPU seconds and the
    seconds it was blocked (neither on a core nor waiting for one: sleeps, waits on Ray's and other processes)
    inside tests, when its first test started and its last ended (seconds after the command started), and its
    `top` longest tests (wall, CPU, blocked)."""
    out = {}
    for path in sorted(prefix.parent.glob(prefix.name + ".gw*")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        tests = [r for r in rows if not r["id"].startswith("<")]
        if not tests:
            continue
        longest = sorted(tests, key=lambda r: r["start"] - r["end"])[:top]
        out[path.suffix[1:]] = {
            "tests": len(tests), "cpu_s": round(sum(r["cpu"] for r in tests), 1),
            "blocked_s": round(sum(max(0.0, r.get("blocked", 0.0)) for r in tests), 1),
            "first_start_s": round(tests[0]["start"] - start_epoch, 1), "last_end_s": round(tests[-1]["end"] - start_epoch, 1),
            "longest": [{"test": r["id"], "wall_s": round(r["end"] - r["start"], 1), "cpu_s": round(r["cpu"], 1),
                         "blocked_s": round(r.get("blocked", 0.0), 1)} for r in longest]}
    return out


def run(keep_cache: bool) -> dict:
    cleared = 0 if keep_cache else clear_numba_cache(Path("src"))
    TIMELINE.parent.mkdir(parents=True, exist_ok=True)
    for old in TIMELINE.parent.glob(TIMELINE.name + ".*"):
        old.unlink()
    load0 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start_epoch, start = time.time(), time.perf_counter()
    proc = subprocess.run(COMMAND, capture_output=True, text=True,
                          env=dict(os.environ, EDGEMOE_TEST_TIMELINE=str(TIMELINE.resolve())))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    LOG.parent.mkdir(parents=True, exist_ok=True)  # the whole output, for a failure's traceback (not committed)
    LOG.write_text(proc.stdout + proc.stderr)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    last = lines[-1].strip("= ") if lines else ""
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    failed = [ln.split(" - ")[0][len("FAILED "):] for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    return {"command": " ".join(["python", *COMMAND[1:]]), "workers": int(COMMAND[COMMAND.index("-n") + 1]),
            "numba_cache": "kept" if keep_cache else "cleared",
            "test_order": os.environ.get("EDGEMOE_TEST_ORDER", "lanes"),  # tests/conftest.py: lane_order or not
            "numba_cache_cleared_files": cleared, "returncode": proc.returncode, "summary": last,
            "counts": summary_counts(last), "failed": failed,
            "wall_s": wall, "cpu_s_children": cpu, "load_1_before": load0, "load_1_after": os.getloadavg()[0],
            "target_s": TARGET_S, "met": proc.returncode == 0 and wall <= TARGET_S,
            "workers_timeline": worker_timelines(TIMELINE, start_epoch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-cache", action="store_true", help="keep numba's caches (a warm run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "test_time.json", help="results file")
    args = parser.parse_args()
    row = run(args.keep_cache)
    atomic_write_json(args.out, {"benchmark": "make test", **row, "environment": environment()})
    print(f"{row['summary']}: {row['wall_s']:.0f} s wall, {row['cpu_s_children']:.0f} CPU s, load "
          f"{row['load_1_before']:.1f} -> {row['load_1_after']:.1f}; wrote {args.out}")
    for name in row["failed"]:
        print(f"failed: {name}")
    if row["returncode"] != 0:
        sys.exit(row["returncode"])


if __name__ == "__main__":
    main()
