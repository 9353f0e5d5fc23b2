"""The results file: one self-describing JSON per run (schema "edgemoe.results/1").

    {"schema": "edgemoe.results/1", "config": {...}, "environment": {...},
     "methods": {NAME: {"placement": str, "policy": str,
                        "latency_ms": {"mean", "p50", "p95", "p99"}, "ttft_ms": {...},
                        "traffic_bytes_per_1k_tokens": float, "remote_ratio": float,
                        "substitution_ratio": float, "ppl": float|null, "quality_retention": float|null,
                        "throughput_tokens_per_s": float, ...optional extra fields}}}

`write_results` writes atomically; `load_results` validates (pydantic at the boundary) and returns the dict.
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
from edgemoe.io import atomic_write_json, read_json

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
    """Facts about where a run happened: versions, platform, git commit, time (UTC)."""
    import numpy as np

    env = {"python": platform.python_version(), "numpy": np.__version__, "platform": platform.platform(),
           "machine": platform.machine(), "time_utc": datetime.now(UTC).isoformat(timespec="seconds"),
           "argv": list(sys.argv)}
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                           cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


def fastest_run(repeats: int, run, *args, **kwargs):
    """(result, wall s, CPU s) of `run(*args, **kwargs)` called `repeats` times (at least once), keeping the
    fastest wall and CPU time, as timeit does: on a shared machine the slower repeats measure the other
    processes. `run` must give the same result every time (the benchmarks' runs are deterministic); the last
    one is returned."""
    import time

    wall = cpu = math.inf
    result = None
    for _ in range(max(int(repeats), 1)):
        w0, c0 = time.perf_counter(), time.process_time()
        result = run(*args, **kwargs)
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return result, wall, cpu


def results_dict(config: dict, methods: dict[str, dict], env: dict | None = None) -> dict:
    """Assemble and validate a results document."""
    doc = {"schema": SCHEMA, "config": config, "environment": environment() if env is None else env,
           "methods": methods}
    validate_results(doc, "results")
    return doc


def write_results(path: str | Path, config: dict, methods: dict[str, dict], env: dict | None = None) -> Path:
    """Validate and write a results file atomically; returns the path."""
    return atomic_write_json(path, _jsonable(results_dict(config, methods, env)))


def write_document(path: str | Path, doc: dict) -> Path:
    """Validate a whole results document (extra top-level sections allowed) and write it atomically."""
    validate_results(doc, str(path))
    return atomic_write_json(path, _jsonable(doc))


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


def _jsonable(obj):
    """Plain JSON types: numpy scalars/arrays to Python, NaN/inf to null (strict JSON)."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
