"""Failover under load on Ray (issue 11, item 6): every request answered exactly once while servers crash or a
link loses half its messages; latency per phase; crashed servers restart and rejoin.

    python -m bench.ray.ray_failover [--users 64] [--seconds 60] [--seed 0]

edge8, default model, ordermoe placement, exact policy, home mode, links emulated, per-call timeout 2 s. Every
request allows degradation (`allow_degraded`): a slot whose every replica is down is dropped and counted,
instead of the request failing as an exact request would (that refusal is tests/distributed's to check; here
the question is whether every request is answered exactly once).
Run 1 (crashes): `--users` concurrent users in a closed loop for `--seconds`; three of the eight server actors,
drawn at random, are killed at random moments: first one alone, later the other two at once. Ray restarts
each; homes probe and readmit them.
Run 2 (lossy link): the same load while one server's link drops each incoming message with probability 0.5
(calls and probes) for the middle half of the run.
Per run: requests submitted / answered / failed / duplicated, client failovers, failed calls, dropped slots, and
per phase the decode latency (mean, p99) and completed requests; per killed server the time until every home
had readmitted it. CPU load is recorded beside each run. Writes bench/results/ray_failover.json.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS


def phase_stats(records, phases: list[tuple[str, float, float]]) -> list[dict]:
    """Decode latency of the passes that ended in each phase [start, end) (nominal s from the run's start)."""
    out = []
    for name, a, b in phases:
        lat, done = [], 0
        for r in records:
            res = r.result
            ends = res.pass_end_s[1:] - res.arrival_s + r.submitted_s  # run-relative (submitted_s is)
            sel = (ends >= a) & (ends < b)
            lat.extend((res.pass_end_s[1:] - res.pass_begin_s[1:])[sel])
            done += int(a <= r.finished_s < b)
        lat = np.asarray(lat) * 1e3
        out.append({"phase": name, "from_s": a, "to_s": b, "requests_finished": done, "decode_passes": int(lat.size),
                    "latency_ms_mean": float(lat.mean()) if lat.size else float("nan"),
                    "latency_ms_p99": float(np.percentile(lat, 99)) if lat.size else float("nan")})
    return out


def rejoin_times(dep, nodes, t_kill: dict, timeout_s: float = 180.0) -> dict:
    """Seconds from each kill until every home's membership has `node` alive again."""
    homes = [int(h) for h in np.flatnonzero(dep.cfg.home_nodes())]
    end = time.monotonic() + timeout_s
    out = {}
    while time.monotonic() < end and len(out) < len(nodes):
        for n in nodes:
            if n in out:
                continue
            try:
                if all(dep.health(h)["alive"][n] for h in homes if h != n):
                    out[n] = time.monotonic() - t_kill[n]
            except Exception:  # noqa: BLE001 - a home restarting: ask again
                pass
        time.sleep(0.5)
    return {dep.cfg.ctx.node_names[n]: out.get(n, float("nan")) for n in nodes}


def degrading(client_cls):
    """`client_cls` whose requests allow degradation (module docstring)."""

    class DegradingClient(client_cls):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **{**kwargs, "allow_degraded": True})

    return DegradingClient


def load_run(dep, client_cls, users, prompts, gen, seconds, schedule, name) -> dict:
    """Closed loop while `schedule` [(t, fn, label)] fires in a side thread; returns the run's figures."""
    from edgemoe.distributed.loadrun import CpuMeter, ray_pids
    from edgemoe.distributed.serve import closed_loop

    client = client_cls(dep)
    fired = []

    def faults():
        t0 = time.monotonic()
        for t, fn, label in schedule:
            time.sleep(max(t - (time.monotonic() - t0), 0.0))
            fn()
            fired.append((time.monotonic() - t0, label))

    th = threading.Thread(target=faults)
    with CpuMeter(ray_pids(dep)) as meter:
        th.start()
        records, makespan, errors = closed_loop(client, users, prompts, gen, seconds)
        th.join()
    submitted = len(records) + len(errors)
    counts = {k: int(sum(r.result.counts.get(k, 0) for r in records)) for k in ("failed_calls", "repaired", "dropped", "slots")}
    ids = [r.result.request_id for r in records]
    return {"run": name, "users": len(users), "seconds": seconds, "requests_submitted": submitted,
            "requests_answered": len(records), "requests_lost": submitted - len(records), "errors": errors[:5],
            "duplicate_answers": client.duplicates, "ids_unique": len(set(ids)) == len(ids),
            "client_failovers": client.failovers, **counts, "faults": fired, "cpu": meter.result,
            "makespan_s": makespan, "_records": records}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "ray_failover.json")
    args = ap.parse_args()

    from bench.common import environment, setup
    from edgemoe.distributed.cli import load_prompts
    from edgemoe.distributed.serve import Client as ExactClient
    from edgemoe.distributed.serve import Deployment, start_ray, stop_ray
    from edgemoe.distributed.server import ServerConfig
    from edgemoe.io import atomic_write_json

    Client = degrading(ExactClient)
    rng = np.random.default_rng(args.seed)
    ctx, path = setup("exact")
    prompts = load_prompts("default", 32, 16)
    users = [u % ctx.num_users for u in range(args.users)]
    S = args.seconds
    start_ray(ctx.node_names)
    dep = Deployment.launch(ServerConfig(ctx, path, call_timeout_s=2.0, backoff_base_s=0.25, backoff_max_s=2.0))
    runs = []
    try:
        Client(dep).generate(0, prompts[0], 2)  # warm-up
        # ---- run 1: crashes, one at a time twice, then two at once
        victims = [int(n) for n in rng.choice(ctx.num_nodes, 3, replace=False)]
        moments = [rng.uniform(0.15, 0.3) * S, rng.uniform(0.4, 0.55) * S, rng.uniform(0.65, 0.75) * S]
        t_kill: dict = {}

        def kill(nodes):
            def fn():
                for n in nodes:
                    t_kill[n] = time.monotonic()
                    dep.kill(n)
            return fn

        schedule = [(moments[0], kill([victims[0]]), f"kill {ctx.node_names[victims[0]]}"),
                    (moments[1], kill(victims[1:]), f"kill {ctx.node_names[victims[1]]} and {ctx.node_names[victims[2]]}")]
        r1 = load_run(dep, Client, users, prompts, args.gen, S, schedule, "crashes")
        r1["rejoin_s"] = rejoin_times(dep, victims, t_kill)
        bounds = [0.0, moments[0], moments[1], S + 1e9]
        r1["phases"] = phase_stats(r1.pop("_records"), [("before", bounds[0], bounds[1]),
                                                        ("one down", bounds[1], bounds[2]),
                                                        ("two more down, restarting", bounds[2], bounds[3])])
        runs.append(r1)
        print({k: v for k, v in r1.items() if k not in ("cpu",)}, flush=True)
        # ---- run 2: a lossy link on one server for the middle half
        lossy = int(rng.choice([n for n in range(ctx.num_nodes)]))
        h = dep.handles[lossy]
        import ray

        schedule = [(0.25 * S, lambda: ray.get(h.set_faults.remote(0.5, args.seed)), f"{ctx.node_names[lossy]} drops 50%"),
                    (0.75 * S, lambda: ray.get(h.set_faults.remote(0.0)), f"{ctx.node_names[lossy]} healed")]
        r2 = load_run(dep, Client, users, prompts, args.gen, S, schedule, "lossy link")
        t_heal = {lossy: time.monotonic()}
        r2["rejoin_s"] = rejoin_times(dep, [lossy], t_heal)
        r2["phases"] = phase_stats(r2.pop("_records"), [("before", 0.0, 0.25 * S), ("50% loss", 0.25 * S, 0.75 * S),
                                                        ("healed", 0.75 * S, S + 1e9)])
        runs.append(r2)
        print({k: v for k, v in r2.items() if k not in ("cpu",)}, flush=True)
    finally:
        dep.shutdown()
        stop_ray()
    doc = {"benchmark": "ray_failover", "cluster": "edge8", "model": "default", "placement": ctx.placement_method,
           "policy": "exact", "mode": ctx.mode, "dilation": 1.0, "call_timeout_s": 2.0, "gen_tokens": args.gen,
           "seed": args.seed, "runs": runs, "environment": environment()}
    atomic_write_json(args.out, doc)
    print_table(doc)


def print_table(doc: dict) -> None:
    print("\n| run | users | s | submitted | answered | lost | duplicated | failovers | failed calls | dropped slots | rejoin s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["runs"]:
        rj = ", ".join(f"{k} {v:.1f}" for k, v in r["rejoin_s"].items())
        print(f"| {r['run']} | {r['users']} | {r['seconds']:.0f} | {r['requests_submitted']} | {r['requests_answered']} | "
              f"{r['requests_lost']} | {r['duplicate_answers']} | {r['client_failovers']} | {r['failed_calls']} | "
              f"{r['dropped']} | {rj} |")
    print("\n| run | phase | requests finished | decode mean ms | decode p99 ms |\n|---|---|---|---|---|")
    for r in doc["runs"]:
        for p in r["phases"]:
            print(f"| {r['run']} | {p['phase']} | {p['requests_finished']} | {p['latency_ms_mean']:.1f} | {p['latency_ms_p99']:.1f} |")


if __name__ == "__main__":
    main()
