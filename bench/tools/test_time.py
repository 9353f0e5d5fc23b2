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

def run(keep_cache: bool) -> dict:
    cleared = 0 if keep_cache else clear_numba_cache(Path("src"))
    load0 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(COMMAND, capture_output=True, text=True)
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
            "target_s": TARGET_S, "met": proc.returncode == 0 and wall <= TARGET_S}


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
