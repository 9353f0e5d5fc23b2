"""Evaluate placements and policies on a profile's own routing, without a model (`edgemoe evaluate --profile`).

The profile's tokens (a routing trace, or any profile) are replayed through the `simulate` backend: users
send requests whose rows are contiguous runs of their domain's tokens (runtime.sim.workload). Latency, p99,
traffic and remote ratio come out as in `edgemoe demo`; quality columns (ppl, retention) stay empty, since
no model runs. A method's PLACEMENT is a planner name, "all-local", or a placement file written by
`edgemoe plan --out` - so a placement planned on one trace can be scored on another ("plan on Monday's
trace, evaluate on Tuesday's"): the file is used as is, and only the evaluation profile's routing is replayed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from edgemoe.errors import EdgeMoEError

from .pipeline import Pipeline, is_placement_file

# What `edgemoe evaluate --profile` compares when no --method is given: exact execution on each placement
# family, plus OrderMoE's runtime on its own placement.
DEFAULT_METHODS = ("uniform=uniform:exact", "greedy=greedy:exact", "lfu=lfu:exact", "eplb=eplb:exact",
                   "slimcaching=slimcaching:exact", "ordermoe=ordermoe:exact", "ordermoe-runtime=ordermoe:ordermoe")

ILP_FACTS = ("stopped_by", "proven_optimal", "deterministic", "mip_gap", "mip_dual_bound", "mip_node_count")


def replay_profile(profile, cluster, methods: Sequence, mode: str = "migrate", workload=None,
                   log: Callable[[str], None] = print, name: str = "replay", profile_path: str = "",
                   plan_profile=None, skip_failed_plans: bool = False) -> dict:
    """Every method (eval.experiment.MethodSpec) on `cluster` with `profile`'s routing replayed; a results dict.

    workload: runtime.sim.workload.Workload (default 64 requests of 16 prompt + 16 generated tokens, 20 req/s).
    plan_profile: what planners and runtime policies know (statistics, groups, look-ahead); default `profile`.
    Given another profile of the same model and domains, evaluation is out of sample: placements and
    policies are built from `plan_profile`, and only `profile`'s tokens are replayed.
    skip_failed_plans: a planner that raises EdgeMoEError (e.g. the ILP without a feasible point within its
    time limit) drops its methods, listed under doc["skipped"], instead of failing the run.
    """
    from edgemoe.cluster.cost import user_domain_index
    from edgemoe.cluster.load import load_cluster
    from edgemoe.cluster.schema import Cluster
    from edgemoe.plan.objective import expected_latency
    from edgemoe.plan.problem import plan_problem
    from edgemoe.results import results_dict
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.metrics import method_entry
    from edgemoe.runtime.sim.workload import Trace, Workload

    workload = workload or Workload(num_requests=64, prompt_tokens=16, gen_tokens=16, rate_per_s=20.0)
    cluster_obj = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    known = profile if plan_profile is None else plan_profile
    if (known.L, known.E, known.K) != (profile.L, profile.E, profile.K) or known.meta.domains != profile.meta.domains:
        raise EdgeMoEError(f"planning profile ({known.L}, {known.E}, {known.K}, domains {known.meta.domains}) and evaluation "
                           f"profile ({profile.L}, {profile.E}, {profile.K}, domains {profile.meta.domains}) must match")
    fallback = any(u.domain not in profile.meta.domains for u in cluster_obj.users)
    pipe = Pipeline(plan_problem(known, cluster_obj, domain_fallback=fallback), mode)
    _, domain_map = user_domain_index(cluster_obj, profile.meta.domains, fallback)
    trace = Trace.from_profile(profile)
    placements: dict = {}
    entries: dict = {}
    skipped: dict = {}
    failed: dict = {}
    for spec in methods:
        key = pipe.key(spec.placement, spec.placement_params)
        if key in failed:
            skipped[spec.name] = failed[key]
            continue
        new = not pipe.has(spec.placement, spec.placement_params)
        try:
            planned = pipe.planned(spec.placement, spec.placement_params)
        except EdgeMoEError as exc:
            if not skip_failed_plans:
                raise
            failed[key] = skipped[spec.name] = f"placement {spec.placement!r} failed: {exc}"
            log(f"  {spec.name:<24} skipped: {exc}")
            continue
        if new:
            placements[spec.placement] = _placement_record(planned, spec.placement,
                                                           expected_latency(pipe.problem, planned.placement.hosts))
        ctx = planned.context
        t0 = time.perf_counter()
        metrics = pipe.simulate(ctx, make_policy(spec.policy, ctx, **spec.policy_params), trace, workload)
        entries[spec.name] = method_entry(metrics, spec.placement, spec.policy, ppl=None, quality_retention=None,
                                          policy_params=spec.policy_params, mode=mode, cluster=cluster_obj.name)
        m = entries[spec.name]
        log(f"  {spec.name:<24} mean {m['latency_ms']['mean']:9.2f} ms  p99 {m['latency_ms']['p99']:9.2f} ms  "
            f"remote {m['remote_ratio']:.3f}  ({time.perf_counter() - t0:.1f} s)")
    config = {"name": name, "cluster": cluster_obj.name, "mode": mode, "backend": "simulate", "replay": True,
              "methods": [asdict(s) for s in methods], "workload": asdict(workload), "domain_map": domain_map,
              "profile": {"path": profile_path, "model": profile.meta.model, "data": profile.meta.data,
                          "tokens": profile.num_tokens, "domains": list(profile.meta.domains),
                          "similarity": profile.meta.similarity, "weights_hash": profile.meta.weights_hash},
              "planned_on": None if plan_profile is None else {"model": known.meta.model, "data": known.meta.data,
                                                               "tokens": known.num_tokens}}
    doc = results_dict(config, entries)
    doc["placements"] = placements
    doc["skipped"] = skipped
    return doc


def _placement_record(planned, placement: str, objective_s: float) -> dict:
    """What the results file keeps of one placement: copies, bytes, planning CPU time, the planners' model
    objective on the planning profile (in sample) and the ILP's stopping facts."""
    pl = planned.placement
    return {"method": pl.method, "from_file": is_placement_file(placement), "copies": pl.replicas().tolist(),
            "copies_mean": float(pl.replicas().mean()), "bytes_used": pl.bytes_used().tolist(),
            "plan_cpu_seconds": round(planned.cpu_s, 3), "plan_objective_s": objective_s,
            **{k: pl.params[k] for k in ILP_FACTS if k in pl.params}}


def evaluate_profile_file(profile_dir: str | Path, cluster: str, methods: Sequence, out: str | Path,
                          mode: str = "migrate", workload=None, log: Callable[[str], None] = print,
                          plan_profile_dir: str | Path | None = None) -> Path:
    """Load a profile folder, replay it (replay_profile) and write the results file atomically.

    plan_profile_dir: a profile to plan on and to build the policies' knowledge from (out of sample)."""
    from edgemoe.profile import load_profile
    from edgemoe.results import write_document

    profile = load_profile(profile_dir)
    known = None if plan_profile_dir is None else load_profile(plan_profile_dir)
    log(f"replaying {profile.num_tokens:,} tokens of {profile.meta.model} ({profile.meta.data}) on {cluster}, {mode} mode"
        + ("" if known is None else f"; planned on {known.num_tokens:,} tokens of {known.meta.data}"))
    doc = replay_profile(profile, cluster, methods, mode=mode, workload=workload, log=log, name=Path(out).stem,
                         profile_path=str(profile_dir), plan_profile=known)
    return write_document(out, doc)
