"""What the benchmark scripts share: the results folder, the fastest-of-N timing helper, the edge8 setup of
the Ray benchmarks, and the serving benchmarks' Ray service (started and torn down in one place) and table. Scripts run as modules from the repository root (`python -m bench.speed.simulator`), so
they import this as `bench.common` (no `sys.path` edits)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def fastest_run(repeats: int, run, *args, **kwargs):
    """(result, wall s, CPU s) of `run(*args, **kwargs)` called `repeats` times (at least once), keeping the
    fastest wall and CPU time, as timeit does: on a shared machine the slower repeats measure the other
    processes. `run` must give the same result every time (the benchmarks' runs are deterministic); the last
    one is returned."""
    import time

    wall = cpu = math.inf
    result = None
    for _ in range(max(int(repeats), 1)):
        w0, c0 = time.perf_counter(), time.process_time()
        result = run(*args, **kwargs)
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return result, wall, cpu


def setup(policy: str):
    """(ctx, model path) for edge8 with the default model, the ordermoe placement, home mode."""
    from edgemoe.cluster import load_cluster
    from edgemoe.eval.experiment import ExperimentConfig, cached_profile, default_specs
    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.models.loader import resolve_model_path
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan
    from edgemoe.runtime import make_context

    cfg = ExperimentConfig(calib_tokens=8000)
    adapter, tok = load_moe("default"), load_tokenizer("default")
    profile = cached_profile(adapter, tok, default_specs(cfg)[1], cfg, print)
    cluster = load_cluster("edge8")
    fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
    problem = plan_problem(profile, cluster, domain_fallback=fallback)
    placement = plan(problem, "ordermoe")
    from edgemoe.runtime.dense import dense_cost_of_model

    ctx = make_context(profile, cluster, placement, mode="home", domain_fallback=fallback,
                       dense=dense_cost_of_model(adapter))  # the dense part as the demo counts it
    return ctx, resolve_model_path("default")


def environment(**extra) -> dict:
    """What every results file records about its run (`edgemoe.results.environment`: versions, git commit and
    whether the tree was dirty, UTC time, load average, CPU seconds so far), plus `extra`. Call it when the
    document is written, so that `cpu_s` covers the whole run."""
    from edgemoe.results import environment as base

    return {**base(), **extra}


def merge_results(files, part_keys=("environment", "load_average_start", "load_average_end", "cpu_s", "wall_s"),
                  environment_cpu: str = "cpu_s") -> dict:
    """One results document from part files of one study run apart (`--merge`): the first part's record with
    every part's models in order, each part's `part_keys` under `parts`, the CPU seconds added up, the longest
    wall, the highest final load. environment_cpu: what the merged `environment.cpu_s` adds up, each part's
    "cpu_s" or its "environment" record's own."""
    from edgemoe.io import read_json

    docs = [read_json(f, what="results file") for f in files]
    env_cpu = sum(d["cpu_s"] if environment_cpu == "cpu_s" else d["environment"]["cpu_s"] for d in docs)
    return {**docs[0], "models": [m for d in docs for m in d["models"]],
            "parts": [{k: d[k] for k in part_keys} for d in docs],
            "cpu_s": round(sum(d["cpu_s"] for d in docs), 1), "wall_s": max(d["wall_s"] for d in docs),
            "load_average_end": max((d["load_average_end"] for d in docs), key=lambda v: v[0]),
            # the parts' CPU s added up (they ran apart); the rest of the record is the first part's
            "environment": {**docs[0]["environment"], "cpu_s": round(env_cpu, 1)}}


@contextmanager
def ray_serving(policy: str, log=print, max_running: int = 64, max_queue: int = 64):
    """(Deployment, RayEngine, FastAPI app) as `edgemoe serve --backend ray --policy POLICY` makes them (the
    default model on edge8, the placement and profile `serve` plans itself, cached; links emulated). On exit
    the ingress closes, the deployment's actors go and the private Ray instance stops, also after an error."""
    from edgemoe.distributed.cli import launch
    from edgemoe.distributed.serve import stop_ray
    from edgemoe.models import load_tokenizer
    from edgemoe.serve.api import create_app
    from edgemoe.serve.ray_engine import RayEngine
    from edgemoe.serve.setup import DeploymentSpec, load_deployment
    from edgemoe.serve.telemetry import Telemetry

    base = load_deployment(DeploymentSpec(), log=log)
    try:
        dep = launch("edge8", Path(base.sources["placement"]["path"]), Path(base.sources["profile"]["path"]), "default",
                     policy, [], "home", "bf16", base.domain_fallback, True, None, 1.0, log)
        try:
            engine = RayEngine(dep, load_tokenizer("default"), max_running=max_running, max_queue=max_queue,
                               telemetry=Telemetry(dep.cfg.ctx.node_names, policies=(policy,)))
            try:
                yield dep, engine, create_app(engine, "default")
            finally:
                engine.close()
        finally:
            dep.shutdown()
    finally:
        stop_ray()


SERVING_COLUMNS = (("tok/s", "tokens_per_s", 8), ("TTFT p50", "ttft_ms_p50", 9), ("TTFT p99", "ttft_ms_p99", 9),
                   ("ITL p50", "itl_ms_p50", 8), ("ITL p99", "itl_ms_p99", 8))


def print_serving_table(results: dict, extra: tuple = ()) -> None:
    """Print the serving benchmarks' table: one line per policy and row of results {policy: {row name: row}}, a
    row being `bench.speed.serving.summarise`'s dict (entries that are not dicts are skipped); extra: more
    (header, key, width) columns after SERVING_COLUMNS."""
    columns = SERVING_COLUMNS + tuple(extra)
    print("\n" + f"{'policy':>9} {'streams':>8} " + " ".join(f"{h:>{w}}" for h, _, w in columns))
    for policy, rows in results.items():
        for name, r in rows.items():
            if isinstance(r, dict):
                print(f"{policy:>9} {name:>8} " + " ".join(f"{r.get(k)!s:>{w}}" for _, k, w in columns))


def planning_draw(profile) -> str:
    """A fingerprint of a profile's routing (sha256 of its topk and gates, 16 hex digits): what a result planned
    on a calibrated draw depends on, so a cache or a carried bound is reused only for the same draw."""
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(profile.topk).tobytes()
                          + np.ascontiguousarray(profile.gates).tobytes()).hexdigest()[:16]


# The look-ahead variants the backlog scripts (bench/studies/backlog_*.py) compare: H=0, H=2 on static tables
# (the default), H=2 with each kind of queue term, and H=2 whose tables price future stand-ins (`table_price`).
BACKLOG_VARIANTS = (("H0", {"horizon": 0}), ("H2", {"horizon": 2}), ("H2-now", {"horizon": 2, "backlog": "now"}),
                    ("H2-off", {"horizon": 2, "backlog": "off"}), ("H2-priced", {"horizon": 2, "table_price": True}))


def compare_backlogs(ctx, trace, workload, budget: float, row: dict) -> list[dict]:
    """Simulate ordermoe in every BACKLOG_VARIANTS setting on one scenario; print one JSON line per variant
    (`row` plus budget, method, mean and p99 ms, CPU s, load) and the ratios to H0; return the rows."""
    import json
    import os
    import time

    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.simulate import simulate

    rows, means = [], {}
    for name, params in BACKLOG_VARIANTS:
        c0 = time.process_time()
        m = simulate(ctx, make_policy("ordermoe", ctx, budget=budget, **params), trace, workload)
        means[name] = m.latency_ms["mean"]
        rows.append({**row, "budget": budget, "method": name, "mean_ms": m.latency_ms["mean"],
                     "p99_ms": m.latency_ms["p99"], "cpu_s": round(time.process_time() - c0, 1),
                     "load": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)
    h0 = means["H0"]
    print(f"# {' '.join(str(v) for v in row.values())}: "
          + "  ".join(f"{name}/H0 {means[name] / h0:.3f}" for name, _ in BACKLOG_VARIANTS[1:]), flush=True)
    return rows


def backlog_sweep(scenarios, budgets: dict, topk, gates, block_len: int, model: str, each=None) -> list[dict]:
    """The backlog scripts' loop: every scenario at each operating budget, ordermoe placed at that budget and
    `each(ctx, trace, workload, budget, labels)` run on it (a list of rows; default `compare_backlogs`, the
    BACKLOG_VARIANTS compared). A scenario is (labels, problem, mode, workload, context), `context(placement)`
    making the runtime context; topk, gates: [T, L, K] routing of the evaluation text. Rows are labelled model,
    then the scenario's labels, then the point."""
    from edgemoe.eval.experiment import eval_trace
    from edgemoe.plan import plan

    each = each or compare_backlogs
    rows = []
    for labels, problem, mode, workload, context in scenarios:
        for point, b in budgets.items():
            ctx = context(plan(problem, "ordermoe", mode=mode, budget=b))
            trace = eval_trace(topk, gates, ctx.user_domain, block_len)
            rows += each(ctx, trace, workload, b, {"model": model, **labels, "point": point})
    return rows


BACKLOG_FILE = RESULTS / "backlog_scenarios.json"
BACKLOG_NOTE = ("The queue-aware look-ahead (OrderMoEPolicy backlog=) on more scenario sets, one part per command "
                "of bench/studies/backlog_{paper,demo,scaling}.py (each run replaces its own part). Paper-scale "
                "rows: ordermoe placement on testbed8, budget 0.05, the paper-scale workload; demo rows: edge8, "
                "the demo's operating-point budgets and workload (64 requests, 20 req/s); scaling rows: "
                "bench.studies.scaling's generated clusters, ordermoe placements only. cpu_s per row includes "
                "numba compiles: no timing.")


def _backlog_parts(doc: dict) -> dict:
    """{command: part} of a backlog_scenarios document; a file from before the parts (rows assembled by hand,
    each naming its script as `bench/studies/backlog_X.py ARGS`) gives one part per command, with no
    environment and `legacy` set, so its rows stay until a run of the same script and model replaces them."""
    if "parts" in doc:
        return dict(doc["parts"])
    parts: dict = {}
    for r in doc.get("rows") or []:
        cmd = r.get("command", "")
        key = cmd.replace("bench/", "", 1).replace(".py", "", 1).replace("/", ".", 1) + " (by hand)"
        part = parts.setdefault(key, {"environment": None, "legacy": True, "code": r.get("code"), "rows": []})
        part["rows"].append({k: v for k, v in r.items() if k not in ("command", "code")})
    return parts


def write_backlog_part(rows: list[dict], argv: list[str] | None = None) -> Path:
    """Put `rows` into bench/results/backlog_scenarios.json as the part of the command that made them (the
    script and its arguments, `sys.argv` by default), with that run's environment; the other commands' parts
    stay, except earlier parts of the same script and model (whatever their other arguments: a run with more
    methods or modes supersedes the narrower one), which it replaces. The file's own
    `environment` is the newest part's, with `part_commits` (every part's commit, "" where not recorded) and
    `cpu_s` the sum over the parts (None while some part does not record it); `rows` holds every part's rows
    in turn, each with its `command`. Written atomically."""
    import json
    import sys

    from edgemoe.io import atomic_write_json, jsonable

    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    module = (".".join(script.relative_to(RESULTS.parent).with_suffix("").parts)
              if script.is_relative_to(RESULTS.parent) else script.stem)
    command = " ".join([module, *argv[1:]])
    same = " ".join([module, *argv[1:2]]) + " "  # script and model
    parts = _backlog_parts(json.loads(BACKLOG_FILE.read_text()) if BACKLOG_FILE.is_file() else {})
    parts = {c: p for c, p in parts.items() if not c.startswith(same)}
    parts[command] = {"environment": environment(), "rows": rows}
    envs = [p.get("environment") or {} for p in parts.values()]
    cpu = [e.get("cpu_s") for e in envs]
    env = {**max((e for e in envs if e), key=lambda e: e["time_utc"]),
           "cpu_s": None if None in cpu else round(sum(cpu), 1),
           "part_commits": sorted({(e.get("git_commit") or "")[:7] for e in envs})}
    flat = [{**r, "command": f"python -m bench.{c}"} for c, p in parts.items() for r in p["rows"]]
    return atomic_write_json(BACKLOG_FILE, jsonable({"benchmark": "backlog_scenarios", "issue": "21 item 3",
                                                     "note": BACKLOG_NOTE, "environment": env, "parts": parts,
                                                     "rows": flat}))
