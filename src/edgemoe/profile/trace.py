"""Routing traces in: JSONL logs of a served model's routing become an ordinary profile (no weights needed).

Format (docs/traces.md): one JSON object per line, `.jsonl` or gzip-compressed `.jsonl.gz`.

    {"type": "meta", "model": "mistralai/Mixtral-8x7B-v0.1"}                       (optional, any place)
    {"type": "route", "req_id": "r1", "token_idx": 0, "layer": 3, "topk_ids": [5, 1],
     "topk_weights": [0.62, 0.38], "router_logits": [...E floats...], "domain": "chat"}

`type` defaults to "route"; lines of any other type are skipped (a `meta` line may name the model). A token
is a (req_id, token_idx) pair. The layers a trace logs are the MoE layers of its profile; a token missing
one of them is dropped and counted. A repeated (req_id, token_idx, layer) is an error naming both lines.
Without router logits, similarity comes from co-selection and gates; without weights, substitution error
is estimated as 1 - similarity; the profile's meta records both. Without `domain`, the trace is one
domain ("all"), which every cluster's users map onto.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import platform
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.io import atomic_write_with, loads_json, read_lines

from . import stats
from .specs import ModelSpec, builtin_for, model_spec
from .store import Profile, ProfileMeta, build_profile

DEFAULT_DOMAIN = "all"  # the domain of tokens that carry none


@dataclass(frozen=True)
class RoutingTrace:
    """Complete tokens of a trace as arrays. T tokens, L logged MoE layers, K slots, E experts."""

    spec: ModelSpec
    layer_ids: tuple[int, ...]  # [L] the model's layer index of each logged MoE layer
    topk: np.ndarray  # [T, L, K] int64
    gates: np.ndarray  # [T, L, K] float64
    router_logits: np.ndarray | None  # [T, L, E] float32, or None when any kept line lacked them
    domain: np.ndarray  # [T] int64 index into domains
    domains: tuple[str, ...]
    counts: dict = field(default_factory=dict)  # lines read, skipped by type, tokens kept / dropped, ...
    files: tuple[str, ...] = ()
    sha256: str = ""  # over the files' bytes, in order
    meta_models: tuple[str, ...] = ()  # models named by meta lines


def _open_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) of a .jsonl or .jsonl.gz file, or of stdin for "-" (edgemoe.io.read_lines:
    regular files only, size caps, damaged gzip streams); errors name the file and line."""
    return read_lines(path, "trace file")


# What a trace line's numbers may be: exactly what the profile it becomes can store and `plan` accepts
# (edgemoe.profile.store.validate_values). Gates are stored as float32 and must be >= 0 (1e4 leaves room for
# scaled routers such as DeepSeek-V2's routed_scaling_factor 16); router logits are stored as float16, whose
# largest finite value is 65504; token positions become int64 sort keys.
GATE_RANGE = (0.0, 1e4)
LOGIT_RANGE = (-6e4, 6e4)
MAX_TOKEN_IDX = 2**62


def _int(obj: dict, key: str, where: str, lo: int = 0, hi: int = MAX_TOKEN_IDX) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise EdgeMoEError(f"{where}: field {key!r} must be an integer >= {lo} and <= {hi}, got {str(v)[:40]}")
    return v


def _numbers(obj: dict, key: str, where: str, length: int,
             bounds: tuple[float, float] = (-math.inf, math.inf)) -> list[float]:
    v = obj.get(key)
    if not isinstance(v, list) or len(v) != length:
        got = f"a list of {len(v)}" if isinstance(v, list) else repr(v)[:40]
        raise EdgeMoEError(f"{where}: field {key!r} must be a list of {length} numbers, got {got}")
    lo, hi = bounds
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise EdgeMoEError(f"{where}: field {key!r} must hold finite numbers, got {str(x)[:40]}")
        if not lo <= x <= hi:
            raise EdgeMoEError(f"{where}: field {key!r} holds {x!r}, outside [{lo:g}, {hi:g}]")
    return v


def read_trace(paths: Sequence[str | Path], spec: ModelSpec | str | None = None) -> RoutingTrace:
    """Parse trace files into complete tokens. `spec`: a ModelSpec, a spec name/path, or None to take the
    model named by a `meta` line (it must be a built-in). Raises EdgeMoEError naming file:line and field."""
    if not paths:
        raise EdgeMoEError("--trace: give at least one trace file")
    if isinstance(spec, str):
        spec = model_spec(spec)
    files = [Path(p) for p in paths]
    digest = hashlib.sha256()
    meta_models: list[str] = []
    skipped: dict[str, int] = {}
    token_of: dict[tuple[str, int], int] = {}  # (req_id, token_idx) -> token number (first appearance)
    tok_req: list[int] = []  # request number of each token (first appearance of its req_id)
    tok_pos: list[int] = []
    tok_domain: list[str | None] = []
    req_of: dict[str, int] = {}
    seen: dict[tuple[int, int], str] = {}  # (token, layer) -> "file:line" of its first line
    rows_tok, rows_layer, rows_ids, rows_w, rows_logits = [], [], [], [], []
    lines_read = 0
    for path in files:
        for lineno, text in _open_lines(path):
            digest.update(text.encode())
            lines_read += 1
            where = f"{path}:{lineno}"
            if not text.strip():
                continue
            obj = loads_json(text, where, line_numbers=False)
            if not isinstance(obj, dict):
                raise EdgeMoEError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
            kind = obj.get("type", "route")
            if kind != "route":
                skipped[str(kind)] = skipped.get(str(kind), 0) + 1
                if kind == "meta" and isinstance(obj.get("model"), str):
                    meta_models.append(obj["model"])
                continue
            if spec is None:
                name = next((builtin_for(m) for m in meta_models if builtin_for(m)), None)
                if name is None:
                    raise EdgeMoEError(f"{where}: no --model-spec given and no earlier meta line names a built-in model "
                                       f"(meta models: {meta_models or 'none'}); pass --model-spec")
                spec = model_spec(name)
            req = obj.get("req_id")
            if isinstance(req, bool) or not isinstance(req, str | int):
                raise EdgeMoEError(f"{where}: field 'req_id' must be a string, got {req!r}")
            req = str(req)
            pos = _int(obj, "token_idx", where)
            layer = _int(obj, "layer", where)
            if layer not in spec.moe_layer_ids:
                raise EdgeMoEError(f"{where}: field 'layer' is {layer}, not a MoE layer of {spec.name}; "
                                   f"its MoE layers are {_ranges(spec.moe_layer_ids)}")
            ids = _numbers(obj, "topk_ids", where, spec.top_k)
            if any(not isinstance(e, int) or not 0 <= e < spec.num_experts for e in ids):
                raise EdgeMoEError(f"{where}: field 'topk_ids' must hold expert ids in [0, {spec.num_experts}), got {ids}")
            if len(set(ids)) != len(ids):
                raise EdgeMoEError(f"{where}: field 'topk_ids' repeats an expert: {ids}")
            weights = _numbers(obj, "topk_weights", where, spec.top_k, GATE_RANGE)
            logits = None
            if obj.get("router_logits") is not None:
                logits = _numbers(obj, "router_logits", where, spec.num_experts, LOGIT_RANGE)
            domain = obj.get("domain")
            if domain is not None and (not isinstance(domain, str) or not domain):
                raise EdgeMoEError(f"{where}: field 'domain' must be a non-empty string, got {domain!r}")
            key = (req, pos)
            tok = token_of.get(key)
            if tok is None:
                tok = token_of[key] = len(tok_req)
                tok_req.append(req_of.setdefault(req, len(req_of)))
                tok_pos.append(pos)
                tok_domain.append(domain)
            elif domain is not None and tok_domain[tok] is not None and domain != tok_domain[tok]:
                raise EdgeMoEError(f"{where}: field 'domain' is {domain!r} but earlier lines of token "
                                   f"(req_id {req!r}, token_idx {pos}) say {tok_domain[tok]!r}")
            elif tok_domain[tok] is None:
                tok_domain[tok] = domain
            first = seen.get((tok, layer))
            if first is not None:
                raise EdgeMoEError(f"{where}: (req_id {req!r}, token_idx {pos}, layer {layer}) repeats line {first}")
            seen[(tok, layer)] = where
            rows_tok.append(tok)
            rows_layer.append(layer)
            rows_ids.append(ids)
            rows_w.append(weights)
            rows_logits.append(logits)
    if not rows_tok:
        raise EdgeMoEError(f"{', '.join(map(str, files))}: no route lines (skipped by type: {skipped or 'none'})")
    return _assemble(spec, files, digest.hexdigest(), meta_models, skipped, lines_read, tok_req, tok_pos, tok_domain,
                     rows_tok, rows_layer, rows_ids, rows_w, rows_logits)


def _assemble(spec, files, sha, meta_models, skipped, lines_read, tok_req, tok_pos, tok_domain, rows_tok, rows_layer,
              rows_ids, rows_w, rows_logits) -> RoutingTrace:
    """Rows -> [T, L, K] arrays of the complete tokens, ordered by request (first appearance) then token_idx."""
    layer_ids = tuple(sorted(set(rows_layer)))
    L, K, E = len(layer_ids), spec.top_k, spec.num_experts
    n_tok = len(tok_req)
    lpos = np.searchsorted(np.array(layer_ids), np.array(rows_layer))
    rt = np.array(rows_tok)
    have = np.zeros((n_tok, L), dtype=bool)
    have[rt, lpos] = True
    complete = have.all(axis=1)
    order = np.lexsort((np.array(tok_pos), np.array(tok_req)))  # request first, then position
    keep = order[complete[order]]
    new_id = np.full(n_tok, -1, dtype=np.int64)
    new_id[keep] = np.arange(keep.size)
    T = keep.size
    if T == 0:
        raise EdgeMoEError(f"{', '.join(map(str, files))}: no token has all {L} logged layers {_ranges(layer_ids)}")
    row_keep = complete[rt]
    r_new, r_l = new_id[rt[row_keep]], lpos[row_keep]
    topk = np.zeros((T, L, K), dtype=np.int64)
    gates = np.zeros((T, L, K), dtype=np.float64)
    topk[r_new, r_l] = np.array(rows_ids, dtype=np.int64)[row_keep]
    gates[r_new, r_l] = np.array(rows_w, dtype=np.float64)[row_keep]
    kept_logits = [x for x, k in zip(rows_logits, row_keep, strict=True) if k]
    with_logits = sum(x is not None for x in kept_logits)
    logits = None
    if with_logits == len(kept_logits):
        logits = np.zeros((T, L, E), dtype=np.float32)
        logits[r_new, r_l] = np.array(kept_logits, dtype=np.float32)
    names = [d if d is not None else DEFAULT_DOMAIN for d in tok_domain]
    domains = tuple(sorted(set(names[t] for t in keep)))
    index = {d: i for i, d in enumerate(domains)}
    domain = np.array([index[names[t]] for t in keep], dtype=np.int64)
    counts = {
        "lines": lines_read, "route_lines": len(rows_tok), "skipped_by_type": skipped, "requests": len(set(tok_req)),
        "tokens_seen": n_tok, "tokens_kept": int(T), "tokens_dropped_incomplete": int(n_tok - T),
        "route_lines_dropped": int((~row_keep).sum()), "route_lines_with_router_logits": int(with_logits),
        "logged_layers": list(layer_ids), "model_moe_layers": len(spec.moe_layer_ids),
    }
    return RoutingTrace(spec=spec, layer_ids=layer_ids, topk=topk, gates=gates, router_logits=logits, domain=domain,
                        domains=domains, counts=counts, files=tuple(map(str, files)), sha256=sha,
                        meta_models=tuple(dict.fromkeys(meta_models)))


def routing_profile(spec: ModelSpec, topk: np.ndarray, gates: np.ndarray, domain: np.ndarray, domains: Sequence[str],
                    router_logits: np.ndarray | None = None, layer_ids: Sequence[int] | None = None, model: str = "",
                    data: str = "", weights_hash: str = "", source: dict | None = None) -> Profile:
    """An ordinary Profile from routing arrays without weights (a trace, or a calibrated synthetic routing).

    topk, gates: [T, L, K]; domain: [T] into `domains`; router_logits: [T, L, E] or None (then similarity
    from co-selection and gates, stats.coselection_similarity). Substitution error cannot be measured without
    weights: it is estimated as 1 - similarity (clipped to [0, 2], zero diagonal) and the meta says so.
    """
    T, L, K = topk.shape
    E = spec.num_experts
    layer_ids = tuple(layer_ids) if layer_ids is not None else spec.moe_layer_ids[:L]
    if router_logits is not None:
        sim = stats.router_similarity(router_logits)
        similarity, logits = "router-logits", router_logits
    else:
        sim = stats.coselection_similarity(topk, gates, E)
        similarity, logits = "co-selection", np.zeros((0, L, E), dtype=np.float16)
    subst = np.clip(1.0 - sim, 0.0, 2.0)
    subst[:, np.arange(E), np.arange(E)] = 0.0
    meta = ProfileMeta(
        model=model or spec.hf_id or spec.name, family=spec.family, weights_hash=weights_hash or "none (no weights)",
        num_layers=L, num_experts=E, top_k=K, hidden_size=spec.hidden_size, hidden_bytes=spec.hidden_bytes,
        wire_dtype=spec.wire_dtype, moe_layer_ids=list(layer_ids), domains=list(domains), data=data, num_tokens=int(T),
        versions={"python": platform.python_version(), "numpy": np.__version__}, similarity=similarity,
        subst_err_source="estimated: 1 - similarity (no weights)", source=dict(source or {}, model_spec=spec.name),
    )
    return build_profile(meta, logits, topk, gates, domain, subst, spec.expert_bytes(L), spec.expert_flops(L), sim=sim)


def trace_profile(paths: Sequence[str | Path], spec: ModelSpec | str | None = None) -> tuple[Profile, RoutingTrace]:
    """Read trace files (read_trace) and build their profile; returns (profile, the parsed trace)."""
    tr = read_trace(paths, spec)
    model = tr.meta_models[0] if tr.meta_models else (tr.spec.hf_id or tr.spec.name)
    source = {"kind": "trace", "files": [Path(f).name for f in tr.files], "sha256": tr.sha256, **tr.counts}
    prof = routing_profile(tr.spec, tr.topk, tr.gates, tr.domain, tr.domains, tr.router_logits, tr.layer_ids,
                           model=model, data="trace: " + ", ".join(Path(f).name for f in tr.files),
                           weights_hash=f"none (trace sha256 {tr.sha256[:16]})", source=source)
    return prof, tr


def write_trace(path: str | Path, topk: np.ndarray, gates: np.ndarray, layer_ids: Sequence[int],
                req_ids: Sequence[str], token_idx: np.ndarray, domain: Sequence[str] | None = None,
                router_logits: np.ndarray | None = None, model: str | None = None, decimals: int = 4) -> Path:
    """Write routing arrays as a trace file (gzip when `path` ends in .gz), atomically.

    topk, gates: [T, L, K]; req_ids, token_idx, domain: [T]; router_logits: [T, L, E] or None. One line per
    token and layer, tokens in order, a meta line first when `model` is given.
    """
    path = Path(path)
    T, L, _ = topk.shape

    def lines() -> Iterator[str]:
        if model:
            yield json.dumps({"type": "meta", "model": model}) + "\n"
        for t in range(T):
            for j in range(L):
                d = {"type": "route", "req_id": str(req_ids[t]), "token_idx": int(token_idx[t]), "layer": int(layer_ids[j]),
                     "topk_ids": [int(e) for e in topk[t, j]],
                     "topk_weights": [round(float(w), decimals) for w in gates[t, j]]}
                if router_logits is not None:
                    d["router_logits"] = [round(float(x), decimals) for x in router_logits[t, j]]
                if domain is not None:
                    d["domain"] = str(domain[t])
                yield json.dumps(d, separators=(",", ":")) + "\n"

    def write(tmp: Path) -> None:
        if path.suffix == ".gz":
            # mtime=0: the same routing gives the same bytes (reproducible example files)
            with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
                for line in lines():
                    gz.write(line.encode())
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(lines())

    return atomic_write_with(path, write)


def _ranges(ids: Sequence[int]) -> str:
    """'0-31' / '1, 3, 5' style listing of layer ids."""
    ids = list(ids)
    if ids and ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))
