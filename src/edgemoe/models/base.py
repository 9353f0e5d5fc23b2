"""One adapter over HF transformers MoE models: shape facts, routing, and expert-level interventions.

Every supported family's sparse block calls `experts(hidden [T, H], index, weights)` after its router
(transformers 5). The adapter hooks both: a forward hook on the router records its logits, and a
forward pre-hook on the experts module hands the routing, in canonical form `topk [T, K]` /
`gates [T, K]`, to a policy callback that may keep, replace or drop each routed expert. The HF code
still does all the arithmetic, so with no intervention the logits are the HF model's own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from edgemoe.errors import EdgeMoEError

GATE_MODES = ("keep", "router")


@dataclass
class LayerCall:
    """What a policy sees at one MoE layer for a batch of T tokens (flattened batch x sequence)."""

    layer: int  # MoE layer index in [0, L)
    hidden: torch.Tensor  # [T, H] the experts' input (after the block's norm)
    router_logits: torch.Tensor  # [T, E]
    topk: torch.Tensor  # [T, K] long: routed expert ids
    gates: torch.Tensor  # [T, K] float: gate weights as the model applies them


@dataclass
class Intervention:
    """A policy's answer for one layer. `experts[t, k]` runs in slot k of token t; -1 drops the slot.

    gate_mode for replaced slots: 'keep' gives the substitute the original expert's gate weight (the
    default, as in OrderMoE); 'router' gives it its own router score, renormalised like the family does.
    Dropped slots always renormalise the remaining gates to the original gate total. Zeroed slots (`zeroed`,
    experts -1 there) contribute nothing and the other gates stay as they are; with both in one row, the
    dropped mass goes to the slots that run, the zeroed mass is lost.
    """

    experts: torch.Tensor  # [T, K] long
    gate_mode: str = "keep"
    zeroed: torch.Tensor | None = None  # [T, K] bool: slots zeroed rather than dropped (experts must be -1 there)

    @classmethod
    def from_numpy(cls, experts: np.ndarray, zeroed: np.ndarray | None = None) -> Intervention:
        """A runtime decision's experts [T, K] (-1: not run) and zeroed mask [T, K] (or None) as an intervention."""
        return cls(torch.from_numpy(experts), zeroed=None if zeroed is None else torch.from_numpy(zeroed))


Policy = Callable[[LayerCall], "Intervention | None"]


def apply_intervention(adapter: MoEAdapter, call: LayerCall, iv: Intervention) -> tuple[torch.Tensor, torch.Tensor]:
    """New (topk [T, K], gates [T, K]) after `iv`; a dropped slot gets expert 0 with gate 0."""
    if iv.gate_mode not in GATE_MODES:
        raise EdgeMoEError(f"Intervention.gate_mode must be one of {GATE_MODES}, got {iv.gate_mode!r}")
    experts = iv.experts.to(call.topk.device, torch.long)
    if experts.shape != call.topk.shape:
        raise EdgeMoEError(f"Intervention.experts has shape {tuple(experts.shape)}, expected {tuple(call.topk.shape)}")
    if int(experts.max()) >= adapter.num_experts or int(experts.min()) < -1:
        raise EdgeMoEError(f"Intervention.experts ids must lie in [-1, {adapter.num_experts})")
    zeroed = None if iv.zeroed is None else iv.zeroed.to(call.topk.device, torch.bool)
    if zeroed is not None and (zeroed.shape != experts.shape or bool((zeroed & (experts >= 0)).any())):
        raise EdgeMoEError("Intervention.zeroed must be [T, K] and mark only slots whose expert is -1")
    dropped = experts < 0 if zeroed is None else (experts < 0) & ~zeroed
    gates = call.gates.clone()
    if iv.gate_mode == "router":
        scores = adapter.scores(call.layer, call.router_logits)  # [T, E]
        replaced = (experts != call.topk) & ~dropped
        own = scores.gather(1, experts.clamp(min=0)).to(gates.dtype)
        gates = torch.where(replaced, own, gates)
        if adapter.normalizes_topk:
            total = call.gates.sum(dim=1, keepdim=True)
            gates = gates / gates.sum(dim=1, keepdim=True).clamp_min(1e-20) * total
    if bool(dropped.any()):
        total = call.gates.sum(dim=1, keepdim=True)
        if zeroed is not None:
            total = total - call.gates.masked_fill(~zeroed, 0.0).sum(dim=1, keepdim=True)
            gates = gates.masked_fill(zeroed, 0.0)
        gates = gates.masked_fill(dropped, 0.0)
        kept = gates.sum(dim=1, keepdim=True)
        gates = torch.where(kept > 0, gates / kept.clamp_min(1e-20) * total, gates)
    if zeroed is not None:
        gates = gates.masked_fill(zeroed, 0.0)
    return experts.clamp(min=0), gates


class MoEAdapter:
    """Base adapter. Subclasses (one module per family) fill in the family's quirks.

    Exposes L (MoE layers), E, K, hidden size, per-expert bytes and FLOPs, which blocks are MoE, the
    routing function, and `intervene(policy)` / `record()` context managers over the HF forward.
    """

    family: str = ""
    model_types: tuple[str, ...] = ()
    router_attr: str = "gate"  # attribute of the sparse block holding the router module
    normalizes_topk: bool = True  # whether top-k gates are renormalised to sum to 1 (times a scale)

    def __init__(self, model: nn.Module, source: str = ""):
        self.model = model
        self.config = model.config
        self.source = source
        self.checkpoint_dtype: torch.dtype | None = None  # set by the loader: the dtype on disk
        self.blocks: list[nn.Module] = self._moe_blocks()
        if not self.blocks:
            raise EdgeMoEError(f"{source or 'model'}: no MoE layers found (is this a dense checkpoint?)")
        self.moe_layer_ids: list[int] = self._moe_layer_ids()
        self._policy: Policy | None = None
        self._recorders: list[Callable[[LayerCall], None]] = []
        self._last_logits: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._handles = []
        for i, block in enumerate(self.blocks):
            router = getattr(block, self.router_attr)
            self._handles.append(router.register_forward_hook(self._router_hook(i)))
            self._handles.append(block.experts.register_forward_pre_hook(self._experts_hook(i), with_kwargs=True))

    # ---- family quirks (override) -------------------------------------------------------------
    def _moe_blocks(self) -> list[nn.Module]:
        """Sparse blocks in execution order. Default: decoder layers' `.mlp` that have `.experts`."""
        layers = self.model.model.layers
        return [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]

    def _moe_layer_ids(self) -> list[int]:
        layers = self.model.model.layers
        return [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")]

    @property
    def num_experts(self) -> int:
        raise NotImplementedError

    @property
    def top_k(self) -> int:
        raise NotImplementedError

    def scores(self, layer: int, router_logits: torch.Tensor) -> torch.Tensor:
        """[T, E] router scores from logits (softmax by default)."""
        return torch.softmax(router_logits.float(), dim=-1)

    def route(self, layer: int, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's routing, exactly as the model computes it: logits [T, E] -> (topk [T, K], gates [T, K])."""
        probs = self.scores(layer, router_logits)
        gates, topk = torch.topk(probs, self.top_k, dim=-1)
        if self.normalizes_topk:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return topk, gates.to(router_logits.dtype)

    def _router_logits_from_output(self, output) -> torch.Tensor:
        """The router module's output -> logits [T, E]."""
        return output[0].reshape(-1, self.num_experts)

    def _to_canonical(self, index, weights) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts module's (index, weights) arguments -> (topk [T, K], gates [T, K])."""
        return index, weights

    def _from_canonical(self, topk, gates, index, weights):
        """Canonical (topk, gates) -> the experts module's argument format."""
        return topk.to(index.dtype), gates.to(weights.dtype)

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def hidden_size(self) -> int:
        return int(getattr(self.config, "hidden_size", None) or self.config.d_model)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the loaded parameters compute in."""
        return next(self.model.parameters()).dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        """The checkpoint's dtype (what a server stores), falling back to the loaded parameters'."""
        dt = self.checkpoint_dtype or getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
        if isinstance(dt, str):
            dt = getattr(torch, dt, None)
        return dt if isinstance(dt, torch.dtype) else self.compute_dtype

    def expert_params(self) -> np.ndarray:
        """[L, E] parameter count of each routed expert."""
        counts = [sum(p.numel() for p in block.experts.parameters()) // self.num_experts for block in self.blocks]
        return np.repeat(np.asarray(counts, dtype=np.int64)[:, None], self.num_experts, axis=1)

    def expert_bytes(self, dtype: torch.dtype | None = None) -> np.ndarray:
        """[L, E] bytes to store each expert in `dtype` (default: the checkpoint's dtype)."""
        itemsize = torch.empty((), dtype=dtype or self.storage_dtype).element_size()
        return self.expert_params() * itemsize

    def expert_flops(self) -> np.ndarray:
        """[L, E] FLOPs of one expert call for one token (2 per multiply-add, so 2 x params)."""
        return 2 * self.expert_params()

    def weights_hash(self) -> str:
        """sha256 over parameter names and bytes: identifies the weights a profile was measured on."""
        h = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # ---- hooks ---------------------------------------------------------------------------------
    def _router_hook(self, i: int):
        def hook(module, args, output):
            self._last_logits[i] = self._router_logits_from_output(output)

        return hook

    def _experts_hook(self, i: int):
        def hook(module, args, kwargs):
            if self._policy is None and not self._recorders:
                return None
            hidden, index, weights = _experts_args(args, kwargs)
            topk, gates = self._to_canonical(index, weights)
            call = LayerCall(i, hidden, self._last_logits[i], topk, gates)
            for rec in self._recorders:
                rec(call)
            iv = self._policy(call) if self._policy is not None else None
            if iv is None:
                return None
            new_topk, new_gates = apply_intervention(self, call, iv)
            new_index, new_weights = self._from_canonical(new_topk, new_gates, index, weights)
            return (hidden, new_index, new_weights), {}

        return hook

    @contextmanager
    def intervene(self, policy: Policy | None):
        """Within the block, every forward asks `policy` at each MoE layer what to run."""
        previous, self._policy = self._policy, policy
        try:
            yield self
        finally:
            self._policy = previous

    @contextmanager
    def record(self, fn: Callable[[LayerCall], None]):
        """Within the block, `fn` sees every MoE layer's LayerCall (before any intervention)."""
        self._recorders.append(fn)
        try:
            yield self
        finally:
            self._recorders.remove(fn)

    # ---- running -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S, V] next-token logits for input_ids [B, S]."""
        return self.model(input_ids=input_ids).logits

    @torch.no_grad()
    def router_logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The router of MoE layer `layer` on hidden [T, H] -> logits [T, E] (no hooks fire)."""
        router = getattr(self.blocks[layer], self.router_attr)
        return self._router_logits_from_output(router.forward(hidden))

    @torch.no_grad()
    def expert_output(self, layer: int, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """Run routed expert `expert` of MoE layer `layer` alone on hidden [T, H] (gate 1) -> [T, H]."""
        T = hidden.shape[0]
        topk = torch.full((T, self.top_k), expert, dtype=torch.long)
        gates = torch.zeros((T, self.top_k), dtype=hidden.dtype)
        gates[:, 0] = 1.0
        index, weights = self._experts_call_args(topk, gates)
        saved_policy, saved_rec = self._policy, self._recorders
        self._policy, self._recorders = None, []
        try:
            return self.blocks[layer].experts(hidden, index, weights)
        finally:
            self._policy, self._recorders = saved_policy, saved_rec

    def _experts_call_args(self, topk, gates):
        """Canonical -> experts-module arguments when no original call is at hand."""
        return topk, gates

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _experts_args(args, kwargs):
    """(hidden, index, weights) from an experts-module call, whatever names it used."""
    values = list(args) + [kwargs[k] for k in kwargs]
    if len(values) < 3:
        raise RuntimeError(f"unexpected experts call signature: {len(args)} args, kwargs {list(kwargs)}")
    return values[0], values[1], values[2]
