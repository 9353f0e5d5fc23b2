"""The per-wave kernels keep no reference counting of their array arguments, and the in-place sort they now use.

numba increments and decrements the reference count of every array argument of a compiled function on entry
and on exit (an atomic add each); LLVM's pruning removes these pairs only from a function that calls no other
compiled function, allocates no array and has a single way out. `_decide_ordermoe` (about 100 array
arguments), `_decide_rows` and the engine's `_wave_step` (~55) are called once or twice per simulated wave; with
the counts kept, perf put them at 28% of the ordermoe simulator's CPU time. These tests compile each kernel afresh (numba's
disk cache keeps no IR) and read its LLVM IR, so that an edit that brings a count back fails here rather than
going unnoticed in a benchmark.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

numba = pytest.importorskip("numba")

from edgemoe.cluster import load_cluster  # noqa: E402
from edgemoe.plan import plan_problem  # noqa: E402
from edgemoe.plan.base import plan  # noqa: E402
from edgemoe.profile import synthetic_profile  # noqa: E402
from edgemoe.runtime import make_context, make_policy  # noqa: E402
from edgemoe.runtime.policies import ordermoe_kernel  # noqa: E402
from edgemoe.runtime.sim import engine, rules  # noqa: E402
from edgemoe.runtime.sim.run import Run  # noqa: E402
from edgemoe.runtime.sim.workload import Trace, Workload, build_scenario  # noqa: E402


def _function_body(ir: str, name: str) -> str:
    """The LLVM IR of compiled function `name` itself (not its Python or C wrappers)."""
    for part in ir.split("\ndefine")[1:]:
        head = part[:600]
        if re.search(re.escape(name) + r"B\d", head) and "cpython" not in head and "cfunc." not in head:
            return part.split("\n}\n")[0]
    raise AssertionError(f"no function {name} in the IR")


@pytest.fixture(scope="module")
def kernel_signatures():
    """{name: (dispatcher, argument types)} of the kernels as the decode path calls them (the simulator loop
    passes the same types): built from an ordermoe policy's `DecodePath` tables."""
    profile = synthetic_profile(num_layers=4, num_experts=8, top_k=2, num_tokens=200, seed=0)
    cluster = load_cluster("edge8")
    placement = plan(plan_problem(profile, cluster, domain_fallback=True), "uniform")
    ctx = make_context(profile, cluster, placement, mode="migrate", domain_fallback=True)
    path = make_policy("ordermoe", ctx, horizon=2).decode_path()
    assert path is not None
    ex, scratch_out, om, work, out, extra, rows, xfer, num_layers = path.tables
    load, b = np.zeros(ctx.num_nodes), np.int64(0)
    ordermoe_args = (rows, rows, rows, rows, path.kt, load, xfer, num_layers, b, 0.0)
    rows_args = (np.int64(rules.RULE_EXACT), rows, rows, rows, rows, ex, load, xfer, num_layers, out, b,
                 np.bool_(True))
    # the engine's wave step as `WaveEngine` calls it (the simulator's loops pass the same types)
    sc = build_scenario(ctx.user_weight, ctx.user_domain, Trace.from_profile(profile), Workload(4, 4, 4, "closed"))
    wave = engine.WaveEngine(ctx, sc, Run(ctx, sc), 1e-4)
    no_rows, no_slots = np.zeros(0, np.int64), np.zeros((0, ctx.top_k), np.int64)
    wave_args = (np.bool_(True), 0, wave.ids, (no_rows,) * 3 + (no_slots,) * 2 + (no_rows,) * 2, *wave._groups())
    return {"_decide_ordermoe": (ordermoe_kernel._decide_ordermoe, ordermoe_args),
            "_decide_rows": (rules._decide_rows, rows_args), "_wave_step": (engine._wave_step, wave_args)}


@pytest.mark.parametrize("name", ["_decide_ordermoe", "_decide_rows", "_wave_step"])
def test_per_wave_kernels_keep_no_reference_counts(kernel_signatures, name):
    dispatcher, args = kernel_signatures[name]
    sig = tuple(numba.typeof(a) for a in args)
    options = {k: v for k, v in dispatcher.targetoptions.items() if k != "nopython"}  # (njit sets it)
    fresh = numba.njit(**options)(dispatcher.py_func)  # not cached: its IR is kept
    fresh.compile(sig)
    body = _function_body(fresh.inspect_llvm(sig), name)
    # (the one reference a function keeps: the array it returns, `_wave_step`'s view of its picks)
    assert body.count("@NRT_incref(") <= (1 if name == "_wave_step" else 0) and "@NRT_decref(" not in body
    calls = {c for c in re.findall(r"call [^@]*@([\w.$]+)", body) if not c.startswith("llvm.") and c != "NRT_incref"}
    assert not calls, f"{name} calls {sorted(calls)}: each keeps its arguments' reference counts"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 1.0, 2.5, np.inf, np.nan]), min_size=0, max_size=9),
                min_size=1, max_size=4))
def test_sorted_candidates_are_the_stable_sort(costs):
    """`_sort_candidates`' heap sort on (cost, node) gives the stable argsort of each ascending list (NaN last)."""
    sizes = [len(c) for c in costs]
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    nnz = int(ptr[-1])
    N = max(nnz, 1)
    cand_node = np.concatenate([np.arange(len(c)) * 2 for c in costs]).astype(np.int64) if nnz else np.zeros(0, np.int64)
    cand_compute = np.concatenate([np.asarray(c, float) for c in costs]) if nnz else np.zeros(0)
    rt = np.zeros((1, 2 * N))
    static, node = np.zeros((1, max(nnz, 1))), np.zeros((1, max(nnz, 1)), np.int64)
    rules._sort_candidates(0, rt, ptr, cand_node, cand_compute, static, node)
    for le in range(len(costs)):
        a, z = ptr[le], ptr[le + 1]
        order = np.argsort(cand_compute[a:z], kind="stable")
        np.testing.assert_array_equal(node[0, a:z], cand_node[a:z][order])
        np.testing.assert_array_equal(static[0, a:z], cand_compute[a:z][order])
