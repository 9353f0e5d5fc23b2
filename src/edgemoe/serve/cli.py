"""`edgemoe serve` (the HTTP service, in-process or on the Ray deployment with `--backend ray`: one option list for
both), `edgemoe generate` and `edgemoe dial` (a deployment's quality dial, edgemoe.serve.dial).

Mounted by the main CLI: `app.command("serve")(serve_command)`, `app.command("generate")(generate_command)`,
`app.command("dial")(dial_command)`.
"""

from __future__ import annotations

import json
import math
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from edgemoe.errors import EdgeMoEError
from edgemoe.params import parse_params

from .dial import DIAL_REFINE, DIAL_TOKENS

BACKENDS = ("inprocess", "ray")
STATS_SHOWN = ("expert_slots", "policy", "home", "budget_spent", "remote_bytes")  # what generate prints of edgemoe

# Options shared by `serve` and `generate` (the deployment).
ModelOpt = Annotated[str, typer.Option(help="model folder, hub id, or 'default' (the shipped model)")]
ClusterOpt = Annotated[str, typer.Option(help="cluster preset name or YAML/TOML file")]
PlacementOpt = Annotated[Path | None, typer.Option(help="placement.json from `edgemoe plan` (default: plan one with "
                                                        "--planner, cached in --cache-dir)")]
PlannerOpt = Annotated[str, typer.Option(help="planner used when no --placement is given")]
ProfileOpt = Annotated[Path | None, typer.Option(help="routing profile folder of the same model (default: profile "
                                                      "the model on --calib-data, cached in --cache-dir)")]
PolicyOpt = Annotated[str, typer.Option(help="runtime policy: exact, ordermoe, drop, slimcaching")]
ParamOpt = Annotated[list[str], typer.Option(help="policy parameter key=value (repeatable)")]
ModeOpt = Annotated[str, typer.Option(help="token location mode: home or migrate")]
CacheOpt = Annotated[Path, typer.Option(help="where planned placements and profiles are cached")]
CalibOpt = Annotated[str, typer.Option(help="text the default profile is measured on ('offline', 'shared:PATH', ...)")]
CalibTokensOpt = Annotated[int, typer.Option(min=256, help="tokens the default profile is measured on")]
DialOpt = Annotated[Path | None, typer.Option(help="quality dial file of this deployment (`edgemoe dial`): maps a "
                                                   "request's max_ppl_increase to its budget")]


def _spec(model, cluster, placement, planner, profile, policy, param, mode, cache_dir, calib_data, calib_tokens,
          dtype="float32", device="cpu"):
    from .setup import DeploymentSpec

    return DeploymentSpec(model=model, cluster=cluster, placement=None if placement is None else str(placement),
                          planner=planner, profile=None if profile is None else str(profile), policy=policy,
                          policy_params=tuple(parse_params(param).items()), mode=mode, cache_dir=str(cache_dir),
                          calib_data=calib_data, calib_tokens=calib_tokens, dtype=dtype, device=device)


def serve_command(
    model: ModelOpt = "default",
    cluster: ClusterOpt = "edge8",
    placement: PlacementOpt = None,
    planner: PlannerOpt = "ordermoe",
    profile: ProfileOpt = None,
    policy: PolicyOpt = "exact",
    param: ParamOpt = [],  # noqa: B006
    mode: ModeOpt = "home",
    host: Annotated[str, typer.Option(help="HTTP address to bind (any non-loopback address needs an API key)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="HTTP port (0: any free port)")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="EDGEMOE_API_KEY", help="require 'Authorization: Bearer KEY' "
                                                "(default: $EDGEMOE_API_KEY)")] = None,
    backend: Annotated[str | None, typer.Option(help="inprocess (one process) or ray (one actor per server, the same HTTP API); "
                                                "default inprocess, ray when --ray-address or --load-users is given")] = None,
    max_running: Annotated[int, typer.Option(min=1, help="sequences decoded together at most")] = 16,
    max_queue: Annotated[int, typer.Option(min=0, help="requests waiting at most (beyond: 429)")] = 64,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="largest request body (beyond: 413)")] = 1 << 20,
    max_prompt_tokens: Annotated[int | None, typer.Option(min=1, help="longest prompt (default: the model's context)")] = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="largest max_tokens (default: the model's context)")] = None,
    user: Annotated[str | None, typer.Option(help="the user (name or index) of requests that name none")] = None,
    served_name: Annotated[str | None, typer.Option(help="the model id clients give (default: --model)")] = None,
    log_routing: Annotated[Path | None, typer.Option(help="append the served routing to this trace file (JSONL, .gz "
                                                     "for gzip), the format `edgemoe profile --trace` reads")] = None,
    cache_dir: CacheOpt = Path("runs/cache"),
    calib_data: CalibOpt = "offline",
    calib_tokens: CalibTokensOpt = 8192,
    dtype: Annotated[str, typer.Option(help="dtype experts and backbone are held and computed in: float32, bfloat16, "
                                       "float16, or checkpoint (its own: the bytes the planner charged)")] = "float32",
    device: Annotated[str, typer.Option(help="torch device of the model, on every server with --backend ray (cpu, "
                                        "cuda, cuda:1)")] = "cpu",
    domain_fallback: Annotated[bool, typer.Option(
        "--domain-fallback", help="ray: map cluster user domains the profile lacks round-robin onto its domains")] = False,
    ray_address: Annotated[str | None, typer.Option(help="ray: join this Ray cluster (token in RAY_AUTH_TOKEN or ~/.ray/auth_token)")] = None,
    links: Annotated[bool, typer.Option(help="ray: emulate the cluster's links (turn off on a real cluster)")] = True,
    wire: Annotated[str, typer.Option(help="ray: hidden-state dtype on the wire: bf16, fp16, fp32")] = "bf16",
    load_users: Annotated[int, typer.Option(min=0, help="ray: run a closed-loop load with this many users, then stop")] = 0,
    load_seconds: Annotated[float, typer.Option(min=0.001, max=86_400, help="ray: duration of the closed-loop load (s)")] = 20.0,
    gen_tokens: Annotated[int, typer.Option(min=1, help="ray: tokens generated per load request")] = 16,
    dilation: Annotated[str, typer.Option(help="ray: time dilation k of the emulated cluster (>= 1, or 'auto')")] = "1",
    out: Annotated[Path, typer.Option(help="ray: where the load run's metrics go (JSON)")] = Path("runs/serve.json"),
    dial: DialOpt = None,
):
    """Serve the model over an OpenAI-style HTTP API (in-process, continuous batching, a runtime policy per
    token and MoE layer); with no options: the shipped default model on edge8 on 127.0.0.1:8000."""
    from .service import check_bind

    chosen = backend or ("ray" if ray_address or load_users else "inprocess")
    try:
        if chosen not in BACKENDS:
            raise EdgeMoEError(f"--backend {chosen!r}: expected one of {', '.join(BACKENDS)}")
        check_bind(host, api_key)
        if chosen == "ray" and log_routing is not None:  # it was silently ignored: the homes run the passes
            raise EdgeMoEError("--log-routing: only the in-process backend logs routing (on Ray each home runs its "
                               "own passes); leave it out or serve in-process")
        if chosen == "ray":
            from .setup import check_device

            check_device(device, here=False)  # the servers' machines hold the device: only the name is checked here
        if chosen == "ray" and dial is not None and load_users:
            raise EdgeMoEError("--dial: a load run (--load-users) sends no requests to map; serve over HTTP to use it")
        _check_dial_file(dial)
        if chosen == "ray":
            from .api import Limits

            limits = Limits(max_body_bytes, max_prompt_tokens, max_tokens)
            _serve_ray(model, cluster, placement, planner, profile, policy, param, mode, cache_dir, calib_data,
                       calib_tokens, domain_fallback, ray_address, links, wire, load_users, load_seconds, gen_tokens,
                       dilation, out, http=dict(host=host, port=port, api_key=api_key, limits=limits,
                                                max_running=max_running, max_queue=max_queue, user=user,
                                                served_name=served_name, dtype=dtype, device=device,
                                                dial=None if dial is None else str(dial)))
            return
        if log_routing is not None:  # appended to as the server runs: never one of its inputs (nor in its folders)
            from edgemoe.io import Output, check_outputs

            check_outputs({"--log-routing": Output(log_routing)},
                          {"--placement": placement, "--profile": _paths_in(profile), "--dial": dial,
                           "--cluster": cluster, "--model": _paths_in(model)})
        spec = _spec(model, cluster, placement, planner, profile, policy, param, mode, cache_dir, calib_data, calib_tokens,
                     dtype, device)
        from .api import Limits
        from .service import make_service

        svc = make_service(spec, api_key=api_key, limits=Limits(max_body_bytes, max_prompt_tokens, max_tokens),
                           max_running=max_running, max_queue=max_queue, user=user, model_name=served_name,
                           log_routing=None if log_routing is None else str(log_routing), log=typer.echo,
                           dial=None if dial is None else str(dial))
    except EdgeMoEError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    _run_http(svc, host, port, api_key)


def _paths_in(path) -> list:
    """A path given as an input, with the files of the folder it names (a profile, a model folder)."""
    if path is None:
        return []
    p = Path(path)
    return [p, *sorted(p.iterdir())] if p.is_dir() else [p]


def _check_dial_file(dial: Path | None) -> None:
    """A bad dial file fails before the model loads or Ray starts (its deployment is checked once it is built)."""
    if dial is not None:
        from edgemoe.eval.dial import load_dial

        load_dial(dial)


@contextmanager
def _stopped_by_signals():
    """Within it, SIGINT (Ctrl-C) and SIGTERM raise KeyboardInterrupt in the main thread, so that both stop the
    server through the same clean path; the previous handlers come back after. Why not rely on Python's own
    SIGINT handler: a process started with SIGINT ignored (a background job of a non-interactive shell, a
    test runner's worker) keeps SIG_IGN, and then Ctrl-C or `kill -INT` would never reach the server."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread only
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _run_http(svc, host: str, port: int, api_key: str | None) -> None:
    """Serve `svc` until Ctrl-C: the engine in this process, uvicorn and the API in a front process of their own
    (edgemoe.serve.front: HTTP work never holds the engine's GIL)."""
    from .front import FrontProcess

    ctx = svc.deployment.ctx
    for what, info in svc.deployment.sources.items():
        typer.echo(f"{what}: {info['path']}{' (cached)' if info.get('cached') else ''}")
    typer.echo(f"serving {svc.model_name!r} on {ctx.cluster_name} ({ctx.num_nodes} nodes, {ctx.num_users} users), "
               f"placement {ctx.placement_method}, policy {svc.engine.policy_name}, mode {ctx.mode}")
    front = FrontProcess.of(svc, host=host, port=port)
    with _stopped_by_signals():
        try:
            front.start()
            typer.echo(f"OpenAI API at {front.url}/v1{' (API key required)' if api_key else ''}; Ctrl-C stops")
            front.wait()
        except EdgeMoEError as exc:
            typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            pass
        finally:
            front.stop()
            svc.close()


def _serve_ray(model, cluster, placement, planner, profile, policy, param, mode, cache_dir, calib_data, calib_tokens,
               domain_fallback, ray_address, links, wire, load_users, load_seconds, gen_tokens, dilation, out,
               http: dict) -> None:
    """The Ray deployment (edgemoe.distributed): behind the HTTP app, or (--load-users) today's closed-loop load
    run (edgemoe.distributed.cli); a missing placement or profile is made and cached first."""
    from edgemoe.distributed.cli import load_command

    if placement is None or profile is None:
        from .setup import load_deployment

        dep = load_deployment(_spec(model, cluster, placement, planner, profile, "exact", [], mode, cache_dir, calib_data,
                                    calib_tokens),
                              typer.echo)
        placement = Path(dep.sources["placement"]["path"]) if placement is None else placement
        profile = Path(dep.sources["profile"]["path"]) if profile is None else profile
        domain_fallback = domain_fallback or dep.domain_fallback  # as the in-process deployment maps them
    if load_users:
        load_command(cluster=cluster, placement=placement, profile=profile, model=model, policy=policy, param=param,
                     mode=mode, domain_fallback=domain_fallback, ray_address=ray_address, links=links, wire=wire,
                     load_users=load_users, load_seconds=load_seconds, gen_tokens=gen_tokens, dilation=dilation, out=out)
        return
    _serve_ray_http(cluster, placement, profile, model, policy, param, mode, wire, domain_fallback, links, ray_address,
                    dilation, **http)


def _serve_ray_http(cluster, placement, profile, model, policy, param, mode, wire, domain_fallback, links, ray_address,
                    dilation, host, port, api_key, limits, max_running, max_queue, user, served_name, dtype="float32",
                    device="cpu", dial: str | None = None) -> None:
    """One Ray actor per server (edgemoe.distributed), fronted by the HTTP app through `RayEngine`; dial: a dial
    file calibrated in-process on the same deployment (`ray_identity` must match), mapping `max_ppl_increase`."""
    import uvicorn

    from edgemoe.distributed.cli import _dilation, launch
    from edgemoe.distributed.serve import stop_ray
    from edgemoe.models import load_tokenizer

    from .api import create_app
    from .ray_engine import RayEngine
    from .service import default_user_index
    from .telemetry import Telemetry

    k = _dilation(dilation)
    if k == "auto":
        raise EdgeMoEError("--dilation auto calibrates a load run (--load-users); give a number to serve")
    dep = launch(cluster, Path(placement), Path(profile), model, policy, param, mode, wire, domain_fallback, links,
                 ray_address, k, typer.echo, dtype, device)
    ctx = dep.cfg.ctx
    try:
        quality_dial = None
        if dial is not None:
            from .dial import ray_identity
            from .service import deployment_dial

            quality_dial = deployment_dial(dial, ray_identity(dep.cfg))
        engine = RayEngine(dep, load_tokenizer(model), max_running, max_queue,
                           Telemetry(ctx.node_names, policies=(policy,)))
        app = create_app(engine, served_name or model, api_key=api_key, limits=limits,
                         default_user=default_user_index(ctx, user), dial=quality_dial)
        typer.echo(f"serving {served_name or model!r} on {len(dep.handles)} Ray actors ({ctx.cluster_name}), policy "
                   f"{policy}; OpenAI API at http://{host}:{port}/v1{' (API key required)' if api_key else ''}")
        uvicorn.run(app, host=host, port=port, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    finally:
        dep.shutdown()
        stop_ray()


def generate_command(
    prompt: Annotated[str, typer.Argument(help="the prompt text")],
    url: Annotated[str | None, typer.Option(help="a running `edgemoe serve` (http://host:port); default: in-process")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="EDGEMOE_API_KEY", help="with --url: the server's API key")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate at most")] = 32,
    temperature: Annotated[float, typer.Option(min=0, max=2, help="0: greedy")] = 1.0,
    top_p: Annotated[float, typer.Option(min=0, max=1)] = 1.0,
    top_k: Annotated[int, typer.Option(min=0)] = 0,
    seed: Annotated[int, typer.Option(min=0, help="the same seed gives the same text")] = 0,
    stop: Annotated[list[str], typer.Option(help="stop string (repeatable)")] = [],  # noqa: B006
    user: Annotated[str | None, typer.Option(help="cluster user (name or index): whose home runs the request")] = None,
    exact: Annotated[bool, typer.Option("--exact", help="run every routed expert exactly")] = False,
    budget: Annotated[float | None, typer.Option(min=0, help="quality allowance per token-layer (capped by the server's)")] = None,
    max_ppl_increase: Annotated[float | None, typer.Option(min=0, help="quality as a maximum relative perplexity "
                                                           "increase (0.05: +5%), mapped by the quality dial")] = None,
    dial: DialOpt = None,
    explain: Annotated[bool, typer.Option("--explain", help="show where each token's experts ran and what stood in")] = False,
    model: ModelOpt = "default",
    cluster: ClusterOpt = "edge8",
    placement: PlacementOpt = None,
    planner: PlannerOpt = "ordermoe",
    profile: ProfileOpt = None,
    policy: PolicyOpt = "exact",
    param: ParamOpt = [],  # noqa: B006
    mode: ModeOpt = "home",
    cache_dir: CacheOpt = Path("runs/cache"),
    calib_data: CalibOpt = "offline",
    calib_tokens: CalibTokensOpt = 8192,
):
    """Print a completion of PROMPT: in-process (the deployment options), or from a running server (--url)."""
    try:
        for flag, value in (("--budget", budget), ("--max-ppl-increase", max_ppl_increase)):
            if value is not None and not math.isfinite(value):  # inf passes typer's min=0 (and is no JSON number)
                raise EdgeMoEError(f"{flag} {value}: expected a finite number >= 0")
        opts = {"exact": exact, "explain": explain}
        if budget is not None:
            opts["budget"] = budget
        if max_ppl_increase is not None:
            if budget is not None or exact:
                raise EdgeMoEError("give one of --max-ppl-increase, --budget or --exact")
            if url is None and dial is None:
                raise EdgeMoEError("--max-ppl-increase needs --dial FILE (`edgemoe dial`) in-process, or --url of a "
                                   "server started with --dial")
            opts["max_ppl_increase"] = max_ppl_increase
        if dial is not None and url is not None:
            raise EdgeMoEError("--dial is the in-process deployment's; a server (--url) uses its own")
        _check_dial_file(dial)
        for name, text in (("PROMPT", prompt), *((f"--stop {s!r}", s) for s in stop or ())):
            _check_text(name, text)
        if user is not None:
            opts["user"] = int(user) if user.isdigit() else user
        if url:
            text, reason, stats = _generate_http(url, api_key, model, prompt, max_tokens, temperature, top_p, top_k,
                                                 seed, stop, opts)
        else:
            text, reason, stats = _generate_local(_spec(model, cluster, placement, planner, profile, policy, param,
                                                        mode, cache_dir, calib_data, calib_tokens),
                                                  prompt, max_tokens, temperature, top_p, top_k, seed, stop, opts,
                                                  dial)
    except EdgeMoEError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    typer.echo(prompt + text)
    slots = stats["expert_slots"]
    typer.echo(f"[{reason}; {stats['policy']} at {stats['home']}; slots "
               + ", ".join(f"{k} {v}" for k, v in slots.items()) + f"; budget spent {stats['budget_spent']:.3g}; "
               f"remote bytes {stats['remote_bytes']}]", err=True)
    if explain:
        typer.echo(explain_table(stats.get("explain", [])))


def _check_text(name: str, text: str) -> None:
    """Raise EdgeMoEError unless `text` is Unicode text: an argument that was not valid UTF-8 arrives holding
    the lone surrogates Python decodes its bytes to, which no tokenizer (nor a JSON body) can carry."""
    from .text import not_unicode_at

    at = not_unicode_at(text)
    if at is not None:
        raise EdgeMoEError(f"{name}: not valid UTF-8 text (character {at} is not Unicode: a byte that is not "
                           "UTF-8 in the argument, or a lone surrogate)")


def _generate_local(spec, prompt, max_tokens, temperature, top_p, top_k, seed, stop, opts,
                    dial: Path | None = None) -> tuple[str, str, dict]:
    from edgemoe.distributed.sampling import SamplingParams

    from .dial import identity
    from .engine import Engine, GenerationRequest, run_to_end
    from .service import deployment_dial
    from .setup import load_deployment

    dep = load_deployment(spec, lambda m: typer.echo(m, err=True))
    quality_dial = None if dial is None else deployment_dial(str(dial), identity(dep))
    if "max_ppl_increase" in opts:
        low, high, share = quality_dial.mix(opts["max_ppl_increase"])
        opts = {**opts, "budget": low, "budget_mix": (high, share)}
    ctx = dep.ctx
    user = opts.get("user", 0)
    if isinstance(user, str):
        if user not in ctx.user_names:
            raise EdgeMoEError(f"--user {user!r} is not a user of cluster {ctx.cluster_name!r}; expected one of "
                               f"{', '.join(ctx.user_names)}")
        user = ctx.user_names.index(user)
    if not 0 <= user < ctx.num_users:
        raise EdgeMoEError(f"--user {user}: expected an index in [0, {ctx.num_users})")
    ids = dep.tokenizer(prompt)["input_ids"]
    if not ids:
        raise EdgeMoEError("the prompt is empty (it must hold at least one token)")
    if len(ids) + max_tokens > dep.context_length:
        raise EdgeMoEError(f"the prompt's {len(ids)} tokens plus --max-tokens {max_tokens} make {len(ids) + max_tokens}, "
                           f"over the model's context of {dep.context_length} tokens")
    engine = Engine(dep, max_running=1, max_queue=0)
    try:
        req = GenerationRequest(tuple(ids), max_tokens, SamplingParams(temperature, top_p, top_k, seed), tuple(stop),
                                None, user, opts["exact"], opts.get("budget"), opts["explain"], engine.new_request_id(),
                                budget_mix=opts.get("budget_mix"))
        text, _, fin = run_to_end(engine, req)
    finally:
        engine.close()
    return text, fin.reason, fin.stats


def _generate_http(url, api_key, model, prompt, max_tokens, temperature, top_p, top_k, seed, stop, opts):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "seed": seed, "edgemoe": opts}
    if stop:
        body["stop"] = list(stop)
    try:
        r = httpx.post(url.rstrip("/") + "/v1/completions", json=body, headers=headers, timeout=600.0)
    except httpx.HTTPError as exc:
        raise EdgeMoEError(f"--url {url}: cannot reach the server ({type(exc).__name__}: {exc})") from None
    try:
        doc = r.json()
    except ValueError:  # not JSON, not UTF-8 (UnicodeDecodeError), or an integer past int_max_str_digits
        raise EdgeMoEError(f"--url {url}: answered {r.status_code} with a body that is not JSON") from None
    if r.status_code != 200:
        error = doc.get("error") if isinstance(doc, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise EdgeMoEError(f"--url {url}: {r.status_code}: {message if isinstance(message, str) else r.text[:500]}")
    try:  # another server (vLLM, any OpenAI-style one) answers without the edgemoe object, or in another shape
        choice = doc["choices"][0]
        text, reason, stats = choice["text"], choice["finish_reason"], doc["edgemoe"]
        if not (isinstance(text, str) and isinstance(stats, dict) and isinstance(stats["expert_slots"], dict)
                and all(k in stats for k in STATS_SHOWN) and isinstance(stats["budget_spent"], int | float)):
            raise TypeError
    except (KeyError, IndexError, TypeError):
        raise EdgeMoEError(f"--url {url}: the answer is not an edgemoe completion (choices[0].text and an "
                           f"'edgemoe' object with {', '.join(STATS_SHOWN)} were expected): is it `edgemoe serve`?") from None
    return text, reason, stats


def explain_table(tokens: list[dict]) -> str:
    """One line per generated token: per MoE layer its slots, as `expert@node` (local), `expert@node*`
    (remote), `routed->ran@node` (substituted), `routed:dropped`, `routed:zeroed`."""
    def slot(s: dict) -> str:
        if s["kind"] in ("dropped", "zeroed"):
            return f"{s['routed']}:{s['kind']}"
        if s["kind"] == "substituted":
            return f"{s['routed']}->{s['ran']}@{s['node']}"
        return f"{s['routed']}@{s['node']}{'*' if s['kind'] == 'remote' else ''}"

    lines = ["token  text          at          layers (expert@node; * remote, a->b substituted)"]
    for i, t in enumerate(tokens):
        at = t["layers"][0][0]["at"] if t["layers"] else "-"
        layers = " | ".join(" ".join(slot(s) for s in layer) for layer in t["layers"])
        lines.append(f"{i:5d}  {json.dumps(t.get('text', ''))[:12]:<12}  {at:<10}  {layers}")
    return "\n".join(lines)


def dial_command(
    out: Annotated[Path, typer.Option(help="the dial file to write (JSON)")] = Path("runs/dial.json"),
    data: Annotated[str | None, typer.Option(help="calibration text of the dial (an edgemoe.data spec; default: "
                                             "--calib-data): it should look like what the server will be sent")] = None,
    tokens: Annotated[int, typer.Option(min=64, help="calibration tokens the dial is measured on")] = DIAL_TOKENS,
    refine: Annotated[int, typer.Option(min=0, help="extra grid points where the calibration curve turns sharply")] = DIAL_REFINE,
    model: ModelOpt = "default",
    cluster: ClusterOpt = "edge8",
    placement: PlacementOpt = None,
    planner: PlannerOpt = "ordermoe",
    profile: ProfileOpt = None,
    policy: Annotated[str, typer.Option(help="runtime policy of the deployment (one with a budget: ordermoe, drop, "
                                        "skip, ...)")] = "ordermoe",
    param: ParamOpt = [],  # noqa: B006
    mode: ModeOpt = "home",
    cache_dir: CacheOpt = Path("runs/cache"),
    calib_data: CalibOpt = "offline",
    calib_tokens: CalibTokensOpt = 8192,
):
    """Calibrate the quality dial of a deployment (the same options as `edgemoe serve`): its perplexity increase
    on calibration text at fractions of the deployment's budget, written to --out for `edgemoe serve --dial`."""
    try:
        from edgemoe.eval.dial import save_dial
        from edgemoe.io import Output, check_outputs

        from .dial import calibrate_serving_dial, identity
        from .setup import load_deployment

        check_outputs({"--out": Output(out)}, {"--placement": placement, "--profile": _paths_in(profile),
                                               "--cluster": cluster, "--model": _paths_in(model)})
        spec = _spec(model, cluster, placement, planner, profile, policy, param, mode, cache_dir, calib_data, calib_tokens)
        dep = load_deployment(spec, typer.echo)
        text = data or calib_data
        typer.echo(f"calibrating the {policy} dial on {tokens} tokens of {text}")
        dial = calibrate_serving_dial(dep, text, tokens=tokens, refine=refine, log=typer.echo)
        save_dial(out, dial, {**identity(dep), "data": text})
    except EdgeMoEError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code=2) from None
    env = dial.envelope
    typer.echo("budget      credited increase")
    for b, r in zip(dial.budgets, env, strict=True):
        typer.echo(f"{b:<10.4g}  {100 * r:+.2f}%")
    typer.echo(f"wrote {out} (max_ppl_increase up to {100 * env[-1]:.2f}% is mapped below the deployment's budget)")
