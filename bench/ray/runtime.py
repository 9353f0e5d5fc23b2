"""Distributed runtime benchmark: in-process servers vs Ray actors on edge8 with the default model.

    python -m bench.ray.runtime [--quick]

Measures (2-core shared machine, 8 server actors, torch 1 thread each):
- per remote call overhead: one expert call of one row with links off, in-process (threads) vs a Ray
  actor call from another process;
- tokens/s of one request (16-token prompt, 32 generated), in-process vs Ray, links off and on;
- a closed loop of U users against the 8 actors, links on, at the calibrated dilation: throughput,
  latency percentiles, errors, CPU use and validity, and the simulator's replay of the same requests;
- memory of each actor against the experts it hosts;
- link emulation accuracy: the round trip of a 64-row expert call from node 0 to every other node (stamped
  with its send time; the driver waits for the latest ready time as a home does), measured (median of
  repeats) against the emulated legs + queue + roofline, per link (the load average beside it).
Writes bench/results/runtime.json and prints the tables.
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import replace

import numpy as np

from bench.common import RESULTS, setup
from edgemoe.io import atomic_write_json


def call_overhead(transport_call, n: int) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        transport_call()
        times.append(time.perf_counter() - t0)
    t = np.asarray(times[5:]) * 1e6
    return {"mean_us": float(t.mean()), "p50_us": float(np.median(t)), "p99_us": float(np.percentile(t, 99))}


def one_request_tps(generate, prompt, gen: int, repeats: int) -> dict:
    rates = []
    for i in range(repeats):
        t0 = time.perf_counter()
        res = generate(prompt, gen, i)
        rates.append(gen / (time.perf_counter() - t0))
    return {"tokens_per_s": float(np.median(rates)), "decode_ms_mean": float(res.decode_s.mean() * 1e3)}


def link_accuracy(ctx, handles, H: int, repeats: int) -> list[dict]:
    """Round trip of a 64-row bf16 call from node 0 to each other node, as a home makes it: measured (wall,
    median) vs emulated (inbound leg + the node's FIFO accelerator + outbound leg, from the reply's times)."""
    import os

    import ray
    from edgemoe.distributed.links import Clock
    from edgemoe.distributed.wire import ExpertCall

    clock = Clock()
    rows = 64
    out = []
    for n in range(1, ctx.num_nodes):
        e = int(np.flatnonzero(ctx.hosts[n, 0])[0]) if ctx.hosts[n, 0].any() else None
        if e is None:
            continue
        measured, emulated = [], []
        for _ in range(repeats):
            sent = clock.now()
            call = ExpertCall(0, np.zeros((rows, H), np.int16), np.full(rows, e), np.zeros(rows, np.int64),
                              np.zeros(rows, np.int64), "bf16", sent)
            reply = ray.get(handles[n].run_experts.remote(call))
            ready = float((reply.end + reply.back_s).max())
            clock.wait_until(ready)
            measured.append(clock.now() - sent)
            emulated.append(ready - sent)
        med, emu = float(np.median(measured)), float(np.median(emulated))
        out.append({"link": f"{ctx.node_names[0]}<->{ctx.node_names[n]}", "configured_ms": emu * 1e3,
                    "measured_ms": med * 1e3, "ratio": med / emu, "load_avg_1min": os.getloadavg()[0]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--users", type=int, default=16)
    args = ap.parse_args()
    from bench.common import environment
    from edgemoe.distributed.cli import load_prompts, run_load
    from edgemoe.distributed.serve import Client, Deployment, start_ray, stop_ray
    from edgemoe.distributed.server import HomeEngine, LocalTransport, ServerConfig, ServerCore
    from edgemoe.distributed.weights import checkpoint_hidden_size
    from edgemoe.distributed.wire import ExpertCall, GenerateRequest

    ray = __import__("ray")  # after edgemoe.distributed, which switches Ray's token authentication on
    ctx, path = setup("exact")
    H = checkpoint_hidden_size(path)
    gen = 8 if args.quick else 32
    prompt = load_prompts("default", 1, 16)[0]
    n_calls = 100 if args.quick else 300
    out: dict = {"machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores (shared)", "cluster": "edge8",
                 "model": "default", "placement": ctx.placement_method, "policy": "exact", "mode": ctx.mode,
                 "wire": "bf16", "gen_tokens": gen, "prompt_tokens": len(prompt)}

    # ---- in-process
    cfg_off = ServerConfig(ctx, path, links_enabled=False)
    servers = {n: ServerCore(n, path, ctx, cfg_off.links(H)) for n in range(ctx.num_nodes)}
    local = HomeEngine(cfg_off, 0, LocalTransport(servers))
    e = int(np.flatnonzero(ctx.hosts[1, 0])[0])
    call = ExpertCall(0, np.zeros((1, H), np.int16), np.array([e]), np.array([0]), np.array([0]), "bf16")
    transport = LocalTransport(servers)
    out["call_overhead"] = {"in_process": call_overhead(lambda: transport.submit(1, call).result(), n_calls)}
    out["one_request"] = {"in_process_links_off": one_request_tps(
        lambda p, g, i: local.generate(GenerateRequest(f"l{i}", 0, p, g)), prompt, gen, 3)}
    cfg_on = replace(cfg_off, links_enabled=True)
    servers_on = {n: ServerCore(n, path, ctx, cfg_on.links(H)) for n in range(ctx.num_nodes)}
    local_on = HomeEngine(cfg_on, 0, LocalTransport(servers_on))
    out["one_request"]["in_process_links_on"] = one_request_tps(
        lambda p, g, i: local_on.generate(GenerateRequest(f"lo{i}", 0, p, g)), prompt, gen, 2)

    # ---- Ray
    t0 = time.perf_counter()
    start_ray(ctx.node_names)
    dep = Deployment.launch(cfg_off)
    out["ray_startup_s"] = time.perf_counter() - t0
    out["memory"] = dep.memory()
    out["call_overhead"]["ray"] = call_overhead(lambda: ray.get(dep.handles[1].run_experts.remote(call)), n_calls)
    client = Client(dep)
    out["one_request"]["ray_links_off"] = one_request_tps(lambda p, g, i: client.generate(0, p, g), prompt, gen, 3)
    dep.configure(cfg_on)
    out["links"] = link_accuracy(ctx, dep.handles, H, 5 if args.quick else 15)
    out["one_request"]["ray_links_on"] = one_request_tps(lambda p, g, i: client.generate(0, p, g), prompt, gen, 2)
    load = run_load(dep, args.users, 1e9, 8 if args.quick else 16, dilation="auto", requests_per_user=2)
    out["load"] = load
    out["environment"] = environment()
    dep.shutdown()
    stop_ray()
    RESULTS.mkdir(exist_ok=True)
    atomic_write_json(RESULTS / "runtime.json", out)
    print_tables(out)


def print_tables(out: dict) -> None:
    co, one = out["call_overhead"], out["one_request"]
    print(f"\nedge8, default model, {out['policy']} policy, {out['mode']} mode, {out['machine']}")
    print(f"| | in-process | Ray |\n|---|---|---|\n| remote call overhead (1 row, links off), mean / p99 | "
          f"{co['in_process']['mean_us']:.0f} / {co['in_process']['p99_us']:.0f} us | "
          f"{co['ray']['mean_us']:.0f} / {co['ray']['p99_us']:.0f} us |")
    print(f"| tokens/s, one request, links off | {one['in_process_links_off']['tokens_per_s']:.1f} | "
          f"{one['ray_links_off']['tokens_per_s']:.1f} |")
    print(f"| tokens/s, one request, links on | {one['in_process_links_on']['tokens_per_s']:.1f} | "
          f"{one['ray_links_on']['tokens_per_s']:.1f} |")
    load = out["load"]
    m, p, err = load["measured"], load["predicted"], load["error_vs_simulator"]
    print(f"\nclosed loop: {load['users']} users, 2 requests each, 8 server actors, links on, dilation "
          f"{load['dilation']:g} (host CPU {100 * load['cpu']['host_util']:.0f}%, Ray {load['cpu']['ray_cores_busy']:.2f} "
          f"cores, {'valid' if load['valid'] else 'INVALID'}): {m['requests']} requests, errors {len(load['errors'])}, "
          f"duplicates {load['duplicates']}")
    print("| | measured (Ray) | simulator, same requests | error |\n|---|---|---|---|")
    for label, key, sub in (("latency/token mean ms", "latency_ms", "mean"), ("latency/token p50 ms", "latency_ms", "p50"),
                            ("latency/token p99 ms", "latency_ms", "p99"), ("TTFT mean ms", "ttft_ms", "mean")):
        ek = {"mean": "latency_mean", "p50": "latency_p50", "p99": "latency_p99"}[sub] if key == "latency_ms" else "ttft_mean"
        print(f"| {label} | {m[key][sub]:.1f} | {p[key][sub]:.1f} | {100 * err[ek]:+.0f}% |")
    print(f"| throughput tokens/s | {m['throughput_tokens_per_s']:.1f} | {p['throughput_tokens_per_s']:.1f} | {100 * err['throughput']:+.0f}% |")
    print(f"| traffic bytes / 1k tokens | {m['traffic_bytes_per_1k_tokens']:.0f} | {p['traffic_bytes_per_1k_tokens']:.0f} | {100 * err['traffic']:+.1f}% |")
    print(f"| remote ratio | {m['remote_ratio']:.3f} | {p['remote_ratio']:.3f} | {100 * err['remote_ratio']:+.1f}% |")
    if "links" in out:
        print("\n| link | emulated RTT ms | measured ms | measured/emulated | load avg |\n|---|---|---|---|---|")
        for lk in out["links"]:
            print(f"| {lk['link']} | {lk['configured_ms']:.1f} | {lk['measured_ms']:.1f} | {lk['ratio']:.3f} | "
                  f"{lk['load_avg_1min']:.2f} |")
    print("\n| server | experts | expert MB | backbone MB | RSS MB |\n|---|---|---|---|---|")
    for mem in out["memory"]:
        print(f"| {mem['node']} | {mem['experts']} | {mem['expert_bytes'] / 1e6:.2f} | {mem['backbone_bytes'] / 1e6:.2f} | "
              f"{mem['rss_bytes'] / 1e6:.0f} |")


if __name__ == "__main__":
    main()
