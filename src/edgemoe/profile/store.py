"""The routing profile: what the planners and runtime policies know about a model's routing.

Pure numpy. A profile is saved as a folder holding `arrays.safetensors` (numpy arrays, no pickle) and
`meta.json` (model, weights hash, data, token count, versions), written atomically.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError
from edgemoe.io import atomic_write_dir

from . import stats

SCHEMA = "edgemoe.profile/1"


@dataclass(frozen=True)
class ProfileMeta:
    """Facts that identify what a profile was measured on."""

    model: str  # hub id or folder the model was loaded from
    family: str  # adapter family name, e.g. "mixtral"
    weights_hash: str  # sha256 over the model's state dict (see edgemoe.models.base.weights_hash)
    num_layers: int  # L: MoE layers only
    num_experts: int  # E: routed experts per MoE layer
    top_k: int  # K
    hidden_size: int
    hidden_bytes: int  # one token's hidden state on the wire, one direction
    wire_dtype: str  # activation dtype assumed on the wire (sets hidden_bytes)
    moe_layer_ids: list[int]  # index of each MoE layer among the model's blocks
    domains: list[str]  # names of domain ids used in `domain`
    data: str = ""  # description of the calibration data
    num_tokens: int = 0
    versions: dict = field(default_factory=dict)
    schema: str = SCHEMA
    # How `sim` and `subst_err` were obtained. A profile built from a routing trace without router logits or
    # weights says so here (edgemoe.profile.trace): sim from co-selection, subst_err estimated as 1 - sim.
    similarity: str = "router-logits"  # "router-logits" | "co-selection"
    subst_err_source: str = "measured"  # "measured" | "estimated: 1 - similarity" | "synthetic"
    source: dict = field(default_factory=dict)  # where the routing came from (a trace: files, counts, drops)


@dataclass(frozen=True)
class Profile:
    """Routing statistics of one model on calibration text. Shapes as in ARCHITECTURE.md."""

    meta: ProfileMeta
    router_logits: np.ndarray  # [T, L, E] float16 ([0, L, E] when the routing came without logits)
    topk: np.ndarray  # [T, L, K] int16 expert ids
    gates: np.ndarray  # [T, L, K] float32 gate weights as the model applies them
    domain: np.ndarray  # [T] int16 domain id of each token
    freq: np.ndarray  # [L, E] mean activations per token (rows sum to K)
    freq_by_domain: np.ndarray  # [U, L, E]
    coact: np.ndarray  # [L, E, E] co-activation counts
    trans: np.ndarray  # [L-1, E, E] P(e' at l+1 | e at l)
    sim: np.ndarray  # [L, E, E] router-logit cosine similarity
    subst_err: np.ndarray  # [L, E, E] relative output error of running e' in place of e
    expert_bytes: np.ndarray  # [L, E] int64 storage of each expert
    expert_flops: np.ndarray  # [L, E] int64 FLOPs of one expert call for one token

    @property
    def L(self) -> int:
        return self.meta.num_layers

    @property
    def E(self) -> int:
        return self.meta.num_experts

    @property
    def K(self) -> int:
        return self.meta.top_k

    @property
    def hidden_bytes(self) -> int:
        return self.meta.hidden_bytes

    @property
    def num_tokens(self) -> int:
        return int(self.topk.shape[0])

    def save(self, path: str | Path) -> Path:
        """Write the profile folder atomically (arrays.safetensors + meta.json), after the checks
        `load_profile` applies: a profile edgemoe writes is always one `plan` accepts."""
        from safetensors.numpy import save_file

        validate_meta(self.meta, f"profile for {path}")
        validate_shapes(self, f"profile for {path}")
        validate_values(self, f"profile for {path}")
        arrays = {name: np.ascontiguousarray(getattr(self, name)) for name in ARRAY_FIELDS}

        def write(tmp: Path) -> None:
            save_file(arrays, str(tmp / "arrays.safetensors"))
            (tmp / "meta.json").write_text(json.dumps(asdict(self.meta), indent=2) + "\n")

        return atomic_write_dir(path, write, kind="profile", recognise=is_profile_folder)

    def check_matches(self, num_layers: int, num_experts: int, top_k: int, weights_hash: str | None = None) -> None:
        """Raise EdgeMoEError unless this profile was measured on a model of this shape (and weights)."""
        want = (num_layers, num_experts, top_k)
        have = (self.L, self.E, self.K)
        if want != have:
            raise EdgeMoEError(
                f"profile of {self.meta.model!r} has (L, E, K) = {have}, but the model has {want}; "
                "re-run `edgemoe profile` on this model"
            )
        if weights_hash is not None and weights_hash != self.meta.weights_hash:
            raise EdgeMoEError(
                f"profile weights_hash {self.meta.weights_hash[:12]}... does not match the model's "
                f"{weights_hash[:12]}...; re-run `edgemoe profile` on this model"
            )


PROFILE_FILES = frozenset({"meta.json", "arrays.safetensors"})


def is_profile_folder(path: Path) -> bool:
    """A profile folder written before output markers: only meta.json (our schema) and the arrays."""
    try:
        names = {p.name for p in Path(path).iterdir()}
        schema = json.loads((Path(path) / "meta.json").read_text(encoding="utf-8")).get("schema")
    except (OSError, ValueError, AttributeError):
        return False
    return names <= PROFILE_FILES and schema == SCHEMA


ARRAY_FIELDS = (
    "router_logits", "topk", "gates", "domain", "freq", "freq_by_domain", "coact", "trans", "sim",
    "subst_err", "expert_bytes", "expert_flops",
)


def load_profile(path: str | Path) -> Profile:
    """Read a profile folder written by `Profile.save`, checking schema, fields, shapes and values.

    Every problem is an EdgeMoEError naming the file and the field (see `validate_meta`, `validate_shapes`,
    `validate_values`), so a damaged or foreign profile never reaches a planner.
    """
    from safetensors.numpy import load_file

    path = Path(path)
    meta_path, arr_path = path / "meta.json", path / "arrays.safetensors"
    if not meta_path.is_file() or not arr_path.is_file():
        raise EdgeMoEError(f"{path}: not a profile folder (expected meta.json and arrays.safetensors)")
    from edgemoe.io import read_json

    meta_dict = read_json(meta_path, "profile meta.json")
    if not isinstance(meta_dict, dict) or meta_dict.get("schema") != SCHEMA:
        got = meta_dict.get("schema") if isinstance(meta_dict, dict) else type(meta_dict).__name__
        raise EdgeMoEError(f"{meta_path}: schema is {got!r}, expected {SCHEMA!r}")
    try:
        meta = ProfileMeta(**meta_dict)
    except TypeError as exc:
        raise EdgeMoEError(f"{meta_path}: unexpected or missing fields ({exc})") from None
    validate_meta(meta, str(meta_path))
    try:
        arrays = load_file(str(arr_path))
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) for damaged files
        raise EdgeMoEError(f"{arr_path}: not a readable safetensors file ({exc}); re-run `edgemoe profile`") from None
    missing = [n for n in ARRAY_FIELDS if n not in arrays]
    if missing:
        raise EdgeMoEError(f"{arr_path}: missing arrays {missing}")
    profile = Profile(meta=meta, **{n: arrays[n] for n in ARRAY_FIELDS})
    validate_shapes(profile, str(arr_path))
    validate_values(profile, str(arr_path))
    return profile


def validate_meta(meta: ProfileMeta, source: str = "profile") -> None:
    """Raise EdgeMoEError (naming `source` and the field) if meta.json's fields have the wrong type or range."""
    for name in ("num_layers", "num_experts", "top_k", "hidden_size", "hidden_bytes"):
        v = getattr(meta, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise EdgeMoEError(f"{source}: {name} is {v!r}, expected a positive integer")
    if meta.top_k > meta.num_experts:
        raise EdgeMoEError(f"{source}: top_k {meta.top_k} exceeds num_experts {meta.num_experts}")
    if not isinstance(meta.domains, list) or not meta.domains or not all(isinstance(d, str) for d in meta.domains):
        raise EdgeMoEError(f"{source}: domains is {meta.domains!r}, expected a non-empty list of names")
    if len(set(meta.domains)) != len(meta.domains):
        raise EdgeMoEError(f"{source}: domains {meta.domains} has a name twice")
    for name in ("model", "family", "weights_hash"):
        if not isinstance(getattr(meta, name), str):
            raise EdgeMoEError(f"{source}: {name} is {getattr(meta, name)!r}, expected a string")


def validate_shapes(p: Profile, source: str = "profile") -> None:
    """Raise EdgeMoEError if any array disagrees with (T, L, E, K, U) of the profile."""
    T, L, E, K, U = p.topk.shape[0] if p.topk.ndim else 0, p.L, p.E, p.K, len(p.meta.domains)
    expected = {
        "router_logits": (T, L, E), "topk": (T, L, K), "gates": (T, L, K), "domain": (T,),
        "freq": (L, E), "freq_by_domain": (U, L, E), "coact": (L, E, E), "trans": (max(L - 1, 0), E, E),
        "sim": (L, E, E), "subst_err": (L, E, E), "expert_bytes": (L, E), "expert_flops": (L, E),
    }
    if p.meta.similarity != "router-logits":
        expected["router_logits"] = (0, L, E)  # no logits were recorded; sim comes from co-selection
    for name, shape in expected.items():
        got = tuple(getattr(p, name).shape)
        if got != shape:
            raise EdgeMoEError(f"{source}: profile array {name!r} has shape {got}, expected {shape}")


def validate_values(p: Profile, source: str = "profile") -> None:
    """Raise EdgeMoEError if a profile array holds values no measurement can give: NaN/inf, expert or
    domain ids out of range, negative frequencies, errors or sizes. Names `source` and the array."""
    for name in ("router_logits", "gates", "freq", "freq_by_domain", "coact", "trans", "sim", "subst_err"):
        a = np.asarray(getattr(p, name))
        if not np.issubdtype(a.dtype, np.number):
            raise EdgeMoEError(f"{source}: profile array {name!r} has dtype {a.dtype}, expected numbers")
        bad = int(np.size(a) - np.isfinite(a).sum())
        if bad:
            raise EdgeMoEError(f"{source}: profile array {name!r} holds {bad} NaN or infinite values; re-run `edgemoe profile`")
    for name, hi in (("topk", p.E), ("domain", len(p.meta.domains))):
        a = np.asarray(getattr(p, name))
        if not np.issubdtype(a.dtype, np.integer):
            raise EdgeMoEError(f"{source}: profile array {name!r} has dtype {a.dtype}, expected integer ids")
        if a.size and (a.min() < 0 or a.max() >= hi):
            raise EdgeMoEError(f"{source}: profile array {name!r} has ids in [{a.min()}, {a.max()}], expected [0, {hi})")
    for name in ("gates", "freq", "freq_by_domain", "coact", "trans", "subst_err", "expert_flops"):
        a = np.asarray(getattr(p, name))
        if a.size and a.min() < 0:
            raise EdgeMoEError(f"{source}: profile array {name!r} has a negative value ({a.min()})")
    eb = np.asarray(p.expert_bytes)
    if not np.issubdtype(eb.dtype, np.integer) or (eb.size and eb.min() <= 0):
        raise EdgeMoEError(f"{source}: profile array 'expert_bytes' must hold positive integers")


def build_profile(
    meta: ProfileMeta,
    router_logits: np.ndarray,
    topk: np.ndarray,
    gates: np.ndarray,
    domain: np.ndarray,
    subst_err: np.ndarray,
    expert_bytes: np.ndarray,
    expert_flops: np.ndarray,
    sim: np.ndarray | None = None,
) -> Profile:
    """Derive freq, coact, trans and sim from a router sample and assemble a Profile.

    router_logits: [T, L, E] (or [0, L, E] with `sim` given, when no logits were recorded); topk, gates:
    [T, L, K]; domain: [T]; subst_err: [L, E, E]; expert_bytes, expert_flops: [L, E]; sim: [L, E, E]
    replaces the router-logit cosine.
    """
    E, U = meta.num_experts, len(meta.domains)
    topk = np.asarray(topk).astype(np.int16)
    domain = np.asarray(domain).astype(np.int16)
    profile = Profile(
        meta=meta,
        router_logits=np.asarray(router_logits).astype(np.float16),
        topk=topk,
        gates=np.asarray(gates).astype(np.float32),
        domain=domain,
        freq=stats.activation_frequency(topk, E),
        freq_by_domain=stats.frequency_by_domain(topk, domain, U, E),
        coact=stats.coactivation(topk, E),
        trans=stats.transitions(topk, E),
        sim=stats.router_similarity(router_logits) if sim is None else np.asarray(sim, dtype=np.float64),
        subst_err=np.asarray(subst_err, dtype=np.float64),
        expert_bytes=np.asarray(expert_bytes, dtype=np.int64),
        expert_flops=np.asarray(expert_flops, dtype=np.int64),
    )
    validate_shapes(profile)
    return profile


def synthetic_profile(
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    num_tokens: int = 2000,
    num_domains: int = 3,
    expert_bytes: int = 1_000_000,
    hidden_size: int = 512,
    seed: int = 0,
) -> Profile:
    """A random but structured profile for tests and planner benchmarks (no model needed).

    Router logits come from a low-rank model (experts share latent directions, so similarity structure
    exists, stronger with depth), domains shift the logits (per-domain preferences), and each layer's
    logits depend on the previous layer's (so transitions are informative). `subst_err` grows as
    similarity falls. Every expert costs `expert_bytes`, FLOPs are expert_bytes (2 x params at 2 bytes).
    """
    rng = np.random.default_rng(seed)
    L, E, K, T, U = num_layers, num_experts, top_k, num_tokens, num_domains
    rank = max(2, E // 4)
    domain = rng.integers(0, U, size=T)
    domain_shift = rng.normal(0, 1.5, size=(U, L, E))
    token_latent = rng.normal(size=(T, rank))
    logits = np.empty((T, L, E))
    for layer in range(L):
        # Deeper layers: experts' columns are closer to shared directions -> higher similarity.
        mix = 0.3 + 0.6 * layer / max(L - 1, 1)
        basis = rng.normal(size=(rank, E))
        shared = basis[:, rng.integers(0, rank, size=E) % E] if E > 0 else basis
        cols = (1 - mix) * basis + mix * shared
        logits[:, layer] = token_latent @ cols + domain_shift[domain, layer] + rng.normal(0, 0.5, size=(T, E))
        token_latent = 0.8 * token_latent + 0.2 * rng.normal(size=(T, rank))
    order = np.argsort(-logits, axis=2)[:, :, :K]
    sel = np.take_along_axis(logits, order, axis=2)
    gates = np.exp(sel - sel.max(axis=2, keepdims=True))
    gates /= gates.sum(axis=2, keepdims=True)
    sim = stats.router_similarity(logits)
    subst_err = np.clip(1.0 - sim, 0.0, 2.0) + rng.uniform(0, 0.05, size=sim.shape)
    subst_err[:, np.arange(E), np.arange(E)] = 0.0
    meta = ProfileMeta(
        model=f"synthetic(L={L},E={E},K={K},seed={seed})", family="synthetic", weights_hash=f"synthetic-{seed}",
        num_layers=L, num_experts=E, top_k=K, hidden_size=hidden_size, hidden_bytes=2 * hidden_size,
        wire_dtype="bfloat16", moe_layer_ids=list(range(L)), domains=[f"domain{u}" for u in range(U)],
        data="synthetic", num_tokens=T, versions={"python": platform.python_version(), "numpy": np.__version__},
    )
    return build_profile(
        meta, logits, order, gates, domain, subst_err,
        np.full((L, E), expert_bytes, dtype=np.int64), np.full((L, E), expert_bytes, dtype=np.int64),
    )
