"""Adaptive weights: two kinds of user on edge8, one with a tight quality budget and one with a loose one.

    python -m bench.studies.adaptive

The simulator feeds `observe()` with each finished pass (measured latency, the policy's estimate, budget
spent and granted). Even users get a tight allowance, odd users a loose one; the run records per user the
budget spent / granted and the final latency and quality weights, which diverge. Synthetic profile (L=4,
E=8, K=2), the ordermoe placement, migrate mode, H=1. Writes bench/results/adaptive.json.
"""

from __future__ import annotations

import numpy as np

from bench.common import RESULTS, environment
from edgemoe.cluster import load_cluster
from edgemoe.io import atomic_write_json
from edgemoe.plan import plan_problem
from edgemoe.plan.base import plan
from edgemoe.profile import synthetic_profile
from edgemoe.runtime import make_context, make_policy
from edgemoe.runtime.sim.simulate import simulate
from edgemoe.runtime.sim.workload import Trace, Workload

TIGHT, LOOSE = 0.1, 5.0


def main() -> None:
    profile = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=2000, seed=3)
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster, domain_fallback=True), "ordermoe")
    ctx = make_context(profile, cluster, placement, mode="migrate", domain_fallback=True)
    U = ctx.num_users
    budget = np.where(np.arange(U) % 2 == 0, TIGHT, LOOSE)
    pol = make_policy("ordermoe", ctx, budget=budget, horizon=1)
    m = simulate(ctx, pol, Trace.from_profile(profile), Workload(num_requests=256, prompt_tokens=16, gen_tokens=16, seed=0))
    spent, granted = np.array(m.extra["budget_spent_by_user"]), np.array(m.extra["budget_granted_by_user"])
    share = np.divide(spent, granted, out=np.zeros(U), where=granted > 0)
    users = [{"user": ctx.user_names[u], "allowance": float(budget[u]), "kind": "tight" if budget[u] == TIGHT else "loose",
              "spent": float(spent[u]), "granted": float(granted[u]), "spent_share": float(share[u]),
              "within_budget_2pct": bool(spent[u] <= 1.02 * granted[u] + 1e-12),
              "quality_weight": float(pol.quality_weight[u]), "latency_weight": float(pol.alpha[u])} for u in range(U)]
    kinds = {k: [r for r in users if r["kind"] == k and r["granted"] > 0] for k in ("tight", "loose")}
    summary = {k: {"users": len(v), "mean_quality_weight": float(np.mean([r["quality_weight"] for r in v])),
                   "mean_spent_share": float(np.mean([r["spent_share"] for r in v]))} for k, v in kinds.items()}
    summary["all_within_budget_2pct"] = all(r["within_budget_2pct"] for r in users)
    atomic_write_json(RESULTS / "adaptive.json", {"benchmark": "adaptive", "summary": summary, "users": users,
                                                 "latency_ms": m.latency_ms, "environment": environment()})
    for r in users:
        print(f"{r['user']:>10} {r['kind']:5s} spent {r['spent_share']:6.1%} of its budget  quality weight "
              f"{r['quality_weight']:.3f}  latency weight {r['latency_weight']:.3f}")
    print(summary)


if __name__ == "__main__":
    main()
