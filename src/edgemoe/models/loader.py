"""Load an HF MoE checkpoint (hub id, local folder, or a packaged name) into its family adapter."""

from __future__ import annotations

from pathlib import Path

import torch

from edgemoe.errors import EdgeMoEError

from .base import MoEAdapter
from .deepseek import DeepseekV3Adapter
from .mixtral import MixtralAdapter
from .qwen_moe import OlmoeAdapter, Qwen2MoeAdapter, Qwen3MoeAdapter
from .switch import SwitchAdapter

ADAPTERS: dict[str, type[MoEAdapter]] = {
    t: cls
    for cls in (MixtralAdapter, Qwen2MoeAdapter, Qwen3MoeAdapter, OlmoeAdapter, DeepseekV3Adapter, SwitchAdapter)
    for t in cls.model_types
}
DEFAULT_MODEL = "default"
# Packaged models: name -> (folder under edgemoe/assets, the command that rebuilds it).
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("default_model", "edgemoe train"),
    "default-upcycled": ("default_upcycled_model", "edgemoe train --upcycle"),
    # The ladder of expert distinctness (edgemoe.models.derive): both start from default-upcycled.
    "upcycled-diverged": ("upcycled_diverged_model", "edgemoe train --recipe upcycled-diverged"),
    "finegrained-shared": ("finegrained_shared_model", "edgemoe train --recipe finegrained-shared"),
}


def default_model_path(name: str = DEFAULT_MODEL) -> Path:
    """The folder of packaged model `name` (a key of PACKAGED_MODELS: 'default', 'default-upcycled', ...)."""
    return Path(__file__).resolve().parent.parent / "assets" / PACKAGED_MODELS[name][0]


def resolve_model_path(spec: str) -> str:
    """A packaged name (PACKAGED_MODELS) -> its folder; an existing folder -> itself; else a hub id."""
    if spec in PACKAGED_MODELS:
        path = default_model_path(spec)
        if not (path / "config.json").is_file():
            raise EdgeMoEError(f"the packaged model {spec!r} is missing at {path} "
                               f"(run `{PACKAGED_MODELS[spec][1]}` to rebuild it)")
        return str(path)
    path = Path(spec)
    if path.exists():
        if not (path / "config.json").is_file():
            raise EdgeMoEError(f"model folder {spec!r} has no config.json (expected an HF save_pretrained folder)")
        return str(path)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise EdgeMoEError(f"model path {spec!r} does not exist (expected an HF model folder or a hub id 'org/name')")
    return spec


WEIGHT_FILES = ("*.safetensors", "*.bin")  # what HF reads a checkpoint's weights from (and their shard indexes' shards)


def checkpoint_digest(spec: str, dtype: torch.dtype) -> str:
    """sha256 naming the weights a deployment serves: model `spec`'s config.json and weight files (`WEIGHT_FILES`),
    and the dtype they are computed in. It is the sha256 of the dtype's name and, for each file in name order, its
    name and its own sha256.

    Read from the files, without building the model: a process that only has to check which weights its servers
    run (the Ray front of `serve --dial`) never holds them. The files are hashed side by side in threads (hashlib
    releases the GIL), so a sharded checkpoint is read at the disk's pace. A hub id is looked up in the local hub
    cache only. Raises EdgeMoEError when the checkpoint cannot be found or read."""
    import hashlib
    import os
    from concurrent.futures import ThreadPoolExecutor

    path = Path(resolve_model_path(spec))
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(str(spec), local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - not cached, or no hub client: one clear line
            raise EdgeMoEError(f"model {spec!r}: no local copy of its files to name its weights by ({exc})") from None
    files = sorted({f for pattern in WEIGHT_FILES for f in path.glob(pattern) if f.is_file()}, key=lambda f: f.name)
    if not files:
        raise EdgeMoEError(f"model {spec!r}: no weight files ({', '.join(WEIGHT_FILES)}) in {path}")
    files = [path / "config.json", *files]

    def file_sha(f: Path) -> bytes:
        try:
            with open(f, "rb") as stream:
                return hashlib.file_digest(stream, "sha256").digest()
        except OSError as exc:
            raise EdgeMoEError(f"model {spec!r}: cannot read {f} ({exc})") from None

    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1)) as pool:
        shas = list(pool.map(file_sha, files))
    h = hashlib.sha256(str(dtype).encode())
    for f, sha in zip(files, shas, strict=True):
        h.update(b"\0" + f.name.encode() + b"\0" + sha)
    return h.hexdigest()


def adapter_for(model: torch.nn.Module, source: str = "") -> MoEAdapter:
    """Wrap an already-built HF model in its family adapter."""
    model_type = getattr(model.config, "model_type", None)
    cls = ADAPTERS.get(model_type)
    if cls is None:
        raise EdgeMoEError(
            f"{source or 'model'}: model_type {model_type!r} is not a supported MoE family; "
            f"expected one of {sorted(ADAPTERS)}"
        )
    adapter = cls(model, source=source)
    if isinstance(adapter, SwitchAdapter):
        adapter.disable_capacity()
    return adapter


def load_moe(spec: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32) -> MoEAdapter:
    """Load model `spec` (hub id, folder, 'default' or 'default-upcycled') in `dtype` and wrap it in its family adapter.

    Raises EdgeMoEError for a missing path, an unknown or non-MoE architecture, or an unreachable hub id.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    path = resolve_model_path(spec)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as exc:
        raise EdgeMoEError(f"model {spec!r}: cannot read its config ({exc}); expected an HF folder or reachable hub id") from exc
    except ValueError as exc:
        raise EdgeMoEError(f"model {spec!r}: unrecognised config ({exc})") from exc
    if config.model_type not in ADAPTERS:
        raise EdgeMoEError(
            f"model {spec!r}: model_type {config.model_type!r} is not a supported MoE family; "
            f"expected one of {sorted(ADAPTERS)}"
        )
    auto = AutoModelForSeq2SeqLM if config.model_type == "switch_transformers" else AutoModelForCausalLM
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    try:
        model = auto.from_pretrained(path, dtype=dtype)
    except Exception as exc:  # a damaged weights file: SafetensorError, OSError or a shape mismatch
        if type(exc).__name__ not in ("SafetensorError", "OSError", "HeaderTooLarge") and "safetensors" not in str(exc):
            raise
        raise EdgeMoEError(f"model {spec!r}: cannot read its weights in {path} ({type(exc).__name__}: {exc}); "
                           "re-download or re-save the model") from None
    model.eval()
    adapter = adapter_for(model, source=spec)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    # Loading casts the parameters (and the config) to `dtype`; servers store what the checkpoint holds.
    adapter.checkpoint_dtype = stored if isinstance(stored, torch.dtype) else None
    return adapter


def load_tokenizer(spec: str = DEFAULT_MODEL):
    """The tokenizer saved with model `spec`."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(spec))
