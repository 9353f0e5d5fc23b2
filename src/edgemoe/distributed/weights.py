"""Read single experts out of a safetensors checkpoint by key, without loading the rest of the model.

A server hosts the experts its placement row names, and only those: `ExpertWeights.load(path, pairs)`
opens the checkpoint with `safetensors.safe_open` and reads each (layer, expert) by key. Two layouts
are understood (both seen in practice):

- per-expert keys, as `save_pretrained` writes Mixtral-format checkpoints:
  `model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate [I, H], up [I, H], down [H, I]),
  or `...mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` (Qwen-MoE, OLMoE, DeepSeek);
- fused keys, as transformers 5 holds them in memory: `...experts.gate_up_proj [E, 2I, H]` and
  `...experts.down_proj [E, H, I]`; one expert is the slice `[e]`, read with `get_slice` so the other
  experts' bytes are never read.

MoE layer l is the l-th decoder layer (in index order) that has routed-expert keys, the same
numbering as `MoEAdapter`. An expert computes `down(act(gate(x)) * up(x))` (the gated MLP of every
supported decoder family; Switch Transformers' encoder-decoder layout is not served).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from edgemoe.errors import EdgeMoEError
from edgemoe.io import read_json

_PER_EXPERT = re.compile(r"^(?P<prefix>.*?layers\.(?P<layer>\d+)\.(?:block_sparse_moe|mlp))\.experts\.(?P<e>\d+)\."
                         r"(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(?P<prefix>.*?layers\.(?P<layer>\d+)\.(?:block_sparse_moe|mlp))\.experts\."
                    r"(?P<part>gate_up_proj|down_proj)(?:\.weight)?$")
_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_ACT = {"silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
        "relu": torch.nn.functional.relu}


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """{tensor key: safetensors file} of an HF folder (single file or sharded with an index)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "checkpoint index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise EdgeMoEError(f"{index}: weight_map must map tensor names to safetensors file names")
        return {k: path / v for k, v in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise EdgeMoEError(f"{path}: no model.safetensors or model.safetensors.index.json (expected a "
                           "save_pretrained folder with safetensors weights)")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def checkpoint_hidden_size(path: str | Path) -> int:
    """The model's hidden size from its config.json (the width of every hidden state on the wire)."""
    config = read_json(Path(path) / "config.json", "model config")
    if not isinstance(config, dict):
        raise EdgeMoEError(f"{path}/config.json: a model config is a JSON object")
    size = config.get("hidden_size") or config.get("d_model")
    if not size:
        raise EdgeMoEError(f"{path}/config.json has no hidden_size")
    return int(size)


def dense_cost_of_checkpoint(path: str | Path):
    """The backbone's DenseCost (edgemoe.runtime.dense) counted on the checkpoint's tensor headers, without
    loading it: every tensor that is not a routed expert's, less the input embedding when an LM head of its
    own exists (the embedding is then a lookup); the same rule as `dense_cost_of_model`."""
    from safetensors import safe_open

    from edgemoe.runtime.dense import DenseCost

    files = checkpoint_files(path)
    keys = [k for k in files if not (_PER_EXPERT.match(k) or _FUSED.match(k))]
    if any(k.endswith("lm_head.weight") for k in keys):
        keys = [k for k in keys if "embed_tokens" not in k]
    params = nbytes = 0
    for file in sorted(set(files[k] for k in keys)):
        with safe_open(str(file), "pt") as f:
            for k in (k for k in keys if files[k] == file):
                t = f.get_slice(k)
                n = 1
                for d in t.get_shape():
                    n *= int(d)
                params += n
                nbytes += n * _DTYPE_BYTES.get(t.get_dtype(), 4)
    return DenseCost(flops_per_token=2.0 * params, bytes=float(nbytes), source="model")


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1}


@dataclass(frozen=True)
class ExpertKey:
    """Where one expert's three matrices live in the checkpoint."""

    gate: tuple[str, int | None]  # (key, row slice index into a fused tensor or None)
    up: tuple[str, int | None]
    down: tuple[str, int | None]
    fused_gate_up: bool  # gate and up are halves of one [2I, H] slice


@dataclass(frozen=True)
class CheckpointIndex:
    """Where every routed expert lives in a checkpoint."""

    decoder_layers: tuple[int, ...]  # [L] decoder layer id of each MoE layer
    per_expert: dict  # (moe layer, expert) -> ExpertKey
    fused: dict  # moe layer -> {"gate_up_proj": key, "down_proj": key}


def expert_index(keys) -> CheckpointIndex:
    """Index the routed experts among checkpoint `keys` (MoE layers numbered in decoder order)."""
    parts: dict[tuple[int, int], dict[str, tuple[str, int | None]]] = defaultdict(dict)
    fused: dict[int, dict[str, str]] = defaultdict(dict)
    for k in keys:
        m = _PER_EXPERT.match(k)
        if m:
            parts[(int(m["layer"]), int(m["e"]))][_PART[m["part"]]] = (k, None)
            continue
        m = _FUSED.match(k)
        if m:
            fused[int(m["layer"])][m["part"]] = k
    layers = sorted({layer for layer, _ in parts} | set(fused))
    if not layers:
        raise EdgeMoEError("checkpoint has no routed-expert weights (expected keys like "
                           "'model.layers.0.block_sparse_moe.experts.0.w1.weight' or '...experts.gate_up_proj')")
    moe_of = {layer: i for i, layer in enumerate(layers)}
    per_expert = {}
    for (layer, e), p in parts.items():
        if set(p) != {"gate", "up", "down"}:
            raise EdgeMoEError(f"checkpoint layer {layer} expert {e}: has {sorted(p)}, expected gate, up and down")
        per_expert[(moe_of[layer], e)] = ExpertKey(p["gate"], p["up"], p["down"], False)
    return CheckpointIndex(tuple(layers), per_expert, {moe_of[layer]: f for layer, f in fused.items()})


class ExpertWeights:
    """The experts one server hosts, read by key; `forward(layer, expert, hidden)` runs one of them."""

    def __init__(self, tensors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]], act: str):
        if act not in _ACT:
            raise EdgeMoEError(f"hidden_act {act!r} is not served; expected one of {sorted(_ACT)}")
        self.tensors = tensors  # (layer, expert) -> (gate_up [2I, H], down [H, I])
        self.act = _ACT[act]

    @classmethod
    def load(cls, path: str | Path, pairs, dtype: torch.dtype = torch.float32, device="cpu") -> ExpertWeights:
        """Read experts `pairs` [(moe layer, expert), ...] of the checkpoint at `path` in `dtype` onto `device`."""
        from safetensors import safe_open

        path = Path(path)
        files = checkpoint_files(path)
        index = expert_index(files)
        config = read_json(path / "config.json", "model config")
        pairs = sorted({(int(a), int(b)) for a, b in pairs})
        handles: dict[Path, object] = {}
        tensors = {}
        try:
            def read(key: str, row: int | None) -> torch.Tensor:
                f = handles.setdefault(files[key], safe_open(str(files[key]), "pt"))
                return (f.get_tensor(key) if row is None else f.get_slice(key)[row]).to(device, dtype).contiguous()

            for layer, e in pairs:
                if (layer, e) in index.per_expert:
                    k = index.per_expert[(layer, e)]
                    gate_up = torch.cat([read(*k.gate), read(*k.up)], dim=0)
                    down = read(*k.down)
                elif {"gate_up_proj", "down_proj"} <= set(index.fused.get(layer, {})):
                    f = index.fused[layer]
                    gate_up, down = read(f["gate_up_proj"], e), read(f["down_proj"], e)
                else:
                    raise EdgeMoEError(f"{path}: no weights for MoE layer {layer} expert {e}")
                tensors[(layer, e)] = (gate_up, down)
        finally:
            handles.clear()
        return cls(tensors, str(config.get("hidden_act", "silu")))

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return sorted(self.tensors)

    def nbytes(self) -> int:
        """Bytes of expert tensors held."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tensors.values())

    @torch.no_grad()
    def forward(self, layer: int, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> expert output [R, H] (gate weight 1)."""
        w = self.tensors.get((layer, expert))
        if w is None:
            raise EdgeMoEError(f"expert (layer {layer}, expert {expert}) is not hosted here")
        gate_up, down = w
        gate, up = torch.nn.functional.linear(hidden.to(gate_up.dtype), gate_up).chunk(2, dim=-1)
        return torch.nn.functional.linear(self.act(gate) * up, down).to(hidden.dtype)
