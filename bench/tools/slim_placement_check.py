"""SlimCaching placement fingerprints on a fixed instance set: run under two commits, compare the JSONs.

    python -m bench.tools.slim_placement_check OUT.json [--compare OTHER.json] [--only SUBSTRING] [--shared-data ../shared/data]

Instances: the planners benchmark's 15 ILP-gap instances, the device-edge-cloud K = 2 preset, the Mixtral
and Qwen synthetic scale targets, and the calibrated Mixtral-8x7B and Qwen1.5-MoE trace profiles (planning
draw of `bench/studies/out_of_sample.py`) on device-edge-cloud and testbed8. For each: sha256 of the placement's
hosts, its objective, process CPU seconds and the load average. With --compare, prints which placements
differ and the objective change. Used to show that a speed-up leaves placements byte-identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time

from edgemoe.io import atomic_write_json
from edgemoe.plan.base import plan
from edgemoe.plan.objective import expected_latency
from edgemoe.plan.synthetic import synthetic_problem

ILP_SHAPES = [dict(num_servers=2, num_users=3, num_layers=2, num_experts=4, slots_per_server=3, device_slots=1),
              dict(num_servers=3, num_users=5, num_layers=2, num_experts=6, slots_per_server=4, device_slots=2),
              dict(num_servers=2, num_users=3, num_layers=2, num_experts=6, slots_per_server=3, device_slots=1, top_k=1)]


def preset():
    from edgemoe.cluster.presets import DEFAULT_DOMAINS
    from edgemoe.plan.problem import plan_problem
    from edgemoe.profile import synthetic_profile

    prof = synthetic_profile(32, 8, 2, 3000, num_domains=len(DEFAULT_DOMAINS), expert_bytes=33_800_000,
                             hidden_size=4096, seed=0)
    prof = dataclasses.replace(prof, meta=dataclasses.replace(prof.meta, domains=list(DEFAULT_DOMAINS)))
    return plan_problem(prof, "device-edge-cloud")


def instances(shared_data: str):
    """name -> zero-argument builder of a PlanProblem."""
    out = {f"ilp-shape{i}-seed{seed}": (lambda sh=sh, seed=seed: synthetic_problem(
        with_devices=True, num_tokens=500, seed=seed, **sh)) for i, sh in enumerate(ILP_SHAPES) for seed in range(5)}
    out["preset-dec-K2"] = preset
    big = dict(num_servers=10, num_users=50, with_devices=True, num_tokens=2000)
    out["synthetic-mixtral-target"] = lambda: synthetic_problem(**big, num_layers=32, num_experts=8, top_k=2,
                                                                slots_per_server=40, device_slots=4)
    out["synthetic-qwen-target"] = lambda: synthetic_problem(**big, num_layers=24, num_experts=60, top_k=4,
                                                             slots_per_server=150, device_slots=16)
    from edgemoe.cluster.load import load_cluster
    from edgemoe.eval.paper_scale import MODELS, PaperScaleConfig, scenario_profiles
    from edgemoe.plan.problem import plan_problem

    cfg = PaperScaleConfig(shared_data=shared_data, tokens_per_domain=1000)
    for name, counted in MODELS:
        _, plan_prof, _, _ = scenario_profiles(name, counted, cfg, lambda _msg: None)
        for cluster in ("device-edge-cloud", "testbed8"):
            c = load_cluster(cluster)
            fallback = any(u.domain not in plan_prof.meta.domains for u in c.users)
            out[f"trace-{name}-{cluster}"] = (lambda p=plan_prof, c=c, f=fallback: plan_problem(p, c, domain_fallback=f))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--compare")
    ap.add_argument("--shared-data", default="../shared/data")
    ap.add_argument("--only", default="", help="run only instances whose name contains this")
    args = ap.parse_args()
    res = {}
    for name, make in instances(args.shared_data).items():
        if args.only not in name:
            continue
        problem = make()
        cpu = time.process_time()
        pl = plan(problem, "slimcaching")
        res[name] = {"sha256": hashlib.sha256(pl.hosts.tobytes()).hexdigest(), "objective_s": expected_latency(problem, pl.hosts),
                     "cpu_s": round(time.process_time() - cpu, 3), "load_average": os.getloadavg()[0]}
        print(name, res[name], flush=True)
    atomic_write_json(args.out, res)
    if args.compare:
        with open(args.compare) as f:
            other = json.load(f)
        same = [k for k in res if k in other and other[k]["sha256"] == res[k]["sha256"]]
        print(f"{len(same)} of {len(res)} byte-identical")
        for k in res:
            if k in other and k not in same:
                print(f"  {k}: objective {other[k]['objective_s']:.6g} -> {res[k]['objective_s']:.6g} "
                      f"({100 * (res[k]['objective_s'] / other[k]['objective_s'] - 1):+.3f}%)")


if __name__ == "__main__":
    main()
