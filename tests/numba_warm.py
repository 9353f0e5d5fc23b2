"""Fill numba's on-disk cache once before the pytest-xdist workers need it (see `conftest.pytest_configure`).

Why: every `@njit(cache=True)` function compiles on its first call in a process and then writes
`__pycache__/*.nbi|nbc`; a process that finds those files loads them instead. On a fresh clone each xdist
worker met every compiled function cold and compiled its own copy (the OrderMoE wave loop alone was about
100 CPU s then; docs/runtime.md, "Compile time"), so the compile work was done once per worker. Here it is done once, split in three groups that run
side by side in three processes: the OrderMoE wave loop; OrderMoE's compiled decode path (the local, Ray and
serving backends' per-layer call); everything else.

Each group calls the package's public entry points on tiny inputs, so numba compiles the same signatures the
tests then call (float64/int64 arrays built by the package itself). A signature missed here is only compiled
later by the worker that needs it, as before: this file changes no test's outcome, only who compiles first.

Run as `python tests/numba_warm.py GROUP` (GROUP: ordermoe, rest or decode).
"""

from __future__ import annotations

import sys

GROUPS = ("ordermoe", "rest", "decode")


def _deployment(top_k: int = 2):
    """(profile, context, trace, scenario) of a tiny edge8 deployment (3 layers, 8 experts, 12 requests)."""
    from edgemoe.cluster import load_cluster
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan
    from edgemoe.profile import synthetic_profile
    from edgemoe.runtime import make_context
    from edgemoe.runtime.sim.workload import Trace, Workload, build_scenario

    profile = synthetic_profile(num_layers=3, num_experts=8, top_k=top_k, num_tokens=200, seed=top_k)
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster, domain_fallback=True), "lfu")
    ctx = make_context(profile, cluster, placement, mode="migrate", domain_fallback=True)
    trace = Trace.from_profile(profile)
    wl = Workload(num_requests=12, prompt_tokens=3, gen_tokens=4, arrival="poisson", rate_per_s=80.0, seed=0)
    return profile, ctx, trace, build_scenario(ctx.user_weight, ctx.user_domain, trace, wl)


def warm_ordermoe() -> None:
    """The OrderMoE decision inside the fast engine's compiled loop (`runtime.sim.ordermoe_loop`)."""
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.simulate import run_fast

    _, ctx, trace, sc = _deployment()
    run_fast(ctx, make_policy("ordermoe", ctx, budget=0.05, horizon=2), trace, sc, 1e-3, compiled=True)


def warm_rest() -> None:
    """The other compiled loops (exact, slimcaching and drop rules; the per-wave engine with OrderMoE's compiled
    decode path), SlimCaching's DP and beam, the OrderMoE planner's replay kernel."""
    from edgemoe.plan import plan_problem
    from edgemoe.plan.base import plan
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.sim.simulate import run_fast

    profile, ctx, trace, sc = _deployment()
    for name in ("exact", "slimcaching", "drop"):
        run_fast(ctx, make_policy(name, ctx), trace, sc, 1e-3, compiled=True)
    run_fast(ctx, make_policy("ordermoe", ctx, budget=0.05, horizon=2), trace, sc, 1e-3, compiled=False)
    problem = plan_problem(profile, "edge8", domain_fallback=True)
    for method in ("slimcaching", "ordermoe"):
        plan(problem, method)
    plan(problem, "slimcaching", enum_max=0, beam_width=4)  # the beam instead of the enumeration


def warm_decode() -> None:
    """OrderMoE's `decide` in one compiled call (`ordermoe_kernel.DecodePath`), as the backends call it: one int
    layer at a time."""
    import numpy as np

    from edgemoe.runtime import make_policy

    profile, ctx, _, _ = _deployment()
    rows = np.arange(4)
    policy = make_policy("ordermoe", ctx, budget=0.05, horizon=2)
    state = policy.start(rows % ctx.num_users, tokens=rows)
    for layer in range(ctx.num_layers):
        policy.decide(layer, profile.topk[rows, layer].astype(np.int64), profile.gates[rows, layer], state, None)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in GROUPS:
        print(f"usage: numba_warm.py {{{','.join(GROUPS)}}}", file=sys.stderr)
        return 2
    {"ordermoe": warm_ordermoe, "rest": warm_rest, "decode": warm_decode}[argv[0]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
