"""The HTTP service under load: 1, 4, 16 and 64 concurrent streams, exact and ordermoe, in-process.

Each stream is a closed loop of streamed completions (`stream: true`, `logprobs: 0` so every chunk says how
many tokens it carries) sent by an asyncio httpx client in a separate load process (its own GIL) to a real
uvicorn server on loopback, run as `edgemoe serve` runs it: the engine in this process, uvicorn and the API in a
front process of their own (edgemoe.serve.front); the default model on edge8
with the placement `edgemoe serve` plans itself (cached in runs/cache). Per level: TTFT and inter-token
latency (p50, p99) as the client sees them, and aggregate generated tokens per second (all tokens over the
level's wall time). At one stream the same requests also run through the Python client (the engine
directly in this process, no HTTP), paired request by request: the difference of the mean inter-token latencies is what
HTTP adds per token (the target's figure; the median over the pairs of each pair's difference is recorded
beside it, less moved by the other jobs of a shared machine), and so is the difference of the server
processes' CPU seconds per token on the two sides (the engine's and the front's: what the HTTP layer costs, whatever the machine's load;
on a busy host the wall figure is that CPU stretched by the wait for a core).

Targets (issue 20): at 16 streams aggregate tokens/s >= 3x the 1-stream figure; HTTP adds <= 2 ms per token.
Writes bench/results/serving.json (commit, load average, CPU seconds) and prints a table.
    python -m bench.speed.serving [--levels 1,4,16,64] [--tokens 32] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import httpx
import numpy as np
import torch

from bench.common import RESULTS, print_serving_table
from edgemoe.distributed.sampling import SamplingParams
from edgemoe.io import atomic_write_json
from edgemoe.results import environment
from edgemoe.serve.engine import Delta, Finished, GenerationRequest
from edgemoe.serve.front import FrontProcess
from edgemoe.serve.service import make_service
from edgemoe.serve.setup import DeploymentSpec, load_deployment

OUT = RESULTS / "serving.json"
POLICIES = ("exact", "ordermoe")


def prompts(tokenizer, count: int = 64, length: int = 16) -> list[list[int]]:
    """`count` prompts of `length` tokens cut from the offline corpus (the stdlib docs)."""
    from edgemoe.data import stdlib_docs

    text = "\n".join(t for _, t in stdlib_docs().split("heldout").docs)[:200_000]
    ids = tokenizer(text)["input_ids"]
    return [ids[i * length:(i + 1) * length] for i in range(count)]


async def stream_once(client, url: str, prompt: list[int], tokens: int, seed: int, user: int | None = None) -> dict:
    """One streamed completion (of cluster user `user`, None: the server's default user) -> send time, per-token
    arrival times (perf_counter, this process), and the status of an error (None when it completed)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": tokens, "seed": seed, "stream": True, "logprobs": 0}
    if user is not None:
        body["edgemoe"] = {"user": user}
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            lp = chunk["choices"][0]["logprobs"] if chunk.get("choices") else None
            if lp:
                now = time.perf_counter()
                arrivals.extend([now] * len(lp["tokens"]))
    return {"sent": sent, "arrivals": arrivals}


def client_level(url: str, streams: int, per_stream: int, ps: list[list[int]], tokens: int,
                 users: int = 0) -> tuple[list[dict], float]:
    """`streams` closed loops of `per_stream` requests each, as asyncio tasks of one httpx client; runs in the
    load process (no GIL shared with the server). users > 0: stream k is cluster user k % users (else the
    server's default user). Returns (records, wall seconds)."""
    import asyncio

    async def run() -> tuple[list[dict], float]:
        limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
        async with httpx.AsyncClient(limits=limits, timeout=600) as client:
            async def loop(k: int) -> list[dict]:
                return [await stream_once(client, url, ps[(k * per_stream + i) % len(ps)], tokens, seed=k * 1000 + i,
                                          user=k % users if users else None)
                        for i in range(per_stream)]

            t0 = time.perf_counter()
            parts = await asyncio.gather(*(loop(k) for k in range(streams)))
            return [r for part in parts for r in part], time.perf_counter() - t0

    return asyncio.run(run())


def summarise(records: list[dict], wall_s: float) -> dict:
    ttft = np.array([r["arrivals"][0] - r["sent"] for r in records if r["arrivals"]]) * 1e3
    gaps = np.concatenate([np.diff(r["arrivals"]) for r in records if len(r["arrivals"]) > 1] or [np.zeros(0)]) * 1e3
    tokens = sum(len(r["arrivals"]) for r in records)

    def pct(x, q):
        return round(float(np.percentile(x, q)), 2) if len(x) else None

    return {"requests": len(records), "tokens": tokens, "wall_s": round(wall_s, 3),
            "tokens_per_s": round(tokens / wall_s, 1), "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(gaps, 50), "itl_ms_p99": pct(gaps, 99),
            "itl_ms_mean": round(float(gaps.mean()), 3) if len(gaps) else None}


def run_level(pool, url: str, streams: int, per_stream: int, ps: list[list[int]], tokens: int) -> dict:
    records, wall = pool.apply(client_level, (url, streams, per_stream, ps, tokens))
    return summarise(records, wall)


def python_once(engine, prompt: list[int], tokens: int, seed: int) -> dict:
    """The same request on the engine directly (no HTTP): token arrival times at the caller's sink."""
    import queue

    events: queue.Queue = queue.Queue()
    arrivals: list[float] = []
    req = GenerationRequest(tuple(prompt), tokens, SamplingParams(seed=seed), logprobs=0, request_id=f"py-{seed}")
    sent = time.perf_counter()
    engine.submit(req, events.put)
    while True:
        ev = events.get(timeout=600)
        if isinstance(ev, Delta):
            arrivals.extend([time.perf_counter()] * len(ev.tokens))
        elif isinstance(ev, Finished):
            return {"sent": sent, "arrivals": arrivals}


def http_vs_python(pool, front: FrontProcess, engine, ps: list[list[int]], count: int, tokens: int) -> dict:
    """One stream, paired: request i through HTTP (from the load process), then the same request (prompt, seed)
    through the Python client, so that a change of the machine's load hits both sides alike. Beside the wall
    times, the CPU seconds this (the server's) process spent per generated token on each side: the engine
    thread and this thread, plus the front process (uvicorn, the API) on the HTTP side; the load process's own CPU
    is the client's, not counted."""
    url = front.url
    http, py = [], []
    t_http = t_py = cpu_http = cpu_py = 0.0
    load0 = list(os.getloadavg())
    for i in range(count):
        c0, f0 = time.process_time(), front.cpu_s()
        (rec,), wall = pool.apply(client_level, (url, 1, 1, [ps[i % len(ps)]], tokens))
        cpu_http += time.process_time() - c0 + front.cpu_s() - f0
        # client_level seeds stream 0's first request with 0: give the Python client the same seed
        http.append(rec)
        t_http += wall
        t1, c1 = time.perf_counter(), time.process_time()
        py.append(python_once(engine, ps[i % len(ps)], tokens, seed=0))
        t_py += time.perf_counter() - t1
        cpu_py += time.process_time() - c1
    diffs = [float(np.mean(np.diff(h["arrivals"])) - np.mean(np.diff(p["arrivals"]))) * 1e3
             for h, p in zip(http, py, strict=True) if len(h["arrivals"]) > 1 and len(p["arrivals"]) > 1]
    out = {"http": summarise(http, t_http), "python": summarise(py, t_py),
           "median_paired_itl_diff_ms": round(float(np.median(diffs)), 3) if diffs else None}
    for side, cpu in (("http", cpu_http), ("python", cpu_py)):
        out[side]["server_cpu_ms_per_token"] = round(1e3 * cpu / max(out[side]["tokens"], 1), 3)
    out["load_average"] = [load0, list(os.getloadavg())]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens per request")
    ap.add_argument("--requests", type=int, default=32, help="requests per level (at least one per stream)")
    ap.add_argument("--quick", action="store_true", help="levels 1,4,16 and 16 requests")
    args = ap.parse_args()
    levels = [1, 4, 16] if args.quick else [int(x) for x in args.levels.split(",")]
    n_requests = 16 if args.quick else args.requests
    start, cpu0, load0 = time.perf_counter(), time.process_time(), list(os.getloadavg())
    base = load_deployment(DeploymentSpec(), log=print)  # `edgemoe serve`'s defaults: edge8, ordermoe placement
    ps = prompts(base.tokenizer)
    results: dict = {}
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(1)  # the load generator: its own process and GIL
    for policy in POLICIES:
        dep = replace(base, spec=replace(base.spec, policy=policy, policy_params=()))
        svc = make_service(dep.spec, deployment=dep, max_running=max(levels), max_queue=max(levels))
        try:
            with FrontProcess.of(svc) as server:
                run_level(pool, server.url, 1, 1, ps, 8)  # warm-up
                rows = {}
                for c in levels:
                    rows[str(c)] = run_level(pool, server.url, c, max(1, n_requests // c), ps, args.tokens)
                    print(f"{policy:>9} {c:>3} streams: {rows[str(c)]}")
                paired = http_vs_python(pool, server, svc.engine, ps, max(1, n_requests), args.tokens)
                rows["1_paired_http"], rows["1_paired_python"] = paired["http"], paired["python"]
                rows["1_paired_median_itl_diff_ms"] = paired["median_paired_itl_diff_ms"]
                rows["1_paired_load_average"] = paired["load_average"]
            results[policy] = rows
        finally:
            svc.close()
    pool.close()
    pool.join()
    import resource

    load_cpu_s = resource.getrusage(resource.RUSAGE_CHILDREN)
    targets = {}
    for policy, rows in results.items():
        one, sixteen = rows.get("1"), rows.get("16")
        ratio = sixteen["tokens_per_s"] / one["tokens_per_s"] if one and sixteen else None
        http = rows["1_paired_http"]["itl_ms_mean"] - rows["1_paired_python"]["itl_ms_mean"]
        targets[policy] = {"tokens_per_s_16_over_1": None if ratio is None else round(ratio, 2),
                           "met_3x": None if ratio is None else bool(ratio >= 3.0),
                           "http_ms_per_token_over_python": None if http is None else round(http, 3),
                           "http_ms_per_token_median_of_pairs": rows["1_paired_median_itl_diff_ms"],
                           "http_server_cpu_ms_per_token_over_python": round(
                               rows["1_paired_http"]["server_cpu_ms_per_token"]
                               - rows["1_paired_python"]["server_cpu_ms_per_token"], 3),
                           "met_2ms": None if http is None else bool(http <= 2.0)}
    doc = {
        "what": "edgemoe serve in-process through HTTP: closed-loop streams of streamed completions",
        "command": "python -m bench.speed.serving " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                        if v not in (False, None)),
        "model": "default", "cluster": base.ctx.cluster_name, "placement": base.ctx.placement_method,
        "mode": base.ctx.mode, "prompt_tokens": 16, "max_tokens": args.tokens, "requests_per_level": n_requests,
        "results": results, "targets": targets,
        "timing": {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(time.process_time() - cpu0, 1),
                   "cpu_s_load_process": round(load_cpu_s.ru_utime + load_cpu_s.ru_stime, 1),
                   "load_average_start": load0, "load_average_end": list(os.getloadavg())},
        "environment": {**environment(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "cpu_count": os.cpu_count()},
    }
    atomic_write_json(OUT, doc)
    print_serving_table(results)
    print(json.dumps(targets))
    print(f"{doc['timing']['cpu_s']} s CPU, {doc['timing']['wall_s']} s wall, load average at start {load0}; wrote {OUT}")


if __name__ == "__main__":
    main()
