"""What an in-process server runs: the model, its tokenizer, and the runtime context of one deployment.

`load_deployment(spec)` loads the model (all experts, in one process, as the `local` backend does) and joins
a routing profile, a cluster and a placement into a `RuntimeContext`. Missing pieces are made and cached:

- no `--profile`: the model is profiled on `calib_data` (`calib_tokens` tokens), cached under
  `cache_dir/profile-<key>` (key: weights hash, data spec, tokens, block length);
- no `--placement` file: `planner` plans one on the cluster, cached under `cache_dir/placement-<key>.json`
  (key: the profile's key or folder, the cluster's content, the planner and its parameters).

A second start with the same inputs reads both from the cache (a few seconds instead of the planner's run).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from edgemoe.errors import EdgeMoEError

SERVE_PLANNER = "ordermoe"  # the placement `edgemoe serve` plans when given none (OrderMoE's own)
# Policies a serving home cannot run: the oracle needs every token's future routing, which a server never has.
NOT_SERVABLE = {"oracle": "the oracle needs every token's future routing, which a serving home does not have"}


@dataclass(frozen=True)
class DeploymentSpec:
    """Inputs of one in-process deployment (the `edgemoe serve` options)."""

    model: str = "default"
    cluster: str = "edge8"
    placement: str | None = None  # a placement JSON (`edgemoe plan`); None: plan with `planner` (cached)
    planner: str = SERVE_PLANNER
    planner_params: tuple = ()  # ((key, value), ...)
    profile: str | None = None  # a profile folder (`edgemoe profile`); None: profile the model (cached)
    calib_data: str = "offline"  # text the default profile is measured on (edgemoe.data.resolve spec)
    calib_tokens: int = 8192
    block_len: int = 256
    mode: str = "home"  # token location mode: home (round trips) or migrate
    policy: str = "exact"
    policy_params: tuple = ()  # ((key, value), ...)
    cache_dir: str = "runs/cache"
    dtype: str = "float32"  # the dtype the model computes in (the checkpoint's is bf16; CPUs are faster in fp32)
    device: str = "cpu"

    @property
    def params(self) -> dict:
        return dict(self.policy_params)


@dataclass
class Deployment:
    """A loaded deployment: model adapter, tokenizer, runtime context and where its pieces came from."""

    spec: DeploymentSpec
    adapter: object  # edgemoe.models.MoEAdapter
    tokenizer: object
    ctx: object  # edgemoe.runtime.RuntimeContext
    sources: dict = field(default_factory=dict)  # "profile" / "placement" -> path, and whether it was cached
    domain_fallback: bool = False  # the profile lacks some of the cluster's user domains (mapped round-robin)
    user_domains: tuple = ()  # [U] the cluster users' domain labels (the routing log's `domain`)

    @property
    def context_length(self) -> int:
        """Tokens the model can attend over: prompt plus generated tokens must fit."""
        cfg = self.adapter.config
        return int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 0) or 2048)

    @property
    def vocab_size(self) -> int:
        return int(self.adapter.config.vocab_size)


def _dtype(name: str, model: str):
    """--dtype NAME (float32, bfloat16, float16, or checkpoint: the checkpoint's own) of `model` -> torch dtype."""
    from edgemoe.distributed.server import resolve_dtype
    from edgemoe.models.loader import resolve_model_path

    try:
        return resolve_dtype(name, resolve_model_path(model) if name == "checkpoint" else "")
    except EdgeMoEError as exc:
        raise EdgeMoEError(f"--{exc}") from None


def check_device(name: str, here: bool = True):
    """--device NAME as a torch.device, or EdgeMoEError naming it; here: it must also work in this process (the
    in-process backend; a Ray server's device is on its own machine)."""
    import torch

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise EdgeMoEError(f"--device {name!r}: not a torch device (expected cpu, cuda, cuda:1, ...)") from None
    if here and dev.type != "cpu":
        try:
            torch.empty(1, device=dev)
        except (RuntimeError, AssertionError) as exc:  # a CPU-only torch asserts for cuda
            raise EdgeMoEError(f"--device {name!r}: torch cannot use it here ({' '.join(str(exc).split())})") from None
    return dev


def _cluster_key(cluster: str) -> str:
    """The cluster's identity for the cache: a file's content, or a preset's name and its file's content."""
    from edgemoe.cluster import load_cluster

    cl = load_cluster(cluster)
    path = Path(cluster)
    text = path.read_bytes() if path.is_file() else json.dumps([cluster, repr(cl)]).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def cached_profile(adapter, tokenizer, spec: DeploymentSpec, log=lambda _m: None):
    """(profile, key, cached?) of the model on spec.calib_data, measured once and kept under spec.cache_dir."""
    from edgemoe.data import resolve
    from edgemoe.profile import load_profile
    from edgemoe.profile.collect import collect_profile, profile_blocks_for

    weights = adapter.weights_hash()
    key = hashlib.sha256(json.dumps([weights, spec.calib_data, spec.calib_tokens, spec.block_len]).encode()).hexdigest()[:16]
    path = Path(spec.cache_dir) / f"profile-{key}"
    if (path / "meta.json").is_file():
        prof = load_profile(path)
        prof.check_matches(adapter.num_layers, adapter.num_experts, adapter.top_k, weights)
        return prof, key, str(path), True
    log(f"profiling {spec.model} on {spec.calib_tokens} tokens of {spec.calib_data} (cached in {path})")
    blocks = profile_blocks_for(resolve(spec.calib_data), tokenizer, spec.calib_tokens, spec.block_len)
    prof = collect_profile(adapter, blocks, spec.model, spec.calib_data, progress=False)
    prof.save(path)
    return prof, key, str(path), False


def load_deployment(spec: DeploymentSpec, log=lambda _m: None) -> Deployment:
    """Load the model and build the deployment's runtime context (profile and placement cached when made here).

    Raises EdgeMoEError for a bad model, cluster, profile, placement, mode or policy, naming the option."""
    from edgemoe.cluster import load_cluster
    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.plan import plan, plan_problem
    from edgemoe.plan.base import check_placement_fits, load_placement
    from edgemoe.profile import load_profile
    from edgemoe.runtime import make_context
    from edgemoe.runtime.registry import policy_params

    if spec.policy in NOT_SERVABLE:
        raise EdgeMoEError(f"--policy {spec.policy}: not servable ({NOT_SERVABLE[spec.policy]})")
    if spec.mode not in ("home", "migrate"):
        raise EdgeMoEError(f"--mode {spec.mode!r}: expected one of home, migrate")
    params = policy_params(spec.policy, spec.params)
    dtype = _dtype(spec.dtype, spec.model)
    check_device(spec.device)
    cluster = load_cluster(spec.cluster)
    adapter = load_moe(spec.model, dtype=dtype)
    if spec.device != "cpu":
        adapter.model.to(spec.device)
    tokenizer = load_tokenizer(spec.model)
    sources: dict = {}
    if spec.profile is not None:
        prof = load_profile(spec.profile)
        prof.check_matches(adapter.num_layers, adapter.num_experts, adapter.top_k)
        prof_key = hashlib.sha256(str(Path(spec.profile).resolve()).encode()).hexdigest()[:16]
        sources["profile"] = {"path": spec.profile, "cached": False}
    else:
        prof, prof_key, path, hit = cached_profile(adapter, tokenizer, spec, log)
        sources["profile"] = {"path": path, "cached": hit}
    fallback = any(u.domain not in prof.meta.domains for u in cluster.users)
    problem = plan_problem(prof, cluster, domain_fallback=fallback)
    if spec.placement is not None:
        placement = load_placement(spec.placement)
        check_placement_fits(placement, problem, spec.placement)
        sources["placement"] = {"path": spec.placement, "cached": False}
    else:
        key = hashlib.sha256(json.dumps([prof_key, _cluster_key(spec.cluster), spec.planner,
                                         sorted(dict(spec.planner_params).items())]).encode()).hexdigest()[:16]
        path = Path(spec.cache_dir) / f"placement-{key}.json"
        hit = path.is_file()
        if hit:
            placement = load_placement(path)
            check_placement_fits(placement, problem, str(path))
        else:
            log(f"planning a {spec.planner} placement on {cluster.name} (cached in {path})")
            placement = plan(problem, spec.planner, **dict(spec.planner_params))
            path.parent.mkdir(parents=True, exist_ok=True)
            placement.save(path)
        sources["placement"] = {"path": str(path), "cached": hit, "method": placement.method}
    if params.get("horizon", 0) >= prof.L:
        raise EdgeMoEError(f"--param horizon={params['horizon']}: the model has {prof.L} MoE layers; "
                           f"expected at most {prof.L - 1}")
    from edgemoe.runtime.dense import dense_cost_of_model

    ctx = make_context(prof, cluster, placement, mode=spec.mode, domain_fallback=fallback, dense=dense_cost_of_model(adapter))
    from dataclasses import replace

    return Deployment(replace(spec, policy_params=tuple(params.items())), adapter, tokenizer, ctx, sources, fallback,
                      tuple(u.domain for u in cluster.users))
