"""The one evaluation pipeline: plan -> context -> simulate, shared by `edgemoe demo` / `evaluate`
(eval.experiment) and `evaluate --profile` (eval.replay).

A `Pipeline` holds one planning problem (the one join of a profile and a cluster, plan.problem) in one
token-location mode. It plans each (placement, params) once, builds its runtime context from that same
problem (runtime.context.context_from_problem: the context's groups and default budget are the planner's),
and simulates a policy on a context. Each orchestrator adds only its own part: the experiment the real
model's quality and the Ray backend, the replay placement files and skipped plans.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError


def all_local(problem):
    """Every edge server holds every expert, memory ignored: the latency floor."""
    from edgemoe.plan.base import empty_hosts, make_placement

    hosts = empty_hosts(problem)
    hosts[[k == "edge" for k in problem.node_kind]] = True
    pl = make_placement(problem, "all-local", hosts, note="memory ignored: the all-local floor")
    return replace(pl, capacity_bytes=np.maximum(pl.bytes_used(), pl.capacity_bytes))


def is_placement_file(placement: str) -> bool:
    """A method's PLACEMENT names a file (rather than a planner) when it ends in .json or exists on disk."""
    return placement.endswith(".json") or Path(placement).is_file()


def resolve_placement(problem, placement: str, params: dict):
    """(Placement, CPU seconds to plan) for a planner name, "all-local" or a placement file.

    A file must list the cluster's nodes (same names, same order) and the profile's (L, E); it is checked
    against the cluster's capacities, so a placement planned for another cluster cannot slip through.
    """
    from edgemoe.plan.base import check_placement_fits, load_placement, plan

    t0 = time.process_time()
    if placement == "all-local":
        return all_local(problem), 0.0
    if not is_placement_file(placement):
        return plan(problem, placement, **params), time.process_time() - t0
    if params:
        raise EdgeMoEError(f"placement file {placement}: planner parameters {sorted(params)} do not apply to a file")
    pl = load_placement(placement)
    check_placement_fits(pl, problem, f"placement file {placement}")  # errors name the file, not its planner
    return pl, 0.0


@dataclass(frozen=True)
class Planned:
    """One placement of the pipeline and its runtime context."""

    placement: object  # edgemoe.plan.base.Placement
    context: object  # edgemoe.runtime.context.RuntimeContext
    wall_s: float  # seconds to plan and build the context
    cpu_s: float  # CPU seconds to plan


class Pipeline:
    """Plan -> context -> simulate on one planning problem in one mode (see the module docstring).

    dense: the backbone's cost charged by the contexts (runtime.context.context_from_problem's `dense`).
    """

    def __init__(self, problem, mode: str, dense=True):
        self.problem, self.mode, self.dense = problem, mode, dense
        self._planned: dict[tuple[str, str], Planned] = {}

    @staticmethod
    def key(placement: str, params: dict) -> tuple[str, str]:
        return placement, json.dumps(params, sort_keys=True)

    def has(self, placement: str, params: dict) -> bool:
        """Whether `placement` for `params` is planned already."""
        return self.key(placement, params) in self._planned

    def planned(self, placement: str, params: dict) -> Planned:
        """The placement (a planner name, "all-local" or a placement file) for `params`, planned once, and its context."""
        from edgemoe.runtime.context import context_from_problem

        key = self.key(placement, params)
        if key not in self._planned:
            t0 = time.perf_counter()
            pl, cpu_s = resolve_placement(self.problem, placement, dict(params))
            ctx = context_from_problem(self.problem, pl, mode=self.mode, dense=self.dense)
            self._planned[key] = Planned(pl, ctx, round(time.perf_counter() - t0, 3), cpu_s)
        return self._planned[key]

    def context(self, placement: str, params: dict):
        return self.planned(placement, params).context

    def simulate(self, ctx, policy, trace, workload):
        """RunMetrics of `policy` (a Policy built on `ctx`) on `workload`, replaying `trace`'s routing."""
        from edgemoe.runtime.sim.simulate import simulate

        return simulate(ctx, policy, trace, workload)
