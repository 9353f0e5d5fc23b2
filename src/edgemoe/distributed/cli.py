"""The Ray side of `edgemoe serve --backend ray` (whose one option list is edgemoe.serve.cli's): check the
inputs, start (or join) Ray, one actor per server of a cluster with a placement (`launch`), and the
closed-loop load run that writes measured vs predicted metrics (`load_command`, `run_load`).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import typer

from edgemoe.errors import EdgeMoEError, fail
from edgemoe.params import parse_params


def launch(cluster: str, placement: Path, profile: Path, model: str, policy: str, param: list[str], mode: str,
           wire: str, domain_fallback: bool, links: bool, ray_address: str | None, dilation: float, echo=print,
           dtype: str = "float32", device: str = "cpu"):
    """Check the inputs, start (or join) Ray, start one actor per server (experts and backbone in `dtype` on
    `device`); echo the Ray address, how to join and each server's memory beside what the planner charged it.
    Returns the Deployment (the caller shuts it down and stops Ray)."""
    from .serve import Deployment, join_instructions, log_to_stderr, start_ray, stop_ray
    from .server import resolve_dtype

    ctx, cfg = _checked_inputs(cluster, placement, profile, model, policy, param, mode, wire, domain_fallback,
                               links and ray_address is None)
    try:
        resolve_dtype(dtype, cfg.model_path)
    except EdgeMoEError as exc:
        raise EdgeMoEError(f"--{exc}") from None
    cfg = replace(cfg, dilation=dilation, dtype=dtype, device=device)
    log_to_stderr()
    info = start_ray_clearly(start_ray, ctx.node_names, ray_address)
    t0 = time.perf_counter()
    try:
        dep = Deployment.launch(cfg)
    except BaseException:
        stop_ray()
        raise
    echo(f"{len(dep.handles)} servers up in {time.perf_counter() - t0:.1f} s")
    for line in join_instructions(info, dep.cfg.namespace, ctx.node_names):
        echo(line)
    for m in dep.memory():
        echo(f"  {ctx.node_names[m['node']]:<12} experts {m['experts']:4d}  expert MB {m['expert_bytes'] / 1e6:7.2f} "
             f"(planner: {planned_expert_bytes(ctx, m['node']) / 1e6:.2f})  backbone MB {m['backbone_bytes'] / 1e6:6.2f}  "
             f"RSS MB {m['rss_bytes'] / 1e6:7.1f}")
    return dep


def load_command(cluster: str, placement: Path, profile: Path, model: str, policy: str, param: list[str], mode: str,
                 domain_fallback: bool, ray_address: str | None, links: bool, wire: str, load_users: int,
                 load_seconds: float, gen_tokens: int, dilation: str, out: Path) -> None:
    """`edgemoe serve --backend ray --load-users N` (its options are edgemoe.serve.cli's, the one list): the
    servers as Ray actors, a closed-loop load for a bounded time, measured vs predicted metrics to `out`."""
    from edgemoe.io import Output, atomic_write_text, check_outputs

    from .serve import stop_ray

    try:
        check_outputs({"--out": Output(out)}, {"--cluster": cluster, "--placement": placement, "--profile": profile,
                                               "--model": model})
        k = _dilation(dilation)
        dep = launch(cluster, placement, profile, model, policy, param, mode, wire, domain_fallback, links,
                     ray_address, 1.0 if k == "auto" else k, typer.echo)
        try:
            from edgemoe.progress import ticker

            with ticker(f"load run: {load_users} users", total_s=load_seconds):
                result = run_load(dep, load_users, load_seconds, gen_tokens, model, dilation=k)
        finally:
            dep.shutdown()
            stop_ray()
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1, default=float))
        typer.echo(json.dumps({key: result[key] for key in ("dilation", "valid", "invalid_because", "cpu", "error_vs_simulator")},
                              indent=1, default=float))
        typer.echo(f"wrote {out}")
    except EdgeMoEError as exc:
        fail(exc)  # one line, like every other command (a cluster file's errors span several)
    except KeyboardInterrupt:
        typer.echo("stopped")


def planned_expert_bytes(ctx, node: int) -> float:
    """Bytes of experts the planner charged server `node`: the profile's bytes [L, E] (measured in the checkpoint's
    dtype) of the experts its placement row hosts."""
    import numpy as np

    return float((np.asarray(ctx.hosts[node], bool) * np.asarray(ctx.expert_bytes, float)).sum())


def start_ray_clearly(start_ray, node_names, ray_address: str | None) -> dict:
    """`start_ray` (passed in: tests replace it) with Ray's own start/connect failures as one EdgeMoEError line."""
    try:
        return start_ray(node_names if ray_address is None else (), address=ray_address)
    except (TimeoutError, ConnectionError, RuntimeError) as exc:  # ray.init: "Failed to start/connect to GCS"
        detail = " ".join(str(exc).split())[:300]
        raise EdgeMoEError(f"Ray did not start or could not be reached at {ray_address or 'a local instance'} "
                           f"({type(exc).__name__}: {detail}); check --ray-address and that Ray runs") from None


def _checked_inputs(cluster: str, placement: Path, profile: Path, model: str, policy: str, param: list[str],
                    mode: str, wire: str, domain_fallback: bool, links: bool):
    """Load and cross-check everything `serve` is given before any actor starts: the placement must fit
    the profile's model and the cluster's memory, the model's checkpoint must match the profile's (L, E),
    the policy parameters must be valid. Returns (RuntimeContext, ServerConfig)."""
    from edgemoe.cluster import load_cluster
    from edgemoe.models.loader import resolve_model_path
    from edgemoe.plan.base import check_placement_fits, load_placement
    from edgemoe.plan.problem import plan_problem
    from edgemoe.profile import load_profile
    from edgemoe.runtime import make_context
    from edgemoe.runtime.registry import policy_params

    from .server import ServerConfig
    from .wire import WIRE_DTYPES

    if mode not in ("migrate", "home"):
        raise EdgeMoEError(f"--mode {mode!r}: expected one of migrate, home")
    if wire not in WIRE_DTYPES:
        raise EdgeMoEError(f"--wire {wire!r}: expected one of {', '.join(WIRE_DTYPES)}")
    params = policy_params(policy, parse_params(param))
    cl = load_cluster(cluster)
    prof = load_profile(profile)
    if params.get("horizon", 0) >= prof.L:
        raise EdgeMoEError(f"--param horizon={params['horizon']}: the model has {prof.L} MoE layers; "
                           f"expected at most {prof.L - 1}")
    plan = load_placement(placement)
    check_placement_fits(plan, plan_problem(prof, cl, domain_fallback=domain_fallback), str(placement))
    model_path = resolve_model_path(model)
    _check_checkpoint_matches(model_path, prof)
    from .weights import dense_cost_of_checkpoint

    # the dense part's nominal cost, counted on the checkpoint served (docs/runtime.md, "Dense part")
    ctx = make_context(prof, cl, plan, mode=mode, domain_fallback=domain_fallback,
                       dense=dense_cost_of_checkpoint(model_path))
    cfg = ServerConfig(ctx, model_path, policy=policy, policy_params=tuple(params.items()), links_enabled=links, wire=wire)
    return ctx, cfg


def _check_checkpoint_matches(model_path: str, prof) -> None:
    """Raise EdgeMoEError unless the checkpoint's MoE layers and experts per layer are the profile's."""
    from .weights import checkpoint_files, expert_index

    try:
        index = expert_index(checkpoint_files(model_path).keys())
    except EdgeMoEError as exc:
        raise EdgeMoEError(f"--model {model_path}: {exc}") from None
    except Exception as exc:  # a damaged safetensors header
        raise EdgeMoEError(f"--model {model_path}: cannot read the checkpoint ({type(exc).__name__}: {exc})") from None
    L = len(index.decoder_layers)
    experts = {e for (_, e) in index.per_expert}
    E = max(experts) + 1 if experts else prof.E
    if (L, E) != (prof.L, prof.E):
        raise EdgeMoEError(f"--model {model_path} has (L, E) = ({L}, {E}) but --profile {prof.meta.model!r} has "
                           f"({prof.L}, {prof.E}); give the model the profile was measured on")


def _dilation(text: str) -> float | str:
    """'auto' or a number >= 1 (--dilation)."""
    if text == "auto":
        return "auto"
    try:
        k = float(text)
    except ValueError:
        k = float("nan")
    if not k >= 1.0 or k == float("inf"):
        raise EdgeMoEError(f"--dilation {text!r}: expected 'auto' or a finite number >= 1")
    return k


def load_prompts(model: str, count: int = 32, length: int = 16):
    """Prompts of `length` tokens cut from the offline corpus (the stdlib docs) with the model's tokenizer."""
    import numpy as np

    from edgemoe.data import stdlib_docs
    from edgemoe.models import load_tokenizer

    text = "\n".join(t for _, t in stdlib_docs().split("heldout").docs)[:200_000]
    ids = np.asarray(load_tokenizer(model)(text)["input_ids"], np.int64)
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def run_load(dep, users: int, seconds: float, gen_tokens: int, model: str = "default", prompt_tokens: int = 16,
             dilation: float | str = 1.0, requests_per_user: int | None = None) -> dict:
    """Closed loop of `users` users (cycling over the cluster's users) for `seconds` nominal seconds (or
    `requests_per_user` each); measured metrics, CPU use and validity beside the simulator's replay of the
    same requests (edgemoe.distributed.loadrun). dilation: a number, or "auto" (calibrated)."""
    import numpy as np

    from .loadrun import measure_load
    from .measure import predicted_metrics
    from .weights import checkpoint_hidden_size
    from .wire import row_bytes

    ctx = dep.cfg.ctx
    prompts = load_prompts(model, 32, prompt_tokens)
    who = [int(u) % ctx.num_users for u in range(users)]
    wire_bytes = row_bytes(checkpoint_hidden_size(dep.cfg.model_path), dep.cfg.wire)
    sim_latency_s = None
    if dilation == "auto":  # the simulated latency the calibration sizes k for: a short replay at k = 1
        probe = measure_load(dep, who, prompts, gen_tokens, requests_per_user=1, dilation=1.0, wire_bytes=wire_bytes)
        sim_latency_s = predicted_metrics(ctx, dep.cfg.policy, dep.cfg.params, probe["records"], wire_bytes,
                                          dep.cfg.decision_cost)["latency_ms"]["mean"] / 1e3
    out = measure_load(dep, who, prompts, gen_tokens, requests_per_user, seconds, dilation, sim_latency_s,
                       wire_bytes=wire_bytes)
    records = out.pop("records")
    out.update(seconds=seconds, prompt_tokens=prompt_tokens, policy=dep.cfg.policy, mode=ctx.mode,
               cluster=ctx.cluster_name, requests_per_user=np.bincount([r.user for r in records], minlength=ctx.num_users).tolist())
    return out
