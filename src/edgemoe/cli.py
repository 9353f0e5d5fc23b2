"""The `edgemoe` command line: thin typer commands over the library; every command writes files.

The console entry point is `main` (pyproject's [project.scripts]): every failure ends as one
`error: ...` line on stderr. Bad input (EdgeMoEError, a usage mistake, a file the system refuses) exits
with status 2; anything else is a bug: a short line names the file holding the full traceback and the
exit status is 1 (set EDGEMOE_DEBUG=1 to get the raw traceback instead). Outputs follow edgemoe.io's
rules: written beside and renamed, symlinks written through, foreign folders never replaced.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

try:  # typer >= 0.20 vendors click as typer._click; its exception classes are the ones raised
    from typer import _click as click
except ImportError:  # pragma: no cover - older typer on the real click
    import click

from edgemoe.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EdgeMoEError, describe, fail, one_line
from edgemoe.progress import say


class EdgeMoEGroup(TyperGroup):
    """The root command group: runs click in non-standalone mode and turns every outcome into an exit
    status and at most one line on stderr (also under typer's CliRunner, which calls `main` too)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from edgemoe.progress import quiet_unless_terminal

        quiet_unless_terminal()
        code = run_guarded(lambda: super(EdgeMoEGroup, self).main(
            args, prog_name or "edgemoe", complete_var, standalone_mode=False, **extra))
        if standalone_mode:
            sys.exit(code)
        return code


def run_guarded(call) -> int:
    """Run `call()` (a click main in non-standalone mode); return the exit status, printing errors."""
    try:
        rv = call()
    except click.exceptions.NoArgsIsHelpError as exc:
        print(exc.ctx.get_help())
        return 0
    except click.exceptions.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        print(f"error: {one_line(exc.format_message())}{hint}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except click.exceptions.ClickException as exc:
        print(f"error: {one_line(exc.format_message())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (typer.Abort, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("EDGEMOE_DEBUG"):
            raise
        message, code = describe(exc)
        print(message, file=sys.stderr)
        return code
    if rv == EXIT_INTERRUPTED:
        print("interrupted", file=sys.stderr)
    return rv if isinstance(rv, int) else 0


app = typer.Typer(cls=EdgeMoEGroup, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Mixture-of-Experts inference across heterogeneous edge servers.")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: `edgemoe ...`."""
    sys.exit(typer.main.get_command(app).main(argv, prog_name="edgemoe", standalone_mode=False))


SHARED_DATA = Path("../shared/data")


def _mount_subcommands() -> None:
    """Commands that live beside their library code."""
    from edgemoe.cluster.cli import app as cluster_app
    from edgemoe.plan.cli import plan_command

    app.add_typer(cluster_app, name="cluster")
    app.command("plan")(plan_command)
    from edgemoe.serve.cli import dial_command, generate_command, serve_command

    app.command("serve")(serve_command)
    app.command("generate")(generate_command)
    app.command("dial")(dial_command)


_mount_subcommands()


_fail = fail  # commands may still catch EdgeMoEError themselves; the group catches everything else


def _choice(value: str, options: tuple[str, ...] | list[str], flag: str) -> str:
    """`value` if it is one of `options`, else EdgeMoEError naming the flag and the valid values."""
    if value not in options:
        raise EdgeMoEError(f"{flag} {value!r}: expected one of {', '.join(options)}")
    return value


def _is_report_folder(path: Path) -> bool:
    """A report/demo folder written before output markers: our report.md beside plots and results only."""
    try:
        names = [p for p in path.iterdir()]
        head = (path / "report.md").read_text(encoding="utf-8")[:20]
    except (OSError, UnicodeDecodeError):
        return False
    return head.startswith("# edgemoe report") and all(
        p.is_file() and p.suffix in {".md", ".html", ".png", ".json"} for p in names)


REPORT_FILES = ("report.md", "report.html", "*.png", "*.json")  # demo and report folders: results beside the report


@app.command()
def train(
    data: Annotated[Path, typer.Option(help="the shared data folder (wikitext-2/, gutenberg/, tinyshakespeare/)")] = SHARED_DATA,
    out: Annotated[Path | None, typer.Option(help="output model folder (default: the packaged model's folder under "
                                                  "src/edgemoe/assets)")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="optimizer steps (default: the recipe's, 1039 for `default`; "
                                                       "not with --upcycle or --recipe, whose recipes fix them)")] = None,
    schedule_steps: Annotated[int | None, typer.Option(min=1, help="the LR schedule's span (default: the recipe's, 3000 "
                                                                "for `default`; --steps when --steps is given)")] = None,
    max_minutes: Annotated[float, typer.Option(min=0, help="error-out guard: fail, saving nothing, if training runs "
                                                        "longer than this (0: no guard); never a silent stop")] = 0.0,
    stop_after: Annotated[int | None, typer.Option(min=1, help="--upcycle only: stop after this many steps "
                                                       "(dense + MoE) of its recipe")] = None,
    seed: Annotated[int, typer.Option(min=0, help="random seed")] = 0,
    upcycle: Annotated[bool, typer.Option(help="train default-upcycled instead: dense pretraining, the FFN copied into "
                                               "every expert, fresh router, MoE training")] = False,
    recipe: Annotated[str | None, typer.Option(help="train a model derived from default-upcycled: "
                                                    "upcycled-diverged or finegrained-shared")] = None,
):
    """Train a packaged model (default: `default`, Mixtral format) on the multi-domain corpus and save it with its recipe.

    Every recipe is a step budget: training ends on its step count, never on the clock.
    """
    from dataclasses import replace

    from edgemoe.io import Output, check_outputs
    from edgemoe.models.train import TrainConfig, is_trained_model_folder, train_default_model

    _finite(max_minutes, "--max-minutes")
    if upcycle and recipe:
        _fail(EdgeMoEError("--upcycle and --recipe: give one of them"))
    if (upcycle or recipe) and (steps is not None or schedule_steps is not None):
        _fail(EdgeMoEError("--steps/--schedule-steps: not with --upcycle or --recipe (their recipes fix the steps)"))
    if stop_after is not None and not upcycle:
        _fail(EdgeMoEError("--stop-after: only with --upcycle (use --steps for the default model)"))
    if recipe is not None:
        from edgemoe.models.derive import RECIPE_FOLDERS

        if recipe not in RECIPE_FOLDERS:
            _fail(EdgeMoEError(f"--recipe {recipe!r}: expected one of {', '.join(RECIPE_FOLDERS)}"))
        folder = RECIPE_FOLDERS[recipe]
    else:
        folder = "default_upcycled_model" if upcycle else "default_model"
    out = out or Path("src/edgemoe/assets") / folder
    check_outputs({"--out": Output(out, "model", is_trained_model_folder)}, {"--data": data})
    try:
        if recipe is not None:
            from edgemoe.models.derive import RECIPES, train_derived_model

            cfg = replace(RECIPES[recipe], seed=seed, max_minutes=max_minutes)
            result = train_derived_model(data, out, recipe, cfg, log=say)
        elif upcycle:
            from edgemoe.models.upcycle import UpcycleConfig, train_upcycled_model

            base = UpcycleConfig()
            cfg = replace(base, model=replace(base.model, seed=seed), max_minutes=max_minutes, stop_after=stop_after)
            result = train_upcycled_model(data, out, cfg, log=say)
        else:
            base = TrainConfig()
            span = schedule_steps if schedule_steps is not None else (base.schedule_steps if steps is None else steps)
            cfg = replace(base, steps=steps or base.steps, schedule_steps=span, max_minutes=max_minutes, seed=seed)
            result = train_default_model(data, out, cfg, log=say)
    except EdgeMoEError as exc:
        _fail(exc)
    typer.echo(f"saved {out} after {result['steps_done']} steps, {result['train_minutes']} min; "
               f"held-out perplexity {result['heldout_perplexity']}")


def default_data_spec() -> str:
    """The shared corpus' held-out split when ../shared/data is present, else the offline stdlib corpus."""
    return f"shared:{SHARED_DATA}" if SHARED_DATA.is_dir() else "offline"


@app.command()
def profile(
    out: Annotated[Path, typer.Option(help="output profile folder")],
    model: Annotated[str, typer.Option(help="'default', an HF folder, or a hub id")] = "default",
    data: Annotated[str | None, typer.Option(help="'offline', 'shared:PATH', 'wikitext-test:PATH', 'hf:ID[:SPLIT]' or a file/folder "
                                                  "(default: shared:../shared/data when present, else offline)")] = None,
    tokens: Annotated[int, typer.Option(min=1, help="calibration tokens (split evenly across the data's domains)")] = 50_000,
    block_len: Annotated[int, typer.Option(min=2, help="tokens per sequence")] = 256,
    subst_tokens: Annotated[int, typer.Option(min=1, help="tokens per layer whose hidden states measure substitution error")] = 1024,
    report: Annotated[Path | None, typer.Option(help="also write the specialisation report (JSON + PNG) here")] = None,
    trace: Annotated[list[Path] | None, typer.Option(help="routing trace files instead of a model (edgemoe "
                                                          "JSONL, vLLM routed_experts JSONL, llama.cpp moe-trace CSV; "
                                                          "plain or .gz): --trace FILE [FILE ...] (docs/traces.md)")] = None,
    model_spec: Annotated[str | None, typer.Option(help="with --trace: a built-in spec (mixtral-8x7b, qwen1.5-moe-a2.7b, "
                                                        "qwen3-30b-a3b, deepseek-v2-lite, olmoe-1b-7b, switch-base-8) or "
                                                        "an HF config.json (default: the model a meta line names)")] = None,
    trace_format: Annotated[str, typer.Option(help="with --trace: auto | edgemoe | vllm | llamacpp (edgemoe JSONL, "
                                                   "vLLM routed_experts JSONL, llama.cpp moe-trace CSV); auto "
                                                   "detects it from each file's first line")] = "auto",
    more_traces: Annotated[list[Path] | None, typer.Argument(hidden=True, help="further --trace files")] = None,
):
    """Record router logits, Top-K and gates on calibration text and derive the routing statistics
    (or build the profile from logged routing traces with --trace, no weights needed)."""
    if trace or more_traces:
        _profile_from_trace(list(trace or []) + list(more_traces or []), model_spec, out, report, bool(trace),
                            None if trace_format == "auto" else trace_format)
        return
    from edgemoe.data import resolve
    from edgemoe.models import load_moe, load_tokenizer
    from edgemoe.profile.collect import collect_profile, profile_blocks_for

    if tokens < block_len:
        raise EdgeMoEError(f"--tokens {tokens} is less than --block-len {block_len}; give at least one block of tokens")
    _claim_profile_outputs(out, report, {"--model": model, "--data": (data or "").split(":")[-1] or None})
    try:
        spec = data or default_data_spec()
        adapter = load_moe(model)
        tokenizer = load_tokenizer(model)
        sources = resolve(spec)
        blocks = profile_blocks_for(sources, tokenizer, tokens, block_len)
        prof = collect_profile(adapter, blocks, model, spec, subst_tokens=subst_tokens)
        prof.save(out)
    except EdgeMoEError as exc:
        _fail(exc)
    typer.echo(_profile_summary(prof))
    typer.echo(f"wrote {out}")
    _write_profile_report(prof, report)


PROFILE_REPORT_FILES = ("specialisation.json", "*.png")


def _claim_profile_outputs(out: Path, report: Path | None, inputs: dict) -> None:
    """`profile`'s outputs, claimed before the model or the trace is read (edgemoe.io.check_outputs)."""
    from edgemoe.io import Output, check_outputs
    from edgemoe.profile.store import is_profile_folder

    check_outputs({"--out": Output(out, "profile", is_profile_folder),
                   "--report": Output(report, "profile report", action="write into")}, inputs)


def _write_profile_report(prof, report: Path | None) -> None:
    """The specialisation report, written all or nothing into `report` (edgemoe.io.write_into_dir)."""
    if report is None:
        return
    from edgemoe.io import write_into_dir
    from edgemoe.profile.report import specialisation_report

    write_into_dir(report, lambda stage: specialisation_report(prof, stage), "profile report", PROFILE_REPORT_FILES)
    typer.echo(f"wrote {report}/specialisation.json, usage_heatmaps.png, similarity.png")


def _profile_from_trace(files: list[Path], spec: str | None, out: Path, report: Path | None, flagged: bool,
                        fmt: str | None = None) -> None:
    """`edgemoe profile --trace ...`: parse the trace files, build and save an ordinary profile."""
    from edgemoe.profile.trace import trace_profile

    try:
        if not flagged:
            raise EdgeMoEError(f"unexpected argument {str(files[0])!r}; trace files follow --trace")
        _claim_profile_outputs(out, report, {"--trace": files, "--model-spec": spec})
        prof, tr = trace_profile(files, spec, fmt)
        prof.save(out)
    except EdgeMoEError as exc:
        _fail(exc)
    c = tr.counts
    typer.echo(f"trace: {c['route_lines']:,} route lines in {len(files)} file(s), {c['requests']:,} requests; "
               f"{c['tokens_kept']:,} tokens kept, {c['tokens_dropped_incomplete']:,} dropped (missing a logged layer); "
               f"skipped lines by type: {c['skipped_by_type'] or 'none'}")
    typer.echo(f"model spec: {tr.spec.describe()}")
    if c["format"] != "edgemoe":
        typer.echo(f"format: {c['format']}; gates {c['gates']}; token_idx from the line order")
    from edgemoe.profile.specs import builtin_for

    named = {builtin_for(m) for m in tr.meta_models} - {None}
    if named and tr.spec.name not in named:
        typer.echo(f"note: the trace's meta line names {', '.join(tr.meta_models)}, not the spec {tr.spec.name}")
    if len(tr.layer_ids) < len(tr.spec.moe_layer_ids):
        typer.echo(f"note: the trace logs {len(tr.layer_ids)} of the model's {len(tr.spec.moe_layer_ids)} MoE layers; "
                   "the profile holds those only")
    typer.echo(f"similarity from {prof.meta.similarity}; substitution error {prof.meta.subst_err_source}")
    typer.echo(_profile_summary(prof))
    typer.echo(f"wrote {out}")
    _write_profile_report(prof, report)


def _profile_summary(prof) -> str:
    import numpy as np

    m = prof.meta
    lines = [
        f"model {m.model} ({m.family}): L={m.num_layers} MoE layers, E={m.num_experts}, K={m.top_k}, hidden {m.hidden_size}",
        f"expert bytes {int(prof.expert_bytes[0, 0]):,} each, {int(prof.expert_bytes.sum()):,} in all; hidden state {m.hidden_bytes} B on the wire ({m.wire_dtype})",
        f"tokens {prof.num_tokens:,} from {m.data} (domains: {', '.join(m.domains)})",
    ]
    off = ~np.eye(prof.E, dtype=bool)
    for layer in range(prof.L):
        f = prof.freq[layer]
        lines.append(
            f"  layer {layer}: busiest expert {int(f.argmax())} ({f.max():.3f}/tok), idlest {int(f.argmin())} ({f.min():.3f}/tok), "
            f"mean off-diag cosine {prof.sim[layer][off].mean():.3f}, mean subst. error {prof.subst_err[layer][off].mean():.3f}"
        )
    return "\n".join(lines)


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="output folder (results JSON, plots, report)")] = Path("runs/demo"),
    quick: Annotated[bool, typer.Option(help="fewer tokens and requests (a smoke run)")] = False,
    eval_data: Annotated[str | None, typer.Option(help="evaluation text spec (default: WikiText-2 test, else offline)")] = None,
    backend: Annotated[str, typer.Option(help="latency from the 'simulate' backend or measured on 'ray' actors")] = "simulate",
    scenario: Annotated[str, typer.Option(help="'default' (the default model) or 'paper-scale' (Mixtral-8x7B and "
                                               "Qwen1.5-MoE-A2.7B on testbed8, routing calibrated on real counts)")] = "default",
    shared_data: Annotated[Path, typer.Option(help="with --scenario paper-scale: the shared data folder")] = SHARED_DATA,
    dilation: Annotated[str, typer.Option(help="with --backend ray: time dilation k of the emulated cluster, a number "
                                               ">= 1 for every method, or 'auto' (calibrated per method)")] = "auto",
    workers: Annotated[int | None, typer.Option(min=1, help="processes running the comparisons side by side (default: "
                                                       "one per core, at most 3; the results are the same with any)")] = None,
):
    """The main job: the default model on edge8 (OrderMoE's comparison) and device-edge-cloud (SlimCaching's),
    every method side by side; writes results JSON, plots, a Markdown/HTML report and summary.json (its wall and
    CPU time and the load)."""
    import os
    import time

    t0, load_start = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
    if scenario == "paper-scale":
        _demo_paper_scale(out, quick, shared_data)
        return
    if scenario != "default":
        _fail(EdgeMoEError(f"--scenario {scenario!r}: expected 'default' or 'paper-scale'"))
    from edgemoe.eval.experiment import (
        ExperimentConfig,
        demo_summary,
        demo_workers,
        run_demo,
    )
    from edgemoe.io import Output, check_outputs, write_into_dir
    from edgemoe.report.render import render_report

    _choice(backend, ("simulate", "ray"), "--backend")
    k = _demo_dilation(dilation, backend)
    check_outputs({"--out": Output(out, "report", _is_report_folder, "write into")},
                  {"--eval-data": (eval_data or "").split(":")[-1] or None})
    cfg = ExperimentConfig(eval_data=eval_data, ray_dilation=k)
    if quick:
        cfg = ExperimentConfig(eval_data=eval_data, calib_tokens=4096, eval_tokens=2048, num_requests=16,
                               prompt_tokens=8, gen_tokens=8, calib_quality_tokens=1024, ray_dilation=k)
    workers = 1 if backend == "ray" else workers or demo_workers()  # Ray's actors are the parallel part there
    try:
        from edgemoe.eval.experiment import ordermoe_comparison, slimcaching_comparison
        from edgemoe.io import atomic_write_json

        ordermoe, slimcaching = ordermoe_comparison(), slimcaching_comparison()
        names: list[str] = []

        def write(stage: Path) -> None:
            # all or nothing (issue 22): results and report are made in a private folder beside --out and
            # moved in only once every comparison and the report are done; a failure leaves --out as it was
            # the progress bar counts OrderMoE's comparison once per model, SlimCaching's once
            with _experiment_log([ordermoe] * max(1, len(cfg.models)) + [slimcaching]) as log:
                staged = run_demo(cfg, stage, backend=backend, log=log, ordermoe=ordermoe, slimcaching=slimcaching,
                                  workers=workers)
            render_report(staged, stage, shown_dir=out)
            names.extend(p.name for p in staged)
            atomic_write_json(stage / "summary.json", demo_summary(staged, time.perf_counter() - t0, load_start, workers, backend))

        folder = write_into_dir(out, write, "report", REPORT_FILES, recognise=_is_report_folder)
    except EdgeMoEError as exc:
        _fail(exc)
    paths = [folder / name for name in names]
    report = Path(out) / "report.md"
    from edgemoe.results import load_results, markdown_table, methods_table

    for p in paths:
        res = load_results(p)
        typer.echo(f"\n{res['config']['name']} ({res['config']['cluster']}, {res['config']['mode']} mode)")
        typer.echo(markdown_table(methods_table(res)))
        for line in res.get("summary", []):
            typer.echo(f"- {line}")
    typer.echo(f"\nwrote {', '.join(str(p) for p in paths)}, {report} and {report.with_suffix('.html')}")


def _demo_dilation(text: str, backend: str) -> float | None:
    """--dilation of `demo`: None for 'auto' (the experiment calibrates k per method), else k >= 1 (ray only)."""
    from edgemoe.distributed.cli import _dilation

    k = _dilation(text)
    if k != "auto" and backend != "ray":
        raise EdgeMoEError(f"--dilation {text}: time dilation applies to --backend ray only")
    return None if k == "auto" else float(k)


def _demo_paper_scale(out: Path, quick: bool, shared_data: Path) -> None:
    """`edgemoe demo --scenario paper-scale` (edgemoe.eval.paper_scale)."""
    from edgemoe.eval.paper_scale import PaperScaleConfig, run_paper_scale
    from edgemoe.io import Output, check_outputs, claim_output_dir

    # claimed like every report folder: a user's folder (or its summary.md) is never written into
    check_outputs({"--out": Output(out, "report", _is_report_folder, "write into")}, {"--shared-data": shared_data})
    claim_output_dir(out, "report", (*REPORT_FILES, "summary.md"), recognise=_is_report_folder)

    cfg = PaperScaleConfig(shared_data=str(shared_data))
    if quick:
        cfg = PaperScaleConfig(shared_data=str(shared_data), tokens_per_domain=200, num_requests=8, exact_time_limit_s=5.0)
    try:
        paths = run_paper_scale(cfg, out, log=typer.echo)
    except EdgeMoEError as exc:
        _fail(exc)
    typer.echo((out / "summary.md").read_text())
    typer.echo(f"wrote {', '.join(str(p) for p in paths)}, {out / 'summary.json'} and {out / 'summary.md'}")


@app.command()
def evaluate(
    out: Annotated[Path, typer.Option(help="results JSON to write")],
    model: Annotated[str, typer.Option(help="'default', an HF folder, or a hub id")] = "default",
    cluster: Annotated[str, typer.Option(help="cluster file or preset")] = "edge8",
    mode: Annotated[str, typer.Option(help="token location: migrate | home")] = "migrate",
    method: Annotated[list[str] | None, typer.Option(help="NAME=PLACEMENT:POLICY[:key=value,...] (repeatable)")] = None,
    eval_data: Annotated[str | None, typer.Option(help="evaluation text spec")] = None,
    calib_data: Annotated[str | None, typer.Option(help="calibration text spec")] = None,
    eval_tokens: Annotated[int, typer.Option(min=1, help="evaluation tokens")] = 16_384,
    calib_tokens: Annotated[int, typer.Option(min=1, help="calibration tokens (profile)")] = 20_000,
    cache_dir: Annotated[Path, typer.Option(help="where calibration profiles are cached")] = Path("runs/cache"),
    profile: Annotated[Path | None, typer.Option(help="replay this profile's routing (e.g. from --trace) in the simulator, "
                                                      "no model; PLACEMENT may then be a placement file")] = None,
    requests: Annotated[int, typer.Option(min=1, help="with --profile: simulated requests per method")] = 64,
    rate: Annotated[float, typer.Option(min=1e-9, max=1e9, help="with --profile: Poisson request rate (req/s, all users)")] = 20.0,
    plan_profile: Annotated[Path | None, typer.Option(help="with --profile: plan and build the policies' knowledge "
                                                           "from this profile instead (out of sample)")] = None,
):
    """Evaluate chosen placements and policies on the real model (quality) and the simulator (latency);
    with --profile, replay a profile's tokens in the simulator only (quality columns stay empty)."""
    if profile is not None:
        _evaluate_profile(profile, out, cluster, mode, method, requests, rate, plan_profile)
        return
    from edgemoe.cluster import load_cluster
    from edgemoe.eval.experiment import Comparison, ExperimentConfig, run_experiment
    from edgemoe.io import Output, check_outputs, file_target, publish_file, temp_prefix

    _choice(mode, ("migrate", "home"), "--mode")
    specs = _parse_methods(method or ["exact=uniform:exact", "ordermoe=ordermoe:ordermoe"])
    check_outputs({"--out": Output(out)}, _evaluate_inputs(cluster, specs, model=model, eval_data=eval_data,
                                                           calib_data=calib_data))
    load_cluster(cluster)  # a bad cluster fails now, not after the model ran
    target = file_target(out)
    cfg = ExperimentConfig(model=model, eval_data=eval_data, calib_data=calib_data, eval_tokens=eval_tokens,
                           calib_tokens=calib_tokens, cache_dir=str(cache_dir))
    comp = Comparison(name=out.stem, cluster=cluster, mode=mode, methods=specs)
    # The experiment names its file after the comparison; it writes into a private folder beside the
    # target, so nothing next to --out (e.g. X.json beside X.md) is touched.
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(target.name), suffix=".tmp"))
    try:
        with _experiment_log([comp]) as log:
            (path,) = run_experiment(cfg, [comp], work, log=log)
        publish_file(path, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    typer.echo(f"wrote {out}")


def _experiment_log(comparisons):
    """A log for run_experiment whose per-method (and per-budget) result lines advance a progress bar."""
    from edgemoe.progress import StepLog

    total = sum(len(c.methods) + (len(c.budgets) + len(c.operating_points)) * len(c.budget_sweep_methods)
                for c in comparisons)
    return StepLog(total, "methods evaluated", lambda line: line.startswith("  ") and " ms" in line)


def _parse_methods(texts: list[str]) -> tuple:
    """Every --method parsed and checked: names unique, placement and policy known, parameters typed."""
    specs = tuple(_parse_method(m) for m in texts)
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise EdgeMoEError(f"--method names must be unique; {', '.join(map(repr, twice))} given more than once")
    return specs


def _evaluate_profile(profile: Path, out: Path, cluster: str, mode: str, method: list[str] | None, requests: int,
                      rate: float, plan_profile: Path | None = None) -> None:
    """`edgemoe evaluate --profile`: simulator-only replay of a profile (edgemoe.eval.replay)."""
    from edgemoe.eval.replay import DEFAULT_METHODS, evaluate_profile_file
    from edgemoe.io import Output, check_outputs
    from edgemoe.results import load_results, markdown_table, methods_table
    from edgemoe.runtime.sim.workload import Workload

    try:
        specs = _parse_methods(method or list(DEFAULT_METHODS))
        check_outputs({"--out": Output(out)}, _evaluate_inputs(cluster, specs, profile=profile, plan_profile=plan_profile))
        workload = Workload(num_requests=requests, prompt_tokens=16, gen_tokens=16, rate_per_s=rate)
        path = evaluate_profile_file(profile, cluster, specs, out, mode=mode, workload=workload, log=typer.echo,
                                     plan_profile_dir=plan_profile)
    except EdgeMoEError as exc:
        _fail(exc)
    typer.echo(markdown_table(methods_table(load_results(path))))
    typer.echo(f"wrote {path}")


def _evaluate_inputs(cluster: str, specs, **given) -> dict:
    """Every path `evaluate` reads, by flag (for edgemoe.io.check_outputs): the cluster file, placement
    files named by --method, profiles, the model and data when they are paths."""
    inputs = {f"--{k.replace('_', '-')}": (str(v).split(":")[-1] if isinstance(v, str) else v) for k, v in given.items()}
    inputs["--cluster"] = cluster
    inputs["--method"] = [s.placement for s in specs]
    return inputs


def _parse_method(text: str):
    """'name=placement:policy[:k=v,k=v]' -> MethodSpec (values read by edgemoe.params.parse_value)."""
    from edgemoe.eval.experiment import MethodSpec
    from edgemoe.params import parse_params
    from edgemoe.runtime.registry import policy_params

    name, sep, rest = text.partition("=")
    parts = rest.split(":", 2)
    if not sep or len(parts) < 2 or not name:
        raise EdgeMoEError(f"--method {text!r}: expected NAME=PLACEMENT:POLICY[:key=value,...]")
    flag = f"--method {name!r} parameter"
    params = parse_params(parts[2].split(",") if len(parts) == 3 and parts[2] else [], flag=flag)
    return MethodSpec(name, _check_placement_name(parts[0], text), parts[1], policy_params(parts[1], params, flag))


def _check_placement_name(placement: str, text: str) -> str:
    from edgemoe.plan.base import planners

    valid = sorted(planners()) + ["all-local"]
    if placement not in valid and not Path(placement).is_file():  # a placement file (edgemoe plan --out)
        raise EdgeMoEError(f"--method {text!r}: unknown placement {placement!r}; expected one of {', '.join(valid)} or a placement file")
    return placement


def _finite(value: float, flag: str) -> float:
    import math

    if not math.isfinite(value):
        raise EdgeMoEError(f"{flag} {value}: expected a finite number")
    return value


@app.command()
def report(
    results: Annotated[list[Path], typer.Argument(help="results JSON files")],
    out: Annotated[Path, typer.Option(help="output folder")] = Path("runs/report"),
):
    """Re-render plots and the Markdown/HTML report from results files."""
    from edgemoe.io import Output, check_outputs, write_into_dir
    from edgemoe.report.render import render_report
    from edgemoe.results import load_results

    check_outputs({"--out": Output(out, "report", _is_report_folder, "write into")}, {"RESULTS": list(results)})
    for p in results:
        load_results(p)  # every input is valid before the output folder is made
    # rendered into a private folder first: a failure leaves --out as it was (not half-written, not created)
    write_into_dir(out, lambda stage: render_report(results, stage), "report", REPORT_FILES,
                            recognise=_is_report_folder)
    path = Path(out) / "report.md"
    typer.echo(f"wrote {path} and {path.with_suffix('.html')}")

