"""The HTTP service on the Ray deployment under load: 1, 4 and 16 concurrent streams, exact and ordermoe.

The deployment `edgemoe serve --backend ray` starts with no other option: the default model on edge8, one
actor per server (a private local Ray instance), the placement and profile it plans itself (cached in
runs/cache), links emulated; the HTTP app in this process (edgemoe.serve.ray_engine). The load is the
in-process benchmark's (bench/speed/serving.py): closed loops of streamed completions from an asyncio httpx
client in a separate process; stream k is cluster user k % (edge8's users), so the streams spread over the
homes and each home batches its own. Per level: TTFT and inter-token latency (p50, p99) as the client sees
them, aggregate tokens per second (all tokens over the level's wall time).

Target (issue 20, section 2): at 16 streams aggregate tokens/s >= 2x the 1-stream figure on Ray.
Writes bench/results/serving_ray.json (commit, load average, CPU seconds) and prints a table.
    python -m bench.ray.serving_ray [--levels 1,4,16] [--tokens 16] [--requests 16] [--policies exact,ordermoe]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.common import RESULTS, print_serving_table, ray_serving
from bench.speed.serving import client_level, prompts, summarise
from edgemoe.io import atomic_write_json
from edgemoe.results import environment

OUT = RESULTS / "serving_ray.json"


def main() -> None:
    import multiprocessing

    from edgemoe.models import load_tokenizer
    from edgemoe.serve.service import ServerThread

    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=16, help="max_tokens per request")
    ap.add_argument("--requests", type=int, default=16, help="requests per level (at least one per stream)")
    ap.add_argument("--policies", default="exact,ordermoe")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    start, cpu0, load0 = time.perf_counter(), time.process_time(), list(os.getloadavg())
    ps = prompts(load_tokenizer("default"))
    pool = multiprocessing.get_context("spawn").Pool(1)  # the load generator: its own process and GIL
    results: dict = {}
    batching: dict = {}
    for policy in args.policies.split(","):
        with ray_serving(policy) as (dep, engine, app), ServerThread(app) as server:
            users = dep.cfg.ctx.num_users
            pool.apply(client_level, (server.url, 1, 1, ps, 4, users))  # warm-up
            rows = {}
            for c in levels:
                before = [dep.health(n).get("streams") or {} for n in range(len(dep.handles))]
                records, wall = pool.apply(client_level, (server.url, c, max(1, args.requests // c), ps,
                                                          args.tokens, users))
                rows[str(c)] = summarise(records, wall)
                after = [dep.health(n).get("streams") or {} for n in range(len(dep.handles))]
                steps = sum(a.get("steps", 0) - b.get("steps", 0) for a, b in zip(after, before, strict=True))
                seqs = sum(a.get("batched_rows", 0) - b.get("batched_rows", 0) for a, b in zip(after, before, strict=True))
                rows[str(c)]["mean_decode_batch"] = round(seqs / steps, 2) if steps else None
                print(f"{policy:>9} {c:>3} streams: {rows[str(c)]}", flush=True)
            results[policy] = rows
            batching[policy] = {"homes": int(dep.cfg.home_nodes().sum()), "users": users}
    pool.close()
    pool.join()
    targets = {}
    for policy, rows in results.items():
        one, sixteen = rows.get("1"), rows.get("16")
        ratio = sixteen["tokens_per_s"] / one["tokens_per_s"] if one and sixteen else None
        targets[policy] = {"tokens_per_s_16_over_1": None if ratio is None else round(ratio, 2),
                           "met_2x": None if ratio is None else bool(ratio >= 2.0)}
    doc = {
        "what": "edgemoe serve --backend ray through HTTP: closed-loop streams of streamed completions, spread over "
                "edge8's users (each home batches its own)",
        "command": "python -m bench.ray.serving_ray " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "model": "default", "cluster": "edge8", "links": "emulated", "wire": "bf16", "mode": "home",
        "prompt_tokens": 16, "max_tokens": args.tokens, "requests_per_level": args.requests,
        "deployment": batching, "results": results, "targets": targets,
        "timing": {"wall_s": round(time.perf_counter() - start, 1), "cpu_s_driver": round(time.process_time() - cpu0, 1),
                   "load_average_start": load0, "load_average_end": list(os.getloadavg())},
        "environment": {**environment(), "torch": torch.__version__, "cpu_count": os.cpu_count()},
    }
    atomic_write_json(OUT, doc)
    print_serving_table(results, extra=(("batch", "mean_decode_batch", 6),))
    print(json.dumps(targets))
    print(f"{doc['timing']['wall_s']} s wall, load average at start {load0}; wrote {OUT}")


if __name__ == "__main__":
    main()
