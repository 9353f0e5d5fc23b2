"""The results file: one self-describing JSON per run (schema "edgemoe.results/1").

    {"schema": "edgemoe.results/1", "config": {...}, "environment": {...},
     "methods": {NAME: {"placement": str, "policy": str,
                        "latency_ms": {"mean", "p50", "p95", "p99"}, "ttft_ms": {...},
                        "traffic_bytes_per_1k_tokens": float, "remote_ratio": float,
                        "substitution_ratio": float, "ppl": float|null, "quality_retention": float|null,
                        "throughput_tokens_per_s": float, ...optional extra fields}}}

`write_results` writes atomically; `load_results` validates (pydantic at the boundary) and returns the dict;
`methods_table` and `markdown_table` render its comparison table (for the report, the CLI and the demo).
"""

from __future__ import annotations

import math
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, ValidationError, field_validator

from edgemoe.errors import EdgeMoEError
from edgemoe.io import atomic_write_json, jsonable, read_json

SCHEMA = "edgemoe.results/1"


class _Percentiles(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mean: float | None  # null: nothing measured (e.g. no generated tokens)
    p50: float | None
    p95: float | None
    p99: float | None


class _Method(BaseModel):
    model_config = ConfigDict(extra="allow")  # optional fields (traffic split, utilisation, ...) are kept
    placement: str
    policy: str
    latency_ms: _Percentiles
    ttft_ms: _Percentiles
    traffic_bytes_per_1k_tokens: float
    remote_ratio: float
    substitution_ratio: float
    ppl: float | None
    quality_retention: float | None
    throughput_tokens_per_s: float

    @field_validator("remote_ratio", "substitution_ratio")
    @classmethod
    def _ratio(cls, v: float) -> float:
        if not (0.0 <= v <= 1.0 or math.isnan(v)):
            raise ValueError(f"must be in [0, 1], got {v}")
        return v

    @field_validator("traffic_bytes_per_1k_tokens", "throughput_tokens_per_s")
    @classmethod
    def _nonneg(cls, v: float) -> float:
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v


class _Placement(BaseModel):
    """What the report draws of a placement: [L, E] copies off the cloud and [N] bytes held per node."""

    model_config = ConfigDict(extra="allow")
    copies: list[list[NonNegativeInt]] | None = None
    bytes_used: list[NonNegativeFloat] | None = None

    @field_validator("copies")
    @classmethod
    def _rectangular(cls, v):
        if v is not None and (not v or not v[0] or len({len(row) for row in v}) != 1):
            raise ValueError("must be an [L][E] table (every layer the same number of experts)")
        return v


class _Results(BaseModel):
    # Extra top-level sections (budget sweep, groups, summary) ride along for the report; the sections
    # the report draws from are typed here so that a damaged one is an error naming it, not a crash.
    model_config = ConfigDict(extra="allow")
    schema_: str
    config: dict
    environment: dict
    methods: dict[str, _Method]
    placements: dict[str, _Placement] | None = None
    groups: dict[str, list[float]] | None = None
    summary: list[str] | None = None
    ppl_exact: float | None = None


def environment() -> dict:
    """Facts about where a run happened: versions, platform, the processor and the cores this process may use,
    git commit (and whether the tree had uncommitted changes), time (UTC), the host's load average (1, 5, 15 min)
    and the CPU seconds this process and its waited-for children had used when the record was made (Ray actors
    are not children: not counted). The processor, because timings from two hosts are not comparable (the same
    benchmark ran 2-3x slower on one of this project's hosts than on another)."""
    import os
    import resource
    import time

    import numpy as np

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env = {"python": platform.python_version(), "numpy": np.__version__, "platform": platform.platform(),
           "machine": platform.machine(), "cpu_model": cpu_model(), "cpus": cpus,
           "time_utc": datetime.now(UTC).isoformat(timespec="seconds"), "argv": list(sys.argv),
           "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
           "cpu_s": round(time.process_time() + kids.ru_utime + kids.ru_stime, 1)}
    env["git_commit"] = _git(["rev-parse", "HEAD"]) or None
    # results files a run writes are its outputs, not code: a tree whose only changes lie under bench/results
    # ran the committed code (pathspecs from the top, since git runs beside this file)
    status = _git(["status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)bench/results"])
    env["git_dirty"] = None if status is None and env["git_commit"] is None else bool(status)
    return env


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """The processor's name as the kernel reports it (the first `model name` of `cpuinfo`), else
    `platform.processor()`; None when neither names one."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _git(args: list[str]) -> str | None:
    """The stripped stdout of `git ARGS` run beside this file, None when git is missing or fails."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def results_dict(config: dict, methods: dict[str, dict], env: dict | None = None) -> dict:
    """Assemble and validate a results document."""
    doc = {"schema": SCHEMA, "config": config, "environment": environment() if env is None else env,
           "methods": methods}
    validate_results(doc, "results")
    return doc


def write_results(path: str | Path, config: dict, methods: dict[str, dict], env: dict | None = None) -> Path:
    """Validate and write a results file atomically; returns the path."""
    return atomic_write_json(path, jsonable(results_dict(config, methods, env)))


def write_document(path: str | Path, doc: dict) -> Path:
    """Validate a whole results document (extra top-level sections allowed) and write it atomically."""
    validate_results(doc, str(path))
    return atomic_write_json(path, jsonable(doc))


def validate_results(doc: dict, source: str = "results") -> dict:
    """Raise EdgeMoEError naming the field if `doc` is not a valid edgemoe.results/1 document."""
    if not isinstance(doc, dict):
        raise EdgeMoEError(f"{source}: a results file is a JSON object")
    if doc.get("schema") != SCHEMA:
        raise EdgeMoEError(f"{source}: schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    body = {("schema_" if k == "schema" else k): v for k, v in doc.items()}
    try:
        _Results.model_validate(body)
    except ValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise EdgeMoEError(f"{source}: invalid results file\n  " + "\n  ".join(lines)) from None
    return doc


def load_results(path: str | Path) -> dict:
    """Read and validate a results file; returns the document as a dict."""
    return validate_results(read_json(path, "results file"), str(path))


# ------------------------------------------------------------------ the comparison table of a results file

TABLE_COLUMNS = (
    ("placement", "placement", "{}"),
    ("policy", "policy", "{}"),
    ("mean ms", ("latency_ms", "mean"), "{:.1f}"),
    ("p50 ms", ("latency_ms", "p50"), "{:.1f}"),
    ("p99 ms", ("latency_ms", "p99"), "{:.1f}"),
    ("TTFT ms", ("ttft_ms", "mean"), "{:.1f}"),
    ("traffic MB/1k tok", "traffic_bytes_per_1k_tokens", "{:.2f}"),
    ("remote", "remote_ratio", "{:.3f}"),
    ("subst.", "substitution_ratio", "{:.3f}"),
    ("ppl", "ppl", "{:.3f}"),
    ("ppl +%", "ppl_rel_increase", "{:+.2%}"),
    ("top-1 agr.", "top1_agreement", "{:.4f}"),
    ("tok/s", "throughput_tokens_per_s", "{:.1f}"),
)


def _get(m: dict, key):
    if isinstance(key, tuple):
        v = m
        for k in key:
            v = v.get(k) if isinstance(v, dict) else None
        return v
    return m.get(key)


def methods_table(results: dict) -> list[list[str]]:
    """Rows of the comparison table: header first."""
    rows = [["method"] + [c[0] for c in TABLE_COLUMNS]]
    for name, m in results["methods"].items():
        row = [name]
        for _, key, fmt in TABLE_COLUMNS:
            v = _get(m, key)
            if key == "traffic_bytes_per_1k_tokens" and v is not None:
                v = v / 1e6
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    return rows


def markdown_table(rows: list[list[str]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)
