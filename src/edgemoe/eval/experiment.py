"""The side-by-side comparison behind `edgemoe demo` and `edgemoe evaluate`.

For each method (a placement plus a runtime policy on a cluster, in one token-location mode):
- quality: the real model on held-out text with the policy's decisions applied (`local` backend),
  giving perplexity and retention `ppl_exact / ppl_method`;
- latency, traffic and ratios: the trace-driven simulator (`simulate` backend) on the model's own routing of
  the same text, with users issuing requests (queues, arrivals); the local run's cost-model latency (no
  queueing) is kept beside it.
Everything lands in one results file (schema edgemoe.results/1) from which the report is rendered.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from itertools import pairwise
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError

from .pipeline import Pipeline


@dataclass(frozen=True)
class MethodSpec:
    """One row of the comparison."""

    name: str
    placement: str  # planner name, or "all-local" (every server holds every expert: the floor)
    policy: str  # runtime policy name
    policy_params: dict = field(default_factory=dict)
    placement_params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Comparison:
    """One cluster, one token-location mode, several methods."""

    name: str
    cluster: str
    mode: str  # "migrate" | "home"
    methods: tuple[MethodSpec, ...]
    budget_sweep_methods: tuple[str, ...] = ()  # methods whose `budget` is swept for latency-quality curves
    budgets: tuple[float, ...] = ()  # the sweep's budgets; the calibrated operating points' budgets join them
    operating_points: tuple[tuple[str, float], ...] = ()  # (name, max ppl_rel_increase) budgets to calibrate
    calibrate_method: str | None = None  # the method (placement + policy) whose budget is calibrated
    # methods whose operating-point budget is calibrated for their own policy (on their own placement, its
    # operating-point names resolved by calibrate_method's points) rather than taken from calibrate_method's
    self_calibrated: tuple[str, ...] = ()


ORDERMOE_BUDGET = 0.05  # per token-layer, in gate-weighted measured substitution error (docs/runtime.md)
# Named operating points (ARCHITECTURE.md): the budget of each is calibrated on calibration text so that
# perplexity rises by at most this much over exact execution; a method's `budget` may name one.
OPERATING_POINTS = (("paper", 0.078), ("strict", 0.01))
# SlimCaching's refinement stops at its kick count, not a wall-clock cap, so the demo's placements do not
# depend on how busy the machine is (about 10 s per placement at the demo's size).
SLIM_PARAMS: dict = {}  # slimcaching defaults: a deterministic refinement budget (kicks, work units)
SLIM_ONE_PASS = {"refine": False, "passes": 1}  # the published algorithm: one successive pass, no refinement
EXACT_POLICIES = ("exact", "slimcaching")  # never change which expert runs: their quality is exact execution's
# Policies the Ray backend cannot run (with the reason): with backend="ray" their rows stay simulated.
RAY_SIMULATED_ONLY = {"oracle": "the oracle needs every token's future routing, which a serving home does not have"}


FIELD_BASELINES = tuple(
    MethodSpec(f"{policy}-{point}", "ordermoe", policy, {"budget": point, **params}, placement_params={"budget": point})
    for point in ("paper", "strict")
    for policy, params in (("skip", {}), ("reroute", {}), ("random-local", {"seed": 0}),
                           ("ordermoe-error-groups", {"horizon": 2})))


def ordermoe_comparison(cluster: str = "edge8", budget: float | str = "paper") -> Comparison:
    """OrderMoE's comparison: exact-execution baselines (SlimCaching refined and as published) vs drop vs
    OrderMoE's runtime at look-ahead H = 0..3 and the hindsight oracle (same budget), its two operating points
    (`paper`, `strict`), the field's skip / re-route / random-substitute baselines and OrderMoE on
    measured-error groups at the same two points (each calibrated for itself), and the all-local floor."""
    # OrderMoE's runtime rows run on an OrderMoE placement planned for their budget (exact@ordermoe: the default)
    at = {"budget": budget}
    H = [MethodSpec(f"ordermoe-H{h}", "ordermoe", "ordermoe", {"budget": budget, "horizon": h}, placement_params=at)
         for h in range(4)]
    return Comparison(
        name=f"ordermoe-{cluster}", cluster=cluster, mode="migrate",
        methods=(
            MethodSpec("exact@uniform", "uniform", "exact"),
            MethodSpec("exact@activation-aware", "activation-aware", "exact"),
            MethodSpec("exact@eplb", "eplb", "exact"),
            MethodSpec("exact@slimcaching", "slimcaching", "exact", placement_params=SLIM_PARAMS),
            MethodSpec("exact@slimcaching-1pass", "slimcaching", "exact", placement_params=SLIM_ONE_PASS),
            MethodSpec("exact@ordermoe", "ordermoe", "exact"),
            MethodSpec("drop@ordermoe", "ordermoe", "drop"),
            *H,
            MethodSpec("oracle", "ordermoe", "oracle", {"budget": budget}, placement_params=at),
            MethodSpec("paper", "ordermoe", "ordermoe", {"budget": "paper", "horizon": 2},
                       placement_params={"budget": "paper"}),
            MethodSpec("strict", "ordermoe", "ordermoe", {"budget": "strict", "horizon": 2},
                       placement_params={"budget": "strict"}),
            # OrderMoE's runtime on the strongest exact-execution placement: the policy's own contribution
            MethodSpec("paper@slimcaching", "slimcaching", "ordermoe", {"budget": "paper", "horizon": 2},
                       placement_params=SLIM_PARAMS),
            # the field's answers to a remote expert (edgemoe.runtime.policies.field_baselines), each calibrated to the
            # same operating point on calibration text and run on OrderMoE's placement for that point
            *FIELD_BASELINES,
            MethodSpec("all-local", "all-local", "exact"),
        ),
        self_calibrated=tuple(m.name for m in FIELD_BASELINES),
        # H = 0 and H = 2 (= `paper`) swept: look-ahead compared at equal perplexity (`lookahead_equal_quality`)
        budget_sweep_methods=("ordermoe-H0", "paper"), budgets=(0.005, 0.02, 0.05, 0.2),
        operating_points=OPERATING_POINTS, calibrate_method="paper",
    )


def slimcaching_comparison(cluster: str = "device-edge-cloud") -> Comparison:
    """SlimCaching's comparison (home mode): its caching vs greedy, LFU, random and U-shaped placements."""
    return Comparison(
        name=f"slimcaching-{cluster}", cluster=cluster, mode="home",
        methods=tuple(MethodSpec(f"slimcaching@{p}", p, "slimcaching", placement_params=SLIM_PARAMS if p == "slimcaching" else {})
                      for p in ("slimcaching", "greedy", "lfu", "random", "u-shaped")),
    )


@dataclass(frozen=True)
class ExperimentConfig:
    """Inputs of one experiment. Defaults are the demo's."""

    model: str = "default"
    models: tuple[str, ...] = ("default", "default-upcycled")  # the demo's OrderMoE comparison runs on each
    # (a model that is not installed is skipped with a note); `model` is the one a single run uses
    eval_data: str | None = None  # default: WikiText-2 test when ../shared/data exists, else the offline corpus
    calib_data: str | None = None  # default: the shared corpus' held-out split, else the offline corpus
    shared_data: str = "../shared/data"
    calib_tokens: int = 20_000
    calib_quality_tokens: int = 4096  # calibration text on which operating-point budgets are calibrated
    eval_tokens: int = 16_384
    block_len: int = 256
    num_requests: int = 64  # simulated requests per method
    prompt_tokens: int = 32
    gen_tokens: int = 32
    rate_per_s: float = 20.0  # Poisson request rate over all users
    seed: int = 0
    cache_dir: str = "runs/cache"
    ray_dilation: float | None = None  # backend ray: time dilation k for every method (None: calibrated per method)
    # backend ray: the measured workload per method (every user at once, closed loop; its wall time is about
    # k x its nominal makespan, see docs/distributed.md "The demo on Ray"): requests per user, prompt and
    # generated tokens. The budget sweep and RAY_SIMULATED_ONLY policies are simulated only.
    ray_requests_per_user: int = 1
    ray_prompt_tokens: int = 8
    ray_gen_tokens: int = 8
    dense: bool = True  # charge the dense part (backbone roofline per layer on the home; False: the old model, 0 s)


def default_specs(cfg: ExperimentConfig) -> tuple[str, str]:
    """(eval data spec, calibration data spec) from the config and what exists on this machine."""
    shared = Path(cfg.shared_data)
    have = (shared / "wikitext-2" / "test.txt").is_file()
    return (cfg.eval_data or (f"wikitext-test:{shared}" if have else "offline"),
            cfg.calib_data or (f"shared:{shared}" if have else "offline"))


def cached_profile(adapter, tokenizer, spec: str, cfg: ExperimentConfig, log: Callable[[str], None]):
    """The calibration profile of the model on `spec`, computed once and cached by model hash and inputs."""
    from edgemoe.data import resolve
    from edgemoe.profile import load_profile
    from edgemoe.profile.collect import collect_profile, profile_blocks_for

    weights = adapter.weights_hash()
    key = hashlib.sha256(json.dumps([weights, spec, cfg.calib_tokens, cfg.block_len]).encode()).hexdigest()[:16]
    path = Path(cfg.cache_dir) / f"profile-{key}"
    if (path / "meta.json").is_file():
        prof = load_profile(path)
        prof.check_matches(adapter.num_layers, adapter.num_experts, adapter.top_k, weights)
        log(f"profile: cached {path}")
        return prof
    log(f"profile: {cfg.calib_tokens} tokens of {spec}")
    blocks = profile_blocks_for(resolve(spec), tokenizer, cfg.calib_tokens, cfg.block_len)
    prof = collect_profile(adapter, blocks, cfg.model, spec, seed=cfg.seed)
    prof.save(path)
    return prof


def eval_trace(topk: np.ndarray, gates: np.ndarray, user_domain: np.ndarray, block_len: int):
    """A simulator Trace of the evaluation text: blocks are dealt round-robin to the users' domains so that
    every user's requests replay this text's real routing."""
    from edgemoe.runtime.sim.workload import Trace

    domains = np.unique(user_domain)
    block = np.arange(topk.shape[0]) // block_len
    return Trace(topk=topk, gates=gates, domain=domains[block % len(domains)])


@dataclass(frozen=True)
class EvalText:
    """The evaluation text and exact execution on it (and calibration text for operating points)."""

    ids: np.ndarray  # [B, S] evaluation blocks
    nll: np.ndarray  # [B, S-1] exact execution
    top1: np.ndarray  # [B, S-1]
    topk: np.ndarray  # [B*S, L, K] exact routing, block-major
    gates: np.ndarray  # [B*S, L, K]
    calib_ids: np.ndarray | None = None  # [B', S] calibration blocks (operating points)
    calib_nll: np.ndarray | None = None


CALIB_CONFIDENCE_Z = 1.645  # one-sided 95%: the calibrated budget keeps the increase's upper bound in target


def rise_with_bound(nll: np.ndarray, nll_exact: np.ndarray, z: float = CALIB_CONFIDENCE_Z) -> tuple[float, float]:
    """Perplexity increase of `nll` over `nll_exact` (both [B, S-1]) and its one-sided upper confidence bound.

    The bound treats the B blocks' paired mean NLL differences d_b as independent draws (text blocks, not
    tokens, are the unit: tokens within a block are correlated): exp(mean d + z * sd(d) / sqrt(B)) - 1.
    With one block the bound equals the estimate."""
    d = (np.asarray(nll, dtype=np.float64) - np.asarray(nll_exact, dtype=np.float64)).reshape(len(nll), -1).mean(axis=1)
    rise = float(np.exp(np.mean(nll) - np.mean(nll_exact)) - 1.0)
    se = float(np.std(d, ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0
    return rise, float(np.expm1(np.log1p(rise) + z * se))


def calibrate_budget(adapter, ctx, policy: str, params: dict, text: EvalText, target: float, trials: dict,
                     lo: float = 1e-3, hi: float = 2.0, steps: int = 6) -> float:
    """The largest budget (per token-layer) whose perplexity increase on the calibration text stays <= target
    with one-sided 95% confidence (`rise_with_bound`: the upper bound, not the estimate, must fit, so that
    the point holds on text the calibration never saw): geometric bisection between lo and hi (`steps`
    halvings). `ctx` is a runtime context, or a function budget -> context when the placement is planned for
    the budget. `trials` caches budget -> (increase, upper bound)."""
    from edgemoe.runtime import make_policy
    from edgemoe.runtime.local import score_local

    if policy == "oracle":
        raise EdgeMoEError("operating points are calibrated for the ordermoe policy, not the oracle")

    def fits(b: float) -> bool:
        if b not in trials:
            c = ctx(b) if callable(ctx) else ctx
            users = np.arange(len(text.calib_ids)) % c.num_users
            nll, _, _ = score_local(adapter, make_policy(policy, c, **dict(params, budget=b)), text.calib_ids, users)
            trials[b] = rise_with_bound(nll, text.calib_nll)
        return trials[b][1] <= target

    if fits(hi):
        return hi
    if not fits(lo):
        return lo
    for _ in range(steps):
        mid = float(np.sqrt(lo * hi))
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def run_comparison(adapter, profile, comp: Comparison, text: EvalText, cfg: ExperimentConfig,
                   log: Callable[[str], None], backend: str = "simulate") -> dict:
    """Every method of `comp`: placement, quality on the real model, simulation (latency). Returns a results dict.

    Quality: policies that never change which expert runs (`EXACT_POLICIES`) have exact execution's quality
    (their decisions are replayed on the routing for the local cost-model latency); the others run in the
    `local` backend. Budgets named after an operating point are calibrated first, on calibration text.
    backend="ray": latency, traffic and ratios are measured on Ray actors (edgemoe.distributed), one process
    per node with emulated links; the simulator's numbers for the same requests stay beside them."""
    if backend not in ("simulate", "ray"):
        raise EdgeMoEError(f"backend={backend!r}; expected 'simulate' or 'ray'")
    run = ComparisonRun(adapter, profile, comp, text, cfg, log, backend)
    calibration = run.calibrate_points()
    own = run.self_calibrate()
    if own and calibration is not None:
        calibration["self_calibrated"] = own
    methods = {spec.name: run.method_row(spec) for spec in comp.methods}
    sweeps = {name: run.budget_sweep(name) for name in comp.budget_sweep_methods}
    run.close()
    return run.document(methods, sweeps, calibration)


class ComparisonRun:
    """The state of one comparison: its pipeline (the planning problem on the comparison's cluster, placements
    planned once), the calibrated operating points, evaluated methods (memoised by what decides their result)
    and the Ray deployment when backend="ray". Each method does one step of `run_comparison`."""

    def __init__(self, adapter, profile, comp: Comparison, text: EvalText, cfg: ExperimentConfig,
                 log: Callable[[str], None], backend: str):
        from edgemoe.cluster.load import load_cluster
        from edgemoe.plan.problem import plan_problem
        from edgemoe.runtime.dense import dense_cost_of_model
        from edgemoe.runtime.sim.workload import Workload

        self.adapter, self.profile, self.comp, self.text, self.cfg, self.log = adapter, profile, comp, text, cfg, log
        self.backend = backend
        cluster = load_cluster(comp.cluster)
        fallback = any(u.domain not in profile.meta.domains for u in cluster.users)
        # The dense part (docs/runtime.md, "Dense part"), counted on the loaded model; both backends charge it.
        self.dense = dense_cost_of_model(adapter) if cfg.dense else False
        self.pipe = Pipeline(plan_problem(profile, cluster, domain_fallback=fallback), comp.mode, dense=self.dense)
        self.workload = Workload(num_requests=cfg.num_requests, prompt_tokens=cfg.prompt_tokens,
                                 gen_tokens=cfg.gen_tokens, rate_per_s=cfg.rate_per_s, seed=cfg.seed)
        self.trace = None  # the simulator's Trace of the evaluation text, made with the first context
        self.placements: dict = {}  # label -> what the results file keeps of each placement used
        self.points: dict = {}  # operating point name -> calibrated budget facts
        self.own: dict = {}  # self-calibrated method -> its own budget facts
        self.memo: dict = {}
        self.ray_state: dict = {}
        self.ray_cpu_s: float | None = None  # CPU seconds of this comparison's Ray processes (set by close)

    def context_for(self, placement: str, params: dict, label: str | None = None, record: bool = True):
        """The context of a placement (planned once per params); `record` lists it in the results' placements
        under `label` (default: name and params)."""
        planned = self.pipe.planned(placement, params)
        if record:
            pl = planned.placement
            label = label or (placement if not params or params == SLIM_PARAMS else f"{placement}{_params_tag(params)}")
            self.placements[label] = {"copies": pl.replicas().tolist(), "bytes_used": pl.bytes_used().tolist(),
                                      "plan_seconds": planned.wall_s, "params": params}
        return planned.context

    def calibrate_points(self) -> dict | None:
        """Operating points: budget names -> budgets calibrated for comp.calibrate_method on calibration text
        (never the evaluation text); the results' "operating_points" record, or None without points."""
        comp, text = self.comp, self.text
        if not (comp.operating_points and comp.calibrate_method):
            return None
        if text.calib_ids is None:
            raise EdgeMoEError("operating points need calibration text (EvalText.calib_ids)")
        base = next(m for m in comp.methods if m.name == comp.calibrate_method)
        params = {k: v for k, v in base.policy_params.items() if k != "budget"}
        if isinstance(base.placement_params.get("budget"), str):
            # the placement is planned for the operating point's budget: every trial budget plans its own
            def ctx(b: float):
                return self.context_for(base.placement, _with_budget(base.placement_params, b), record=False)
        else:
            ctx = self.context_for(base.placement, base.placement_params)
        trials: dict = {}
        for name, target in comp.operating_points:
            t0 = time.perf_counter()
            b = calibrate_budget(self.adapter, ctx, base.policy, params, text, target, trials)
            rise, upper = trials[b]
            self.points[name] = {"budget": b, "target_ppl_rel_increase": target, "calib_ppl_rel_increase": rise,
                                 "calib_ppl_rel_increase_upper95": upper}
            self.log(f"  operating point {name}: budget {b:.4g} (calibration ppl +{100 * rise:.2f}%, "
                     f"95% upper bound +{100 * upper:.2f}%, "
                     f"target <= {100 * target:.1f}%; {time.perf_counter() - t0:.0f} s)")
        return {"method": comp.calibrate_method, "points": self.points,
                "trials": [{"budget": b, "ppl_rel_increase": r, "upper95": u} for b, (r, u) in sorted(trials.items())],
                "confidence": "one-sided 95% upper bound over calibration blocks must fit the target",
                "calib_tokens": int(text.calib_ids.size)}

    def self_calibrate(self) -> dict:
        """Self-calibrated methods: their own budget for each operating point, on their own placement for that
        point (trials shared per policy + placement). Returns {method: budget facts}."""
        comp, text = self.comp, self.text
        own_trials: dict = {}
        for name in comp.self_calibrated:
            spec = next(m for m in comp.methods if m.name == name)
            point = spec.policy_params.get("budget")
            target = dict(comp.operating_points).get(point)
            if target is None or text.calib_ids is None:
                raise EdgeMoEError(f"method {name}: self-calibrated methods need a budget naming an operating point "
                                   f"of the comparison ({[p for p, _ in comp.operating_points]}) and calibration text")
            pla = _with_budget(spec.placement_params, _point_budget(self.points, spec.placement_params.get("budget"), name))
            params = {k: v for k, v in spec.policy_params.items() if k != "budget"}
            key = json.dumps([spec.placement, pla, spec.policy, params], sort_keys=True)
            trials = own_trials.setdefault(key, {})
            t0 = time.perf_counter()
            b = calibrate_budget(self.adapter, self.context_for(spec.placement, pla, record=False), spec.policy, params,
                                 text, target, trials)
            self.own[name] = {"budget": b, "target_ppl_rel_increase": target, "calib_ppl_rel_increase": trials[b][0],
                              "calib_ppl_rel_increase_upper95": trials[b][1]}
            self.log(f"  operating point {point} of {name}: budget {b:.4g} (calibration ppl +{100 * trials[b][0]:.2f}%; "
                     f"{time.perf_counter() - t0:.0f} s)")
        return self.own

    def resolved(self, spec: MethodSpec) -> MethodSpec:
        """`spec` with operating-point names in its policy's and its placement's `budget` replaced by budgets."""
        pol, pla = spec.policy_params, spec.placement_params
        pol_budget = (self.own[spec.name]["budget"] if spec.name in self.own
                      else _point_budget(self.points, pol.get("budget"), spec.name))
        return replace(spec, policy_params=_with_budget(pol, pol_budget),
                       placement_params=_with_budget(pla, _point_budget(self.points, pla.get("budget"), spec.name)))

    def policy(self, spec: MethodSpec, ctx):
        """A fresh policy of `spec` on `ctx` (the oracle is handed the evaluation text's routing)."""
        from edgemoe.runtime import make_policy

        extra = {"routing": (self.text.topk, self.text.gates)} if spec.policy == "oracle" else {}
        return make_policy(spec.policy, ctx, **spec.policy_params, **extra)

    def quality(self, spec: MethodSpec, ctx):
        """(nll, top1, decisions, policy) of `spec` on the evaluation text: exact execution's scores for
        EXACT_POLICIES (their decisions replayed on the routing), else the real model run with the policy's
        decisions; `policy` is the one that decided (its params go into the results)."""
        from edgemoe.runtime.local import replay_decisions, score_local

        text = self.text
        row_users = np.arange(len(text.ids)) % ctx.num_users
        policy = self.policy(spec, ctx)
        if spec.policy in EXACT_POLICIES:
            dec = replay_decisions(policy, np.repeat(row_users, text.ids.shape[1]), text.topk, text.gates)
            return text.nll, text.top1, dec, policy
        nll, top1, dec = score_local(self.adapter, policy, text.ids, row_users)
        return nll, top1, dec, policy

    def latency(self, spec: MethodSpec, ctx, on_ray: bool):
        """(RunMetrics, the simulated policy) of `spec`: simulated, then measured on Ray when `on_ray`."""
        if self.trace is None:
            self.trace = eval_trace(self.text.topk, self.text.gates, ctx.user_domain, self.cfg.block_len)
        sim_policy = self.policy(spec, ctx)
        metrics = self.pipe.simulate(ctx, sim_policy, self.trace, self.workload)
        if on_ray:
            metrics = _ray_measured(self.ray_state, ctx, spec, self.text.ids, self.cfg, self.log, metrics)
        elif self.backend == "ray":
            metrics = replace(metrics, extra={**metrics.extra, "backend": "simulate", "ray_skipped":
                                              RAY_SIMULATED_ONLY.get(spec.policy, "budget sweep: simulated only")})
        return metrics, sim_policy

    def evaluate(self, spec: MethodSpec, on_ray: bool = True) -> dict:
        """The results entry of `spec` (operating-point names resolved), memoised by placement, policy and backend."""
        from edgemoe.models.scoring import quality_metrics
        from edgemoe.runtime.metrics import method_entry

        named = spec.placement_params.get("budget")
        label = f"{spec.placement}({named})" if isinstance(named, str) else None
        spec = self.resolved(spec)
        on_ray = on_ray and self.backend == "ray" and spec.policy not in RAY_SIMULATED_ONLY
        key = (spec.placement, json.dumps(spec.placement_params, sort_keys=True), spec.policy,
               json.dumps(spec.policy_params, sort_keys=True), on_ray)
        if key in self.memo:
            return dict(self.memo[key])
        ctx = self.context_for(spec.placement, spec.placement_params, label=label)
        nll, top1, dec, policy = self.quality(spec, ctx)
        quality = quality_metrics(nll, top1, self.text.nll, self.text.top1)
        metrics, sim_policy = self.latency(spec, ctx, on_ray)
        local_ms = dec.token_latency_s * 1e3
        entry = method_entry(
            metrics, spec.placement, spec.policy, ppl=quality["ppl"], quality_retention=quality["quality_retention"],
            ppl_rel_increase=quality["ppl_rel_increase"], extra_nats_per_token=quality["extra_nats_per_token"],
            top1_agreement=quality["top1_agreement"], policy_params=policy.params,
            placement_params=spec.placement_params, mode=self.comp.mode, cluster=self.comp.cluster,
            local_cost_model_latency_ms={"mean": float(local_ms.mean()), "p99": float(np.percentile(local_ms, 99))},
            local_substitution_ratio=float(dec.substituted().mean()), local_not_run_ratio=float((dec.experts < 0).mean()),
            local_zero_ratio=float(dec.zeroed.mean()),
        )
        if hasattr(sim_policy, "weights"):
            entry["adaptive_weights"] = sim_policy.weights()
        self.memo[key] = entry
        return dict(entry)

    def method_row(self, spec: MethodSpec) -> dict:
        """One method's results entry, tagged with the operating point its budget names, and its log line."""
        t0 = time.perf_counter()
        m = self.evaluate(spec)
        b = spec.policy_params.get("budget")
        if isinstance(b, str):
            m["operating_point"] = b
        self.log(f"  {spec.name:<24} mean {m['latency_ms']['mean']:8.2f} ms  p99 {m['latency_ms']['p99']:8.2f} ms  "
                 f"ppl {m['ppl']:.3f} (+{100 * m['ppl_rel_increase']:.2f}%)  ({time.perf_counter() - t0:.1f} s)")
        return m

    def budget_sweep(self, name: str) -> list[dict]:
        """Method `name` at every swept budget (comp.budgets and the calibrated points' budgets), simulated."""
        base = next(s for s in self.comp.methods if s.name == name)
        rows = []
        for b in sorted(set(self.comp.budgets) | {pt["budget"] for pt in self.points.values()}):
            m = self.evaluate(replace(base, policy_params={**base.policy_params, "budget": b},
                                      placement_params=_with_budget(base.placement_params, b)), on_ray=False)
            rows.append({
                "budget": b, "latency_ms_mean": m["latency_ms"]["mean"], "latency_ms_p99": m["latency_ms"]["p99"],
                "ppl": m["ppl"], "ppl_rel_increase": m["ppl_rel_increase"], "top1_agreement": m["top1_agreement"],
                "quality_retention": m["quality_retention"], "substitution_ratio": m["substitution_ratio"],
                "drop_ratio": m["drop_ratio"], "traffic_bytes_per_1k_tokens": m["traffic_bytes_per_1k_tokens"]})
            self.log(f"  sweep {name} budget {b:<8.4g} mean {m['latency_ms']['mean']:8.2f} ms  ppl {m['ppl']:.3f} "
                     f"(+{100 * m['ppl_rel_increase']:.2f}%)")
        return rows

    def close(self) -> None:
        """Shut the Ray deployment down, if one was started."""
        if self.ray_state:
            from edgemoe.distributed.loadrun import ray_cpu_s
            from edgemoe.distributed.serve import stop_ray

            # the actors' CPU time is not the driver's: read it while they are alive (the results' ray_cpu_s)
            self.ray_cpu_s = ray_cpu_s(self.ray_state["deployment"])
            self.ray_state["deployment"].shutdown()
            # Each comparison's Ray instance carries its own cluster's node resources: stop it, so the next
            # comparison (another cluster) starts one with the resources its actors need.
            stop_ray()

    def document(self, methods: dict, sweeps: dict, calibration: dict | None) -> dict:
        """The results dict (schema edgemoe.results/1) of the comparison."""
        from edgemoe.models.scoring import perplexity
        from edgemoe.profile.groups import groups_for
        from edgemoe.results import results_dict

        comp, cfg, profile, dense = self.comp, self.cfg, self.profile, self.dense
        config = {"name": comp.name, "cluster": comp.cluster, "mode": comp.mode, "backend": self.backend, **asdict(cfg),
                  "dense_cost": asdict(dense) if dense else None,
                  "methods": [asdict(s) for s in comp.methods], "profile": {"model": profile.meta.model, "data": profile.meta.data,
                  "tokens": profile.num_tokens, "weights_hash": profile.meta.weights_hash}}
        doc = results_dict(config, methods)
        if self.ray_cpu_s is not None:  # the driver's cpu_s leaves the Ray actors and daemons out
            doc["environment"]["ray_cpu_s"] = round(self.ray_cpu_s, 1)
        doc["ppl_exact"] = perplexity(self.text.nll)
        doc["budget_sweep"] = sweeps
        if "ordermoe-H0" in sweeps and len(sweeps) > 1:
            doc["lookahead_equal_quality"] = equal_quality_ratios(sweeps, "ordermoe-H0")
        if calibration:
            doc["operating_points"] = calibration
        doc["groups"] = {"layer-aware": groups_for(profile).mean_group_size().tolist()}
        doc["placements"] = self.placements
        doc["summary"] = summarise(doc)
        return doc


def _point_budget(points: dict, b, method: str):
    """`b` itself, or the calibrated budget of the operating point it names."""
    if not isinstance(b, str):
        return b
    if b not in points:
        raise EdgeMoEError(f"method {method}: budget {b!r} names no calibrated operating point (have {sorted(points)})")
    return points[b]["budget"]


def _with_budget(params: dict, budget) -> dict:
    """`params` with its `budget` set to `budget`; params without a budget are returned as they are."""
    return {**params, "budget": budget} if "budget" in params else params


def _params_tag(params: dict) -> str:
    return "(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"


def _ray_measured(state: dict, ctx, spec: MethodSpec, ids: np.ndarray, cfg: ExperimentConfig, log, simulated):
    """Measure one method on Ray actors (edgemoe.distributed.loadrun): the deployment is launched once per
    comparison and reconfigured per method; one warm-up request per home, then every user runs
    cfg.ray_requests_per_user closed-loop requests (prompts cut from the evaluation text), at cfg.ray_dilation or
    a time dilation sized from one CPU calibration per comparison and this method's simulated latency. Returns RunMetrics with the
    measured numbers (their own quantiles and utilisation); extra["simulated"] is the simulator's replay of the
    very requests Ray ran, extra["ray"] the dilation, CPU use and validity."""
    from edgemoe.distributed.loadrun import measure_load
    from edgemoe.distributed.serve import Deployment, start_ray
    from edgemoe.distributed.server import ServerConfig
    from edgemoe.models.loader import resolve_model_path

    server_cfg = ServerConfig(ctx, resolve_model_path(cfg.model), policy=spec.policy,
                              policy_params=tuple(spec.policy_params.items()))
    t_setup = time.perf_counter()
    if not state:
        start_ray(ctx.node_names)
        state["deployment"] = Deployment.launch(server_cfg)
        log(f"  ray: {ctx.num_nodes} server actors up ({time.perf_counter() - t_setup:.0f} s)")
    else:
        state["deployment"].configure(server_cfg)
    setup_s = time.perf_counter() - t_setup
    dep = state["deployment"]
    users = list(range(ctx.num_users))
    prompts = [row[: cfg.ray_prompt_tokens] for row in ids]
    dilation = "auto" if cfg.ray_dilation is None else float(cfg.ray_dilation)
    t0 = time.perf_counter()
    out = measure_load(dep, users, prompts, cfg.ray_gen_tokens, requests_per_user=cfg.ray_requests_per_user, dilation=dilation,
                       sim_latency_s=simulated.latency_ms["mean"] / 1e3, calibration=state.get("calibration"))
    state["calibration"] = out["calibration"]
    out.pop("records")
    if out["errors"]:
        raise EdgeMoEError(f"ray backend, method {spec.name}: {len(out['errors'])} requests failed: {out['errors'][:3]}")
    m, sim = out["measured"], out["predicted"]
    log(f"    ray: configure {setup_s:.1f} s, warm-up + calibration + run + replay {time.perf_counter() - t0:.1f} s "
        f"(dilated run {out['cpu']['wall_s']:.1f} s)")
    log(f"    ray k={out['dilation']:g} host CPU {100 * out['cpu']['host_util']:.0f}% ray {out['cpu']['ray_cores_busy']:.2f} cores"
        f"{'' if out['valid'] else ' INVALID: ' + '; '.join(out['invalid_because'])}; measured {m['latency_ms']['mean']:.2f} ms"
        f" vs replayed simulation {sim['latency_ms']['mean']:.2f} ms")
    ray_info = {k: out[k] for k in ("dilation", "calibration", "sim_latency_ms_for_dilation", "cpu", "valid",
                                    "invalid_because", "error_vs_simulator", "duplicates", "failovers")}
    ray_info.update(lateness_ms=m["lateness_ms"], late_share=m["late_share"], calls=m["calls"], failed_calls=m["failed_calls"],
                    wall_s=round(time.perf_counter() - t0, 1), run_wall_s=round(out["cpu"]["wall_s"], 1),
                    workload={"users": len(users), "requests_per_user": cfg.ray_requests_per_user,
                              "prompt_tokens": cfg.ray_prompt_tokens, "gen_tokens": cfg.ray_gen_tokens})
    poisson = {k: getattr(simulated, k) for k in ("latency_ms", "ttft_ms", "throughput_tokens_per_s",
                                                   "traffic_bytes_per_1k_tokens", "remote_ratio")}
    return replace(simulated, latency_ms=m["latency_ms"], ttft_ms=m["ttft_ms"],
                   throughput_tokens_per_s=m["throughput_tokens_per_s"],
                   traffic_bytes_per_1k_tokens=m["traffic_bytes_per_1k_tokens"], remote_ratio=m["remote_ratio"],
                   substitution_ratio=m["substitution_ratio"], drop_ratio=m["drop_ratio"], requests=m["requests"],
                   generated_tokens=m["generated_tokens"], makespan_s=m["makespan_s"], utilisation=m["utilisation"],
                   extra={**simulated.extra, "backend": "ray", "latency_quantiles_ms": m["latency_quantiles_ms"],
                          "simulated": sim, "simulated_poisson_workload": poisson, "ray": ray_info,
                          "ray_calls": m["calls"], "ray_failed_calls": m["failed_calls"]})


def latency_at_quality(sweep: list[dict], rise: float) -> float | None:
    """Mean latency of a budget sweep interpolated (linearly in perplexity increase, between the neighbouring
    points of the curve's lower envelope) at perplexity increase `rise`; None outside the swept range."""
    pts = sorted((p["ppl_rel_increase"], p["latency_ms_mean"]) for p in sweep if p.get("ppl_rel_increase") is not None)
    env: list[tuple[float, float]] = []
    for x, y in pts:  # the best latency reachable at <= each quality cost (more budget never has to be slower)
        if not env or y < env[-1][1]:
            env.append((x, y))
    if not env or rise < env[0][0]:
        return None
    for (x0, y0), (x1, y1) in pairwise(env):
        if x0 <= rise <= x1:
            return y0 + (y1 - y0) * (rise - x0) / (x1 - x0) if x1 > x0 else min(y0, y1)
    return env[-1][1]  # beyond the last envelope point: no more latency to buy


def equal_quality_ratios(sweeps: dict, reference: str) -> dict:
    """For every point of every other sweep: its mean latency over the reference sweep's latency at the same
    perplexity increase (look-ahead against H = 0 at equal quality, not at equal budget). {name: [...]}."""
    out = {}
    for name, pts in sweeps.items():
        if name == reference:
            continue
        rows = []
        for p in pts:
            ref = latency_at_quality(sweeps[reference], p["ppl_rel_increase"])
            rows.append({"budget": p["budget"], "ppl_rel_increase": p["ppl_rel_increase"],
                         "latency_ms_mean": p["latency_ms_mean"], f"{reference}_latency_ms_at_same_ppl": ref,
                         "ratio": p["latency_ms_mean"] / ref if ref else None})
        out[name] = rows
    return out


def summarise(doc: dict) -> list[str]:
    """Plain statements of the headline ratios, computed from the results themselves."""
    m = doc["methods"]
    exact = {k: v for k, v in m.items() if v["policy"] in ("exact",) and v["placement"] != "all-local"}
    out = []
    subst = {k: v for k, v in m.items() if v["policy"] in ("ordermoe", "oracle")}
    if exact:
        best = min(exact, key=lambda k: exact[k]["latency_ms"]["mean"])
        b = exact[best]
        for name, v in subst.items():
            rise = v.get("ppl_rel_increase")
            top1 = v.get("top1_agreement")
            out.append(
                f"{name} vs best exact baseline ({best}): mean latency {_pct(v['latency_ms']['mean'], b['latency_ms']['mean'])} "
                f"({v['latency_ms']['mean'] / b['latency_ms']['mean']:.2f}x), p99 {_pct(v['latency_ms']['p99'], b['latency_ms']['p99'])}, "
                f"traffic {_pct(v['traffic_bytes_per_1k_tokens'], b['traffic_bytes_per_1k_tokens'])}, perplexity "
                f"{v['ppl']:.3f} vs {doc['ppl_exact']:.3f}"
                + (f" ({100 * rise:+.2f}%" if rise is not None else " (")
                + (f", top-1 agreement {top1:.4f})" if top1 is not None else ")"))
        floor = m.get("all-local")
        if floor:
            for name, v in subst.items():
                out.append(f"{name}: mean latency {v['latency_ms']['mean'] / floor['latency_ms']['mean']:.2f}x the all-local floor")
    field_policies = {spec.policy for spec in FIELD_BASELINES}
    for point in ("paper", "strict"):  # OrderMoE against the field's baselines calibrated to the same point
        rows = {k: v for k, v in m.items() if v["policy"] in field_policies and v.get("operating_point") == point}
        if point in m and rows:
            best = min(rows, key=lambda k: rows[k]["latency_ms"]["mean"])
            om, b = m[point], rows[best]
            out.append(f"{point} vs the fastest baseline calibrated to the same point ({best}): mean latency "
                       f"{om['latency_ms']['mean'] / b['latency_ms']['mean']:.2f}x, perplexity "
                       f"{100 * om['ppl_rel_increase']:+.2f}% vs {100 * b['ppl_rel_increase']:+.2f}% (same target, "
                       f"not equal measured quality: bench.studies.equal_quality interpolates at equal perplexity)")
    sc = {k: v for k, v in m.items() if v["policy"] == "slimcaching"}
    if "slimcaching@slimcaching" in sc:
        s = sc["slimcaching@slimcaching"]
        for name, v in sc.items():
            if name != "slimcaching@slimcaching":
                out.append(f"slimcaching placement vs {name}: mean latency {_pct(s['latency_ms']['mean'], v['latency_ms']['mean'])}")
    return out


def _pct(new: float, old: float) -> str:
    if not old:
        return "n/a"
    return f"{100 * (new - old) / old:+.1f}%"


def load_eval_text(adapter, tokenizer, cfg: ExperimentConfig, eval_spec: str, calib_spec: str | None,
                   log: Callable[[str], None]) -> EvalText:
    """Evaluation blocks, exact execution on them (nll, top-1, routing) and, when `calib_spec` is given, the
    calibration blocks the operating points are calibrated on (the start of the calibration text)."""
    from edgemoe.data import resolve, tokenize_blocks
    from edgemoe.models.scoring import token_scores
    from edgemoe.runtime.local import exact_scores_and_routing

    blocks = tokenize_blocks(resolve(eval_spec), tokenizer, cfg.block_len, max_tokens_per_source=cfg.eval_tokens)
    if blocks.num_tokens < cfg.block_len:
        raise EdgeMoEError(f"evaluation data {eval_spec!r} gives fewer than {cfg.block_len} tokens")
    ids = blocks.ids[: max(1, cfg.eval_tokens // cfg.block_len)]
    log(f"evaluation text: {ids.size:,} tokens of {eval_spec}")
    nll, top1, topk, gates = exact_scores_and_routing(adapter, ids)
    calib_ids = calib_nll = None
    if calib_spec is not None:
        cal = tokenize_blocks(resolve(calib_spec), tokenizer, cfg.block_len, max_tokens_per_source=cfg.calib_quality_tokens)
        calib_ids = cal.ids[: max(1, cfg.calib_quality_tokens // cfg.block_len)]
        calib_nll = token_scores(adapter, calib_ids)[0]
        log(f"calibration text for operating points: {calib_ids.size:,} tokens of {calib_spec}")
    return EvalText(ids=ids, nll=nll, top1=top1, topk=topk, gates=gates, calib_ids=calib_ids, calib_nll=calib_nll)


def run_experiment(cfg: ExperimentConfig, comparisons: list[Comparison], out_dir: str | Path,
                   log: Callable[[str], None] = print, backend: str = "simulate", suffix: str = "",
                   profile_lock=None) -> list[Path]:
    """Load cfg.model, profile (cached; under `profile_lock` when processes share the cache), evaluate every
    comparison; write one results file per comparison (`<comparison name><suffix>.json`)."""
    from contextlib import nullcontext

    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.results import write_document

    out_dir = Path(out_dir)
    adapter, tokenizer = load_moe(cfg.model), load_tokenizer(cfg.model)
    eval_spec, calib_spec = default_specs(cfg)
    with profile_lock or nullcontext():
        profile = cached_profile(adapter, tokenizer, calib_spec, cfg, log)
    need_calib = any(c.operating_points for c in comparisons)
    text = load_eval_text(adapter, tokenizer, cfg, eval_spec, calib_spec if need_calib else None, log)
    paths = []
    for comp in comparisons:
        log(f"comparison {comp.name} ({comp.cluster}, {comp.mode} mode, model {cfg.model})")
        doc = run_comparison(adapter, profile, comp, text, cfg, log, backend=backend)
        doc["config"]["eval_data"], doc["config"]["calib_data"] = eval_spec, calib_spec
        paths.append(write_document(out_dir / f"{comp.name}{suffix}.json", doc))
    return paths


def model_available(name: str) -> bool:
    """Whether `name` resolves to a local model folder or names a hub id ('org/name'); a bare name that is
    neither (a packaged model not installed yet) is not available."""
    from edgemoe.models.loader import resolve_model_path

    try:
        path = resolve_model_path(name)
    except EdgeMoEError:
        return False
    return Path(path).is_dir() or "/" in name


def run_demo(cfg: ExperimentConfig, out_dir: str | Path, log: Callable[[str], None] = print,
             backend: str = "simulate", ordermoe: Comparison | None = None,
             slimcaching: Comparison | None = None, workers: int = 1) -> list[Path]:
    """The demo: OrderMoE's comparison on every model of cfg.models that is installed (results file per model:
    `ordermoe-edge8.json` for the first, `ordermoe-edge8-<model>.json` for the others; config.model names it),
    and SlimCaching's comparison on the first.

    workers > 1 (backend simulate): the comparisons run side by side in that many worker processes
    (`run_parallel`), each with its share of the cores as torch threads; the results are those of one process
    bit for bit (every comparison reads only its model, its text and its own placements and policies)."""
    ordermoe = ordermoe or ordermoe_comparison()
    slimcaching = slimcaching or slimcaching_comparison()
    models = [m for m in (cfg.models or (cfg.model,)) if model_available(m)]
    for m in cfg.models:
        if m not in models:
            log(f"model {m!r} is not installed: its OrderMoE comparison is skipped")
    if not models:
        raise EdgeMoEError(f"none of the demo's models {list(cfg.models)} is installed")
    if backend == "ray" and len(models) > 1:
        # Ray measures the first model's comparisons only (the Ray demo's wall time is about k x each run's
        # nominal makespan, docs/distributed.md "The demo on Ray"); the plain demo simulates every model
        for model in models[1:]:
            log(f"model {model!r}: skipped on Ray (the Ray backend measures the first model, {models[0]!r}; "
                f"`edgemoe demo` simulates it)")
        models = models[:1]
    jobs = demo_jobs(models, ordermoe, slimcaching)
    if workers > 1 and backend == "simulate" and len(jobs) > 1:
        return run_parallel(cfg, jobs, out_dir, log, workers)
    paths = []
    for i, model in enumerate(models):  # one process: each model loaded once for all its comparisons
        comps = [c for m, c, _ in jobs if m == model]
        paths += run_experiment(replace(cfg, model=model), comps, out_dir, log, backend,
                                suffix="" if i == 0 else f"-{Path(model).name}")
    return paths


def demo_summary(paths: list[Path], wall_s: float, load_start: list[float], workers: int, backend: str) -> dict:
    """What `edgemoe demo` writes beside its results as summary.json: the whole command's wall time, CPU time
    and the load at its start and end. cpu_s is this process's and its worker processes' CPU time plus, on
    Ray, what each comparison's Ray processes used (`ray_cpu_s`, the sum of the results files' own; the
    driver's part alone is `driver_cpu_s`)."""
    import json
    import os

    from edgemoe.results import environment

    env = environment()
    timing = {"wall_s": round(wall_s, 1), "cpu_s": env["cpu_s"], "load_average_start": load_start,
              "load_average_end": env["load_average_1_5_15"], "cpu_count": os.cpu_count(),
              "workers": workers, "backend": backend}
    if backend == "ray":
        ray = [(json.loads(Path(p).read_text()).get("environment") or {}).get("ray_cpu_s") for p in paths]
        ray_s = round(sum(x for x in ray if x is not None), 1)
        timing.update(cpu_s=round(env["cpu_s"] + ray_s, 1), driver_cpu_s=env["cpu_s"], ray_cpu_s=ray_s)
    return {"what": "edgemoe demo: the whole command's time, every comparison and worker process included",
            "timing": timing,
            "files": [Path(p).name for p in paths], "environment": env}


def demo_jobs(models: list[str], ordermoe: Comparison, slimcaching: Comparison) -> list[tuple[str, Comparison, str]]:
    """(model, comparison, results-file suffix) of every comparison of the demo, in the order of its results
    files: OrderMoE's and SlimCaching's on the first model, then OrderMoE's on each other model."""
    first, *rest = models
    return [(first, ordermoe, ""), (first, slimcaching, "")] + [(m, ordermoe, f"-{Path(m).name}") for m in rest]


def demo_workers() -> int:
    """Worker processes `edgemoe demo` uses by default: one per core, at most the demo's three comparisons."""
    import os

    return max(1, min(3, os.cpu_count() or 1))


def run_parallel(cfg: ExperimentConfig, jobs: list[tuple[str, Comparison, str]], out_dir: str | Path,
                 log: Callable[[str], None], workers: int, job: Callable | None = None) -> list[Path]:
    """Every job of `demo_jobs` in a pool of `workers` spawned processes; returns the results files in the
    jobs' order. The comparisons with the most methods are started first: the OrderMoE ones at once, SlimCaching's
    (the shortest) on the first worker that is free. A job's log lines come back through a queue, tagged with its model; jobs of one
    model profile it one at a time (`cached_profile` under a lock), so the second finds it cached. The first
    failure stops the other workers and is raised. `job(cfg, comparison, out_dir, suffix)` runs one job in a
    worker (default `_demo_job`; a module-level function, since workers are spawned)."""
    import multiprocessing as mp
    import os
    import queue as queue_mod
    from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

    mpc = mp.get_context("spawn")  # fork would copy torch's thread pools into the children
    lines = mpc.Queue()
    locks = {m: mpc.Lock() for m in {m for m, _, _ in jobs}}
    threads = max(1, (os.cpu_count() or 1) // workers)
    order = sorted(range(len(jobs)), key=lambda j: -len(jobs[j][1].methods))  # most methods first (stable)
    pool = ProcessPoolExecutor(workers, mp_context=mpc, initializer=_init_worker, initargs=(lines, locks, threads))
    try:
        futures = {j: pool.submit(job or _demo_job, replace(cfg, model=jobs[j][0]), jobs[j][1], str(out_dir), jobs[j][2])
                   for j in order}
        pending = set(futures.values())
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
            _drain(lines, log, queue_mod)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                for proc in list(getattr(pool, "_processes", {}).values()):  # no public way to stop running jobs
                    proc.terminate()
                raise failed[0].exception()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    # a worker's queue is flushed when it exits, which may be after its job's result came back
    _drain(lines, log, queue_mod)
    return [p for j in range(len(jobs)) for p in futures[j].result()]


def _drain(lines, log: Callable[[str], None], queue_mod) -> None:
    """Log every line the workers have queued so far."""
    while True:
        try:
            tag, line = lines.get_nowait()
        except queue_mod.Empty:
            return
        indent = len(line) - len(line.lstrip(" "))
        log(f"{line[:indent]}[{tag}] {line[indent:]}")


_WORKER: dict = {}  # in a worker process of `run_parallel`: its log queue and the per-model profile locks


def _init_worker(lines, locks: dict, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    _WORKER.update(lines=lines, locks=locks)


def _demo_job(cfg: ExperimentConfig, comp: Comparison, out_dir: str, suffix: str) -> list[Path]:
    """One comparison of the demo in a worker process (`run_parallel`)."""
    lines = _WORKER["lines"]
    return run_experiment(cfg, [comp], out_dir, lambda line: lines.put((cfg.model, line)), "simulate", suffix,
                          profile_lock=_WORKER["locks"][cfg.model])
