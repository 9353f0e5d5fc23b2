"""Model dimensions without weights: what a routing trace needs to become a profile (pure Python + numpy).

A `ModelSpec` holds the MoE shape of a model (MoE layers, experts, top-K, hidden size, expert width) and the
dtypes that set expert bytes and the hidden state on the wire. Built-in specs are written from the models'
published HF `config.json` files (numbers in docs/traces.md); `model_spec(path)` reads any supported HF
config instead. No torch, no transformers: planning from a trace needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgemoe.errors import EdgeMoEError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


@dataclass(frozen=True)
class ModelSpec:
    """MoE dimensions of one model. FLOPs per token of an expert call are 2 x its parameters."""

    name: str  # built-in name or the config path
    hf_id: str  # hub id the numbers come from ("" for a local config)
    family: str  # HF model_type
    moe_layer_ids: tuple[int, ...]  # index of each MoE layer among the model's blocks (L of them)
    num_experts: int  # E routed experts per MoE layer (shared experts are backbone, not counted)
    top_k: int  # K
    hidden_size: int
    expert_intermediate: int  # width of one routed expert's FFN
    expert_matrices: int  # 3 for SwiGLU experts (gate, up, down), 2 for ReLU experts (wi, wo)
    dtype: str = "bfloat16"  # storage dtype of expert weights (sets expert bytes)
    wire_dtype: str = "bfloat16"  # dtype of a hidden state on the wire (sets hidden bytes)

    @property
    def num_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def expert_params(self) -> int:
        return self.expert_matrices * self.hidden_size * self.expert_intermediate

    @property
    def hidden_bytes(self) -> int:
        """One token's hidden state, one direction."""
        return self.hidden_size * DTYPE_BYTES[self.wire_dtype]

    def expert_bytes(self, layers: int | None = None) -> np.ndarray:
        """[L, E] int64 storage of each expert (all experts of these families have one width)."""
        L = self.num_layers if layers is None else layers
        return np.full((L, self.num_experts), self.expert_params * DTYPE_BYTES[self.dtype], dtype=np.int64)

    def expert_flops(self, layers: int | None = None) -> np.ndarray:
        """[L, E] int64 FLOPs of one expert call for one token."""
        L = self.num_layers if layers is None else layers
        return np.full((L, self.num_experts), 2 * self.expert_params, dtype=np.int64)

    def describe(self) -> str:
        return (f"{self.name} ({self.family}): {self.num_layers} MoE layers x {self.num_experts} experts, top-{self.top_k}, "
                f"hidden {self.hidden_size}, expert {self.expert_matrices}x{self.hidden_size}x{self.expert_intermediate} "
                f"= {self.expert_params * DTYPE_BYTES[self.dtype] / 1e6:.1f} MB in {self.dtype}, "
                f"{self.hidden_bytes} B per hidden state ({self.wire_dtype})")


# The fields of each model's published config.json that matter here (hub id -> config subset). The specs are
# derived from these by the same code that reads a user's config.json, so both paths are one rule.
PUBLISHED_CONFIGS: dict[str, tuple[str, dict]] = {
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-v0.1", {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_local_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16"}),
    "qwen1.5-moe-a2.7b": ("Qwen/Qwen1.5-MoE-A2.7B", {
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_experts": 60,
        "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16"}),
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "torch_dtype": "bfloat16"}),
    "deepseek-v2-lite": ("deepseek-ai/DeepSeek-V2-Lite", {
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "torch_dtype": "bfloat16"}),
    "olmoe-1b-7b": ("allenai/OLMoE-1B-7B-0924", {
        "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
        "num_experts": 64, "num_experts_per_tok": 8}),  # published in float32; served (and counted) in bf16
    "switch-base-8": ("google/switch-base-8", {
        "model_type": "switch_transformers", "d_model": 768, "d_ff": 3072, "num_layers": 12, "num_decoder_layers": 12,
        "num_experts": 8, "encoder_sparse_step": 2, "decoder_sparse_step": 2}),  # published in float32
}

BUILTIN = tuple(PUBLISHED_CONFIGS)
SUPPORTED_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "switch_transformers")


def model_spec(spec: str, dtype: str | None = None, wire_dtype: str | None = None) -> ModelSpec:
    """A built-in name (see BUILTIN), a hub id of a built-in, or a path to an HF config.json (or its folder).

    dtype / wire_dtype override the storage and wire dtypes (default: the config's `torch_dtype` or `dtype`
    when it is a 16-bit type, else bfloat16, the usual serving dtype).
    """
    key = spec.lower()
    by_hub = {hub.lower(): name for name, (hub, _) in PUBLISHED_CONFIGS.items()}
    if key in PUBLISHED_CONFIGS or key in by_hub:
        name = key if key in PUBLISHED_CONFIGS else by_hub[key]
        hub, config = PUBLISHED_CONFIGS[name]
        return spec_from_config(config, name, hub, dtype, wire_dtype, source=f"built-in spec {name!r}")
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise EdgeMoEError(f"--model-spec {spec!r}: not a built-in spec {list(BUILTIN)} and no config.json at {path}")
    from edgemoe.io import read_json

    config = read_json(path, "model config")
    if not isinstance(config, dict):
        raise EdgeMoEError(f"{path}: a config.json holds a JSON object")
    return spec_from_config(config, str(path), "", dtype, wire_dtype, source=str(path))


def builtin_for(model_name: str) -> str | None:
    """The built-in spec whose hub id or name `model_name` is (case-insensitive), else None."""
    key = model_name.lower().rstrip("/")
    for name, (hub, _) in PUBLISHED_CONFIGS.items():
        if key in (name, hub.lower()) or key.endswith("/" + hub.lower().split("/")[1]):
            return name
    return None


def spec_from_config(config: dict, name: str, hf_id: str = "", dtype: str | None = None,
                     wire_dtype: str | None = None, source: str = "config") -> ModelSpec:
    """ModelSpec from the fields of an HF config dict (model types in SUPPORTED_TYPES)."""
    mtype = config.get("model_type")
    if mtype not in SUPPORTED_TYPES:
        raise EdgeMoEError(f"{source}: model_type {mtype!r} is not a supported MoE family; expected one of {list(SUPPORTED_TYPES)}")

    def need(field: str) -> int:
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EdgeMoEError(f"{source}: field {field!r} must be a positive integer, got {value!r}")
        return value

    if mtype == "switch_transformers":
        hidden, inter, matrices, K = need("d_model"), need("d_ff"), 2, 1
        E = need("num_experts")
        enc, dec = need("num_layers"), config.get("num_decoder_layers") or need("num_layers")
        layers = _switch_sparse(enc, config.get("encoder_sparse_step", 1)) + [
            enc + i for i in _switch_sparse(dec, config.get("decoder_sparse_step", 1))]
    else:
        hidden, n_layers, K, matrices = need("hidden_size"), need("num_hidden_layers"), need("num_experts_per_tok"), 3
        if mtype == "mixtral":
            E, inter = need("num_local_experts"), need("intermediate_size")
            layers = list(range(n_layers))
        elif mtype == "olmoe":
            E, inter = need("num_experts"), need("intermediate_size")
            layers = list(range(n_layers))
        elif mtype in ("qwen2_moe", "qwen3_moe"):
            E, inter = need("num_experts"), need("moe_intermediate_size")
            step, dense = config.get("decoder_sparse_step", 1) or 1, set(config.get("mlp_only_layers") or [])
            layers = [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
        else:  # deepseek_v2 / deepseek_v3
            E, inter = need("n_routed_experts"), need("moe_intermediate_size")
            first, freq = config.get("first_k_dense_replace", 0) or 0, config.get("moe_layer_freq", 1) or 1
            layers = [i for i in range(n_layers) if i >= first and i % freq == 0]
    if not layers:
        raise EdgeMoEError(f"{source}: this {mtype} config has no MoE layer")
    if not 1 <= K <= E:
        raise EdgeMoEError(f"{source}: top-k {K} must lie in [1, num_experts={E}]")
    cfg_dtype = config.get("torch_dtype") or config.get("dtype")
    default = cfg_dtype if cfg_dtype in ("bfloat16", "float16") else "bfloat16"
    dtype, wire_dtype = dtype or default, wire_dtype or dtype or default
    for label, value in (("dtype", dtype), ("wire_dtype", wire_dtype)):
        if value not in DTYPE_BYTES:
            raise EdgeMoEError(f"{source}: {label} {value!r} is not one of {sorted(DTYPE_BYTES)}")
    return ModelSpec(name=name, hf_id=hf_id, family=mtype, moe_layer_ids=tuple(layers), num_experts=E, top_k=K,
                     hidden_size=hidden, expert_intermediate=inter, expert_matrices=matrices, dtype=dtype,
                     wire_dtype=wire_dtype)


def _switch_sparse(num_blocks: int, step) -> list[int]:
    """Sparse block indices of one Switch stack: HF's rule `i % step == 1 or step == 1` (no MoE if step <= 0)."""
    step = int(step or 0)
    if step <= 0:
        return []
    return [i for i in range(num_blocks) if step == 1 or i % step == 1]
