"""What OrderMoE's look-ahead tables take as servers are added: their bytes, the build's peak memory and CPU.

    python -m bench.speed.lookahead_memory [--servers 64,256,512]

The simulator benchmark's kind of context (`bench.speed.simulator`: the synthetic L=8, E=8, K=2 profile, `generate(N,
4N, copies=32)` from 256 servers on, an ordermoe placement, migrate mode) with the default ordermoe policy
(H=2, the trip home and the queue term on). Each size is built in a fresh process, so that its peak resident
memory (`ru_maxrss`, the context included) is its own; a first process per tree writes numba's on-disk caches, and each
measured process builds a policy on edge8 before it starts timing, so that no compile is counted. Per row: the tables' bytes as kept (`LookAhead.flat`:
the home-free tables and the per-home layers) and as every layer kept per home would take them (the layout
before 2026-12-07: [L+1, N, C, m] plus [L+1, Nh, N, C, m]), the queue term's exposure rows, CPU seconds of the
context and of the policy. With `--before REV` each size is measured with that commit's edgemoe too (checked out
for the run in a temporary `git worktree`, removed after), its rows marked with the commit. Writes
bench/results/lookahead_memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, environment
from edgemoe.io import atomic_write_json


def one(servers: int) -> dict:
    """The row of one size, measured in this process."""
    from edgemoe.cluster import generate, load_cluster
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan
    from edgemoe.profile import synthetic_profile
    from edgemoe.runtime import make_context, make_policy

    profile = synthetic_profile(num_layers=8, num_experts=8, top_k=2, num_tokens=3000, seed=0)
    small = load_cluster("edge8")  # numba's compiles (or cache loads) first, untimed
    make_policy("ordermoe", make_context(profile, small, plan(plan_problem(profile, small, domain_fallback=True), "ordermoe"),
                                         mode="migrate", domain_fallback=True))
    if servers <= 0:  # a warm-up process: numba's on-disk caches written, nothing measured
        return {}
    t = time.process_time()
    cluster = generate(servers, 4 * servers, seed=0, **({"copies": 32} if servers >= 256 else {}))
    ctx = make_context(profile, cluster, plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe"),
                       mode="migrate", domain_fallback=True)
    ctx_cpu, t = time.process_time() - t, time.process_time()
    la = make_policy("ordermoe", ctx).lookahead
    policy_cpu = time.process_time() - t
    L1, N, C, m = la.stacked.shape
    homes = len(la.homes) if la.home_trip else 0
    return {"servers": servers, "users": cluster.num_users, "layers": L1 - 1, "keys": C, "levels": m,
            "homes": homes, "per_home_layers": int(la.home.shape[0]) if la.home_trip else 0,
            "table_mb": round((la.stacked.nbytes + la.home.nbytes) / 1e6, 1),
            "table_mb_every_layer_per_home": round(L1 * (1 + homes) * N * C * m * 8 / 1e6, 1),
            "exposure_mb": round(la.expo.nbytes / 1e6, 1) if la.expo is not None else 0.0,
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3, 1),
            "context_cpu_s": round(ctx_cpu, 2), "policy_cpu_s": round(policy_cpu, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="64,256,512", help="comma-separated cluster sizes")
    ap.add_argument("--before", help="a git revision whose edgemoe is measured beside this tree's")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: print one row as JSON
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one)))
        return
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("this", str(root / "src"))]
        if args.before:
            old = Path(tmp) / "before"
            subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(old), args.before], check=True)
            trees.append(("before", str(old / "src")))
        try:
            rows = measure(root, trees, [int(s) for s in args.servers.split(",")])
        finally:
            if args.before:
                subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(old)], check=True)
    print_and_write(rows)


def measure(root: Path, trees: list[tuple[str, str]], sizes: list[int]) -> list[dict]:
    """One row per (size, tree): `one` in a fresh process with the tree's src first on the path."""
    rows = []
    envs = {src: os.environ | {"PYTHONPATH": os.pathsep.join([src, str(root)])} for _, src in trees}
    commits = {src: subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True).stdout.strip() for _, src in trees}
    for _, src in trees:  # numba compiles once per tree, in a process of its own: its memory is not a row's peak
        subprocess.run([sys.executable, "-m", "bench.speed.lookahead_memory", "--one", "0"], capture_output=True,
                       check=True, env=envs[src], cwd=root)
    for servers in sizes:
        for label, src in trees:
            load = os.getloadavg()[0]
            done = subprocess.run([sys.executable, "-m", "bench.speed.lookahead_memory", "--one", str(servers)],
                                  capture_output=True, text=True, check=True, env=envs[src], cwd=root)
            rows.append({"tree": label, "commit": commits[src]} | json.loads(done.stdout.strip().splitlines()[-1])
                        | {"load_average_1min": round(load, 2)})
            print(rows[-1], flush=True)
    return rows


def print_and_write(rows: list[dict]) -> None:
    """The table on stdout and the results file."""
    keys = ("tree", "commit", "servers", "homes", "per_home_layers", "table_mb", "table_mb_every_layer_per_home",
            "exposure_mb", "peak_rss_mb", "context_cpu_s", "policy_cpu_s")
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    out = RESULTS / "lookahead_memory.json"
    atomic_write_json(out, {"what": __doc__.splitlines()[0], "rows": rows, "environment": environment()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
