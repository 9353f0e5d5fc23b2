"""Print the README's results tables from the committed results files (nothing is re-measured).

    python -m bench.tools.tables            # Markdown on stdout
Every figure in the README's results section is pasted from this output.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgemoe.results import markdown_table

ROOT = Path(__file__).resolve().parents[1]  # bench/
RESULTS = ROOT / "results"


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _table(head: list[str], rows: list[list]) -> str:
    return markdown_table([head] + [[str(c) for c in r] for r in rows])


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _num(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _worst_ordermoe(pol: dict, rows: int) -> float:
    """The ordermoe policy's largest CPU microseconds per token-layer over every setup at `rows` rows per call."""
    return max((r["cpu_us_per_token_layer"] for r in pol["rows"]
                if r["policy"].startswith("ordermoe") and r["rows_per_call"] == rows), default=float("nan"))


def demo_tables(folder: str = "demo") -> list[str]:
    out = []
    for path in sorted((RESULTS / folder).glob("*.json")):
        if path.name.startswith("."):  # the output marker, not a results file
            continue
        res = _load(path)
        cfg = res["config"]
        out.append(f"**{cfg['name']}**, model `{cfg.get('model', 'default')}` ({cfg['cluster']}, {cfg['mode']} mode; `{path.relative_to(ROOT.parent)}`; "
                   f"exact perplexity {res.get('ppl_exact', float('nan')):.3f} on {cfg.get('eval_data')})\n")
        rows = []
        for name, m in res["methods"].items():
            rows.append([name, f"{m['latency_ms']['mean']:.1f}", f"{m['latency_ms']['p99']:.1f}", f"{m['ttft_ms']['mean']:.1f}",
                         f"{m['traffic_bytes_per_1k_tokens'] / 1e6:.2f}", f"{m['remote_ratio']:.3f}",
                         f"{m['substitution_ratio']:.3f}", f"{m['ppl']:.3f}", _pct(m.get('ppl_rel_increase')),
                         _num(m.get('top1_agreement'), 3), f"{m['throughput_tokens_per_s']:.0f}"])
        out.append(_table(["method", "mean ms", "p99 ms", "TTFT ms", "MB/1k tok", "remote", "stand-in", "ppl", "ppl +%",
                           "top-1 agr.", "tok/s"], rows))
        # the headline statements (the H rows and the all-local multiples are in the table already)
        for line in res.get("summary", []):
            if line.startswith(("paper ", "strict ", "oracle ", "slimcaching placement")):
                out.append(f"- {line}")
        sweeps = res.get("budget_sweep") or {}
        if sweeps:
            names = list(sweeps)
            out.append(f"\nBudget sweeps ({', '.join(names)}; the calibrated operating points' budgets included):\n")
            rows = [[f"{p['budget']:.4g}"] + [f"{q['latency_ms_mean']:.1f} ms / {_pct(q.get('ppl_rel_increase'))}"
                                              for q in (next(x for x in sweeps[n] if x["budget"] == p["budget"]) for n in names)]
                    for p in sweeps[names[0]]]
            out.append(_table(["budget"] + [f"{n}: mean / ppl +%" for n in names], rows))
        for name, pts in (res.get("lookahead_equal_quality") or {}).items():
            out.append(f"\nLook-ahead at equal quality: {name} against ordermoe-H0's latency at the same perplexity "
                       "increase (interpolated on H0's sweep):\n")
            out.append(_table(["budget", "ppl +%", f"{name} mean ms", "H0 mean ms at same ppl", "ratio"],
                              [[f"{p['budget']:.4g}", _pct(p["ppl_rel_increase"]), f"{p['latency_ms_mean']:.1f}",
                                _num(p.get("ordermoe-H0_latency_ms_at_same_ppl"), 1), _num(p.get("ratio"), 3)] for p in pts]))
        out.append("")
    return out


def planner_tables() -> list[str]:
    r = _load(RESULTS / "planners.json")
    if not r:
        return []
    out = ["**Planners** (`bench/results/planners.json`, `python -m bench.speed.planners`)\n"]
    rows = []
    for key, t in r["targets"].items():
        s = t["slimcaching"]
        sh = t["shape"]
        rows.append([key, f"{sh['num_layers']}x{sh['num_experts']}, K={sh['top_k']}", f"{s['seconds']:.2f} s (limit {t['limit_s']:.0f} s)", f"{s['objective_s'] * 1e3:.0f}",
                     f"{t['greedy']['objective_s'] * 1e3:.0f} ({t['greedy']['seconds']:.1f} s)", f"{t['lfu']['objective_s'] * 1e3:.0f}",
                     "met" if t["met"] else "missed"])
    out.append(_table(["scale", "shape", "slimcaching time", "slimcaching ms/token", "greedy ms/token (time)", "lfu ms/token",
                       "time target"], rows))
    gaps = r.get("ilp_gap") or []
    if gaps:
        keys = sorted({k for g in gaps for k in g if isinstance(g.get(k), dict) and "gap" in g[k] and k != "ilp"})
        rows = []
        for k in keys:
            vals = [g[k]["gap"] for g in gaps if isinstance(g.get(k), dict) and g[k].get("gap") is not None]
            if vals:
                rows.append([k, f"{100 * sum(vals) / len(vals):.1f}%", f"{100 * max(vals):.1f}%", len(vals)])
        out.append(f"\nGap to the ILP optimum on {len(gaps)} small instances:\n")
        out.append(_table(["planner", "mean gap", "max gap", "instances"], rows))
    p = r.get("preset")
    if p:
        pl = p["planners"]
        s = pl["slimcaching"]["objective_s"]
        rows = [[k, f"{v['objective_s'] * 1e3:.0f}", f"{100 * (s - v['objective_s']) / v['objective_s']:+.1f}%", f"{v['seconds']:.3f}"]
                for k, v in sorted(pl.items(), key=lambda kv: kv[1]["objective_s"])]
        out.append(f"\n{p['cluster']} with {p['profile']}: expected latency per token (K=2)\n")
        out.append(_table(["planner", "ms/token", "slimcaching vs it", "plan s"], rows))
    return out


def runtime_tables() -> list[str]:
    out = []
    pol = _load(RESULTS / "policies.json")
    if pol:
        w = pol["summary"].get("worst_batched_cpu") or pol["summary"]["worst_batched"]
        line = (f"**Policies** (`bench/results/policies.json`): worst batched decision cost "
                f"{w.get('cpu_us_per_token_layer', w['us_per_token_layer']):.1f} us CPU per token-layer ({w['policy']}, "
                f"{w['setup']}, {w['rows_per_call']} rows per call; target {pol['summary'].get('target_us', 10):g} us); "
                f"the ordermoe policy's worst at 64 and 1024 rows per call: {_worst_ordermoe(pol, 64):.1f} and "
                f"{_worst_ordermoe(pol, 1024):.1f} us CPU")
        part = _load(RESULTS / "policies_partial.json")
        if part:  # a subset re-run (bench/speed/policies.py --setups/--policies), e.g. on a quieter host
            line += (f"; in the subset re-run (`policies_partial.json`, {part['summary'].get('setups')}, load "
                     f"{part['summary'].get('load_average_1_5_15', ['?'])[0]:.1f}): {_worst_ordermoe(part, 64):.1f} and "
                     f"{_worst_ordermoe(part, 1024):.1f} us CPU")
        out.append(line + ".\n")
    sim = _load(RESULTS / "simulator.json")
    if sim:
        rows = [[r["scenario"], r["policy"], r["engine"], f"{r['token_layers']:,}", f"{r['events_per_s']:,.0f}"] for r in sim["rows"]]
        out.append("**Simulator** (`bench/results/simulator.json`, `python -m bench.speed.simulator`)\n")
        out.append(_table(["scenario", "policy", "engine", "token-layers", "events/s"], rows))
        out.append(f"\nTarget 1M events/s: {'met' if sim['meets_target'] else 'missed'} (best {sim['best']['events_per_s']:,.0f}).\n")
    rt = _load(RESULTS / "runtime.json")
    if rt:
        co, one = rt["call_overhead"], rt["one_request"]
        out.append("**Ray runtime** (`bench/results/runtime.json`, `python -m bench.ray.runtime`)\n")
        out.append(_table(["", "in-process", "Ray"], [
            ["one remote call (mean / p99 us)", f"{co['in_process']['mean_us']:.0f} / {co['in_process']['p99_us']:.0f}",
             f"{co['ray']['mean_us']:.0f} / {co['ray']['p99_us']:.0f}"],
            ["tokens/s, links off", f"{one['in_process_links_off']['tokens_per_s']:.1f}", f"{one['ray_links_off']['tokens_per_s']:.1f}"],
            ["tokens/s, links on", f"{one['in_process_links_on']['tokens_per_s']:.1f}", f"{one['ray_links_on']['tokens_per_s']:.1f}"],
        ]))
        load = rt.get("load", {})
        if load.get("measured"):
            m, s = load["measured"], load.get("predicted", {})
            out.append(f"\nClosed loop, {load['users']} users, {load['seconds']:.0f} s on 8 actors: {m['requests']} requests, "
                       f"errors {len(load['errors'])}, duplicates {load['duplicates']}; measured mean latency "
                       f"{m['latency_ms']['mean']:.1f} ms/token vs simulator {s.get('latency_ms', {}).get('mean', float('nan')):.1f} ms.\n")
    prof = _load(RESULTS / "profile_speed.json")
    if prof:
        out.append(f"**Profiling**: {prof['tokens']:,} tokens in {prof['seconds']:.1f} s ({prof['tokens_per_second']:,.0f} tok/s; "
                   f"target 50k in 120 s: {'met' if prof['met'] else 'missed'}; `python -m bench.speed.profile_speed`).\n")
    return out


def model_table() -> list[str]:
    recipe = _load(ROOT.parent / "src" / "edgemoe" / "assets" / "default_model" / "recipe.json")
    spec = _load(RESULTS / "default_model" / "specialisation.json")
    out = []
    if recipe:
        c = recipe["config"]
        out.append(f"**Default model** (`src/edgemoe/assets/default_model/recipe.json`): Mixtral format, {c['num_layers']} MoE layers x "
                   f"{c['num_experts']} experts, top-{c['top_k']}, hidden {c['hidden_size']}, expert FFN {c['intermediate_size']}, "
                   f"vocab {c['vocab_size']}, {recipe['parameters'] / 1e6:.2f}M parameters, {recipe['steps_done']} steps "
                   f"({recipe['tokens_seen'] / 1e6:.1f}M tokens) in {recipe['train_minutes']:.1f} min on 2 CPU cores.\n")
        out.append(_table(["held-out text"] + list(recipe["heldout_perplexity"]),
                          [["perplexity"] + [f"{v:.1f}" for v in recipe["heldout_perplexity"].values()]]))
    if spec:
        out.append("\nRouter specialisation (`bench/results/default_model/specialisation.json`):\n")
        L = len(spec["domain_expert_mutual_information_bits"])
        out.append(_table(["MoE layer"] + [str(i) for i in range(L)], [
            ["domain-expert MI (bits)"] + [f"{v:.3f}" for v in spec["domain_expert_mutual_information_bits"]],
            ["same, shuffled domains"] + [f"{v:.4f}" for v in spec["shuffled_domain_mutual_information_bits"]],
            ["usage entropy (bits, max 4)"] + [f"{v:.2f}" for v in spec["usage_entropy_bits"]],
            ["share of expert pairs cos > 0.5"] + [f"{v:.3f}" for v in spec["similarity"]["share_of_pairs_above"]["0.5"]],
        ]))
    return out


def ray_demo_tables() -> list[str]:
    tables = demo_tables("demo-ray")
    if not tables:
        return []
    return ["**The same comparisons measured on Ray actors** (`edgemoe demo --backend ray --out "
            "bench/results/demo-ray`: the first model, every server a process on this one 2-core machine, links "
            "and hardware emulated on a dilated clock; latency, traffic and ratios measured on Ray for one "
            "8+8-token request per user, perplexity from the local backend; the oracle and the budget sweeps "
            "simulated only)\n"] + tables


def main() -> None:
    for block in (model_table(), demo_tables(), planner_tables(), runtime_tables(), ray_demo_tables()):
        print("\n".join(block))
        print()


if __name__ == "__main__":
    main()
