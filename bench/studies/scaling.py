"""Does OrderMoE's advantage hold as servers are added? (issue 9, section 7)

Generated heterogeneous clusters (`edgemoe.cluster.presets.generate`, internet topology, seed 0) of 4, 8, 16
and 32 servers with the same number of users per server, the same per-user request rate and the same
requests per user, so every size carries the same load per server. Migrate mode (OrderMoE's), the demo's
default model, its cached calibration profile and the routing of the demo's evaluation text (WikiText-2
test), simulated with the demo's workload shape (prompt 32, 32 generated tokens, Poisson arrivals).

Rows per size: exact execution on the activation-aware, EPLB, SlimCaching and OrderMoE placements, and the
ordermoe policy (H = 2) at the demo's two named operating points, `paper` (perplexity +<= 7.8%) and `strict`
(+<= 1%), each on an OrderMoE placement planned for that point's budget. The budgets are read from the
demo's committed results for the same model (`bench/results/demo/ordermoe-edge8[-MODEL].json`,
`operating_points`), where they were calibrated on calibration text; the quality they buy is the demo's.
The model defaults to `default-upcycled`, the kind of model OrderMoE was designed for.

    PYTHONPATH=src python -m bench.studies.scaling [--model default-upcycled] [--sizes 4 8 16 32] [--cache-dir runs/cache]

Writes bench/results/scaling.json and bench/results/scaling.png. Ratios: OrderMoE's rows against the best
exact-execution baseline among the *other* placements (activation-aware, EPLB, SlimCaching), and the
ordermoe policy against exact execution on its own placement. `--rederive` recomputes them from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USERS_PER_SERVER = 2  # edge8 has 16 users on 8 servers
RATE_PER_USER = 1.25  # requests/s: the demo's 20 req/s over edge8's 16 users
REQUESTS_PER_USER = 4  # the demo's 64 requests over 16 users
POINTS = ("paper", "strict")
EXACT = ("activation-aware", "eplb", "slimcaching", "ordermoe")


def operating_budgets(model: str) -> dict[str, float]:
    """{point: budget} of the demo's committed results for `model` (calibrated on calibration text)."""
    name = "ordermoe-edge8.json" if model == "default" else f"ordermoe-edge8-{Path(model).name}.json"
    path = ROOT / "bench" / "results" / "demo" / name
    if not path.is_file():
        raise SystemExit(f"{path}: missing; run `edgemoe demo --out bench/results/demo` first (it calibrates the "
                         f"operating points)")
    points = json.loads(path.read_text())["operating_points"]["points"]
    return {p: float(points[p]["budget"]) for p in POINTS}


def size_setting(profile, cfg, servers: int):
    """The setting of one size: (cluster, domain_fallback, problem, groups, workload), with the same users per
    server, request rate per user and requests per user at every size (so the same load per server)."""
    from edgemoe.cluster.presets import generate
    from edgemoe.plan import plan_problem
    from edgemoe.profile.groups import groups_for
    from edgemoe.runtime.sim.workload import Workload

    users = USERS_PER_SERVER * servers
    cluster = generate(servers, users, seed=0, topology="internet")
    fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
    problem = plan_problem(profile, cluster, domain_fallback=fallback)
    workload = Workload(num_requests=REQUESTS_PER_USER * users, prompt_tokens=cfg.prompt_tokens,
                        gen_tokens=cfg.gen_tokens, rate_per_s=RATE_PER_USER * users, seed=cfg.seed)
    return cluster, fallback, problem, groups_for(profile), workload


def run_size(profile, topk, gates, cfg, servers: int, budgets: dict[str, float], log) -> dict:
    from edgemoe.eval.experiment import eval_trace
    from edgemoe.plan import plan
    from edgemoe.runtime import make_context, make_policy
    from edgemoe.runtime.sim.simulate import simulate

    cluster, fallback, problem, groups, workload = size_setting(profile, cfg, servers)
    rows, plan_s, contexts = {}, {}, {}
    # the exact-execution placements, then one OrderMoE placement per operating point, planned for its budget
    plans = [(m, m, {"mode": "migrate"} if m == "ordermoe" else {}) for m in EXACT]
    plans += [(f"ordermoe-{p}", "ordermoe", {"mode": "migrate", "budget": b}) for p, b in budgets.items()]
    for label, method, params in plans:
        t0, c0 = time.perf_counter(), time.process_time()
        placement = plan(problem, method, **params)
        plan_s[label] = {"wall": round(time.perf_counter() - t0, 3), "cpu": round(time.process_time() - c0, 3)}
        contexts[label] = make_context(profile, cluster, placement, mode="migrate", groups=groups,
                                       domain_fallback=fallback)
    trace = eval_trace(topk, gates, contexts["ordermoe"].user_domain, cfg.block_len)
    # (row, context label, placement method, policy, policy params)
    runs = [(f"exact@{m}", m, m, "exact", {}) for m in EXACT]
    runs += [(p, f"ordermoe-{p}", "ordermoe", "ordermoe", {"budget": b, "horizon": 2}) for p, b in budgets.items()]
    for name, label, placement, policy, params in runs:
        ctx = contexts[label]
        m = simulate(ctx, make_policy(policy, ctx, **params), trace, workload)
        rows[name] = {"placement": placement, "policy": policy, "policy_params": params,
                      "latency_ms": {"mean": m.latency_ms["mean"], "p99": m.latency_ms["p99"]},
                      "substitution_ratio": m.substitution_ratio, "remote_ratio": m.remote_ratio}
        log(f"{servers:3d} servers  {name:<22} mean {m.latency_ms['mean']:7.2f} ms  p99 {m.latency_ms['p99']:7.2f} ms")
    return derive({"servers": servers, "users": cluster.num_users, "cluster": cluster.name, "requests": workload.num_requests,
                   "rate_per_s": workload.rate_per_s, "plan_seconds": plan_s, "methods": rows})


def derive(size: dict) -> dict:
    """Add the ratios: OrderMoE's rows against the best exact-execution *baseline* (the other placements:
    activation-aware, EPLB, SlimCaching) and against exact execution on OrderMoE's own placement."""
    rows = size["methods"]
    baselines = {k: v for k, v in rows.items() if v["policy"] == "exact" and v["placement"] != "ordermoe"}
    best = min(baselines, key=lambda k: baselines[k]["latency_ms"]["mean"])

    def ratio(a: str, b: str) -> dict:
        return {s: rows[a]["latency_ms"][s] / rows[b]["latency_ms"][s] for s in ("mean", "p99")}

    ours = [k for k, v in rows.items() if v["placement"] == "ordermoe"]
    size["best_exact"] = best
    size["vs_best_exact"] = {k: ratio(k, best) for k in ours}
    size["vs_exact_on_ordermoe"] = {k: ratio(k, "exact@ordermoe") for k in ours if k != "exact@ordermoe"}
    return size


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edgemoe.io import atomic_write_figure

    sizes = [r["servers"] for r in doc["sizes"]]
    names = list(doc["sizes"][0]["methods"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for stat, ax in zip(("mean", "p99"), axes[:2], strict=True):
        for name in names:
            ax.plot(sizes, [r["methods"][name]["latency_ms"][stat] for r in doc["sizes"]], marker="o", label=name,
                    color=f"C{names.index(name)}",
                    linestyle="-" if name in POINTS or name == "exact@ordermoe" else "--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("servers (2 users each)")
        ax.set_ylabel(f"{stat} latency per token (ms)")
        ax.set_title(f"{stat} latency, migrate mode")
    axes[0].legend(fontsize=7)
    ax = axes[2]
    for i, name in enumerate(doc["sizes"][0]["vs_best_exact"]):
        for stat, style in (("mean", "-"), ("p99", ":")):
            ax.plot(sizes, [r["vs_best_exact"][name][stat] for r in doc["sizes"]], marker="o", linestyle=style,
                    color=f"C{i + 3}", label=f"{name} {stat}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("servers")
    ax.set_ylabel("/ best exact-execution baseline (other placements)")
    ax.set_title("OrderMoE against the best exact baseline")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write_figure(fig, path)


def main() -> None:
    from bench.common import environment
    from bench.studies.ordermoe_placement import demo_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default-upcycled")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "cache"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scaling.json"))
    ap.add_argument("--rederive", action="store_true", help="recompute ratios and the figure from --out only")
    args = ap.parse_args()
    out = Path(args.out)
    if args.rederive:
        doc = json.loads(out.read_text())
        doc["sizes"] = [derive(r) for r in doc["sizes"]]
        finish(doc, out)
        return
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    budgets = operating_budgets(args.model)
    profile, topk, gates, cfg = demo_inputs(cache, args.model)
    c0 = time.process_time()
    sizes = [run_size(profile, topk, gates, cfg, s, budgets, print) for s in args.sizes]
    doc = {"schema": "edgemoe.bench.scaling/2", "environment": environment(),
           "load_average": list(os.getloadavg()),
           "config": {"model": cfg.model, "profile": profile.meta.data, "mode": "migrate", "topology": "internet",
                      "seed": 0, "users_per_server": USERS_PER_SERVER, "rate_per_user_per_s": RATE_PER_USER,
                      "requests_per_user": REQUESTS_PER_USER, "prompt_tokens": cfg.prompt_tokens,
                      "gen_tokens": cfg.gen_tokens, "operating_points": budgets, "horizon": 2,
                      "budgets_from": "bench/results/demo operating_points (calibrated on calibration text)"},
           "cpu_seconds": round(time.process_time() - c0, 1), "sizes": sizes}
    finish(doc, out)


def finish(doc: dict, out: Path) -> None:
    from edgemoe.io import atomic_write_json

    atomic_write_json(out, doc)
    plot(doc, out.with_suffix(".png"))
    for r in doc["sizes"]:
        print(f"{r['servers']:3d} servers: best exact baseline {r['best_exact']}; "
              + "; ".join(f"{k} mean x{v['mean']:.3f} p99 x{v['p99']:.3f}" for k, v in r["vs_best_exact"].items()))


if __name__ == "__main__":
    main()
