"""Sparse upcycling: train a dense model, copy its FFN into every expert, add a fresh router, train the MoE.

The result (`default-upcycled`) has the shape of the default model (Mixtral format, 4 MoE layers x 16
experts, top-2, same tokenizer) but experts that start as copies of one FFN, the kind of redundancy
Qwen1.5-MoE's and Mixtral's experts show and OrderMoE's substitution relies on.

The dense model is a Mixtral with a single expert and top-1: its router has one output, so the gate is
always 1 and the block is exactly a SwiGLU FFN. Upcycling it preserves the function: Mixtral renormalises
the top-K gates to sum to 1, so K copies of the same FFN return that FFN's output whatever the router picks.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError

from .train import (
    TrainConfig,
    build_model,
    evaluate_heldout,
    guard_deadline,
    load_training_data,
    recipe_environment,
    save_model_folder,
    train_steps,
)


@dataclass(frozen=True)
class UpcycleConfig:
    """Shape (as the default model), the two phases' schedules, and the upcycling itself.

    Steps are a fixed budget: training ends on them (or on `stop_after`, total steps dense + MoE), never on
    the clock; `max_minutes` is only a guard that errors out, saving nothing, when a run takes longer.
    """

    model: TrainConfig = TrainConfig(steps=0, max_minutes=0.0)  # shape, batch, weight decay, aux loss, eval, dtype
    dense_steps: int = 900
    dense_lr: float = 3e-3
    dense_warmup: int = 50
    dense_final_lr_ratio: float = 0.1  # cosine from dense_lr down to 10%: the MoE phase continues from there
    moe_steps: int = 300
    moe_expert_lr: float = 3e-4  # = where the dense cosine ended: experts drift slowly and stay substitutable
    moe_router_lr: float = 3e-3  # the fresh router learns at the dense peak rate
    moe_warmup: int = 20  # fresh AdamW moments
    noise: float = 0.01  # per expert copy: Gaussian noise of this fraction of each weight matrix's std
    max_minutes: float = 0.0  # error-out guard for the whole run, checked in the MoE phase (<= 0: none)
    stop_after: int | None = None  # total steps (dense + MoE) after which to stop
    threads: int = 1  # one thread: on a shared 2-core machine a second thread mostly waits for the first
    tokenizer_from: str = "default"  # the packaged model whose tokenizer is reused (same vocabulary)
    dense_checkpoint: str | None = None  # folder to save the dense model to, or load it from when present


def upcycle(dense: torch.nn.Module, num_experts: int, top_k: int, noise: float = 0.01, seed: int = 0,
            **config_overrides) -> torch.nn.Module:
    """A Mixtral MoE whose experts are copies of `dense`'s single FFN (plus noise) and whose router is fresh.

    dense: a MixtralForCausalLM with num_local_experts == 1. Every other weight (embeddings, attention,
    norms) is copied; `config_overrides` (e.g. router_aux_loss_coef) go into the MoE's config. Expert e's matrices are W + noise * std(W) * N(0, 1) (seeded); the router
    [E, hidden] is drawn from N(0, initializer_range^2) like any freshly initialised Mixtral router.
    """
    from transformers import MixtralForCausalLM

    cfg = dense.config
    if getattr(cfg, "model_type", None) != "mixtral" or cfg.num_local_experts != 1:
        raise EdgeMoEError("upcycle: expected a dense Mixtral (num_local_experts == 1), got "
                           f"{getattr(cfg, 'model_type', None)!r} with {getattr(cfg, 'num_local_experts', None)} experts")
    if not 1 <= top_k <= num_experts:
        raise EdgeMoEError(f"upcycle: top_k must be in [1, num_experts={num_experts}], got {top_k}")
    moe_cfg = cfg.__class__.from_dict({**cfg.to_dict(), "num_local_experts": num_experts, "num_experts_per_tok": top_k,
                                      **config_overrides})
    moe = MixtralForCausalLM(moe_cfg).to(next(dense.parameters()).dtype)
    gen = torch.Generator().manual_seed(seed)
    src = dense.state_dict()
    out = {}
    for name, w in moe.state_dict().items():
        if name.endswith("mlp.gate.weight"):
            out[name] = torch.randn(w.shape, generator=gen).to(w.dtype) * cfg.initializer_range
        elif ".mlp.experts." in name:
            base = src[name][0].float()  # [..] the dense FFN's matrix
            eps = torch.randn((num_experts, *base.shape), generator=gen) * (noise * base.std())
            out[name] = (base.unsqueeze(0) + eps).to(w.dtype)
        else:
            out[name] = src[name]
    moe.load_state_dict(out)
    return moe


def expert_spread(model: torch.nn.Module) -> list[float]:
    """Per MoE layer: ||W_e - mean_e W|| / ||mean_e W|| over the experts' stacked matrices [L]."""
    spread = []
    for layer in model.model.layers:
        ex = layer.mlp.experts
        w = torch.cat([ex.gate_up_proj.detach().flatten(1), ex.down_proj.detach().flatten(1)], dim=1).float()
        mean = w.mean(0, keepdim=True)
        spread.append(float((w - mean).norm(dim=1).mean() / mean.norm()))
    return spread


def _cosine(warmup: int, steps: int, final_ratio: float):
    """LR multiplier: linear warmup, then cosine from 1 to `final_ratio` at `steps`."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, steps - warmup))
        return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def _dense_shape(cfg: UpcycleConfig) -> TrainConfig:
    return replace(cfg.model, num_experts=1, top_k=1, router_aux_loss_coef=0.0)


def train_dense(train, cfg: UpcycleConfig, log=print, stop_after: int | None = None):
    """Phase 1: the dense model (a one-expert Mixtral) on blocks `train` -> (model, losses)."""
    shape = _dense_shape(cfg)
    model = build_model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.dense_lr, weight_decay=shape.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(cfg.dense_warmup, cfg.dense_steps, cfg.dense_final_lr_ratio))
    rng = np.random.default_rng([cfg.model.seed, 1])
    steps = cfg.dense_steps if stop_after is None else min(cfg.dense_steps, stop_after)
    losses = train_steps(model, train, rng, opt, sched, steps, shape.batch_size, router_loss=False, log=log, tag="dense")
    return model, losses


def train_moe(moe, train, cfg: UpcycleConfig, log=print, deadline: float | None = None, stop_after: int | None = None):
    """Phase 2: MoE training of the upcycled model -> (losses, spread log [(step, [L])])."""
    router = [p for n, p in moe.named_parameters() if n.endswith("mlp.gate.weight")]
    rest = [p for n, p in moe.named_parameters() if not n.endswith("mlp.gate.weight")]
    wd = cfg.model.weight_decay
    opt = torch.optim.AdamW([{"params": rest, "lr": cfg.moe_expert_lr}, {"params": router, "lr": cfg.moe_router_lr}],
                            weight_decay=wd, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(cfg.moe_warmup, cfg.moe_steps, 0.0))
    rng = np.random.default_rng([cfg.model.seed, 2])
    steps = cfg.moe_steps if stop_after is None else min(cfg.moe_steps, stop_after)
    spread = [(0, expert_spread(moe))]

    def every_50(step: int) -> None:
        spread.append((step, expert_spread(moe)))
        log(f"moe step {step}: expert spread per layer {[round(s, 3) for s in spread[-1][1]]}")

    losses = train_steps(moe, train, rng, opt, sched, steps, cfg.model.batch_size, router_loss=True, log=log,
                         tag="moe", deadline=deadline, every_50=every_50)
    return losses, spread


def _load_or_train_dense(train, cfg: UpcycleConfig, log, stop_after: int | None):
    """The dense model from `cfg.dense_checkpoint` when it holds this config's run, else trained (and saved there)."""
    from transformers import MixtralForCausalLM

    from edgemoe.io import atomic_write_dir

    key = {"shape": asdict(_dense_shape(cfg)), "dense_steps": cfg.dense_steps, "dense_lr": cfg.dense_lr,
           "dense_warmup": cfg.dense_warmup, "dense_final_lr_ratio": cfg.dense_final_lr_ratio,
           "steps_run": cfg.dense_steps if stop_after is None else min(cfg.dense_steps, stop_after)}
    ckpt = Path(cfg.dense_checkpoint) if cfg.dense_checkpoint else None
    if ckpt is not None and (ckpt / "dense_run.json").is_file():
        saved = json.loads((ckpt / "dense_run.json").read_text())
        if saved["key"] != key:
            raise EdgeMoEError(f"dense checkpoint {ckpt} was trained with another configuration; remove it or pick another folder")
        log(f"dense model loaded from {ckpt}")
        return MixtralForCausalLM.from_pretrained(ckpt, dtype=torch.float32), saved["losses"]
    model, losses = train_dense(train, cfg, log, stop_after)
    if ckpt is not None:
        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)
            (tmp / "dense_run.json").write_text(json.dumps({"key": key, "losses": losses}) + "\n")
        atomic_write_dir(ckpt, write)
    return model, losses


def train_upcycled_model(data_root: str | Path, out: str | Path, cfg: UpcycleConfig = UpcycleConfig(), log=print) -> dict:
    """Dense pretraining, upcycling, MoE training on the shared corpus at `data_root`; save to `out`; return the recipe.

    Also writes `train_log.txt` (every logged line) next to the model.
    """
    from edgemoe.io import check_replaceable_dir

    from .train import is_trained_model_folder

    check_replaceable_dir(out, "model", is_trained_model_folder)  # refuse before the training, not after

    from .loader import load_tokenizer

    lines: list[str] = []

    def log_(msg: str) -> None:
        lines.append(msg)
        log(msg)

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        t_start = time.time()
        tokenizer = load_tokenizer(cfg.tokenizer_from)
        data = load_training_data(data_root, tokenizer, cfg.model, log=log_)
        train = data["train"]
        dense_stop = cfg.stop_after
        dense, dense_losses = _load_or_train_dense(train, cfg, log_, dense_stop)
        dense_minutes = (time.time() - t_start) / 60
        dense_ppl = evaluate_heldout(dense, data)
        log_("dense held-out perplexity: " + ", ".join(f"{k}={v:.1f}" for k, v in dense_ppl.items()))

        moe = upcycle(dense, cfg.model.num_experts, cfg.model.top_k, cfg.noise, seed=cfg.model.seed,
                      router_aux_loss_coef=cfg.model.router_aux_loss_coef, output_router_logits=False)
        moe_stop = None if cfg.stop_after is None else max(0, cfg.stop_after - len(dense_losses))
        deadline = guard_deadline(cfg.max_minutes, t_start)
        moe_losses, spread = train_moe(moe, train, cfg, log_, deadline=deadline, stop_after=moe_stop)
        train_minutes = (time.time() - t_start) / 60
        ppl = evaluate_heldout(moe, data)
        log_("held-out perplexity: " + ", ".join(f"{k}={v:.1f}" for k, v in ppl.items()))
    finally:
        torch.set_num_threads(threads)

    n_params = sum(p.numel() for p in moe.parameters())
    steps_done = len(dense_losses) + len(moe_losses)
    tokens_per_step = (cfg.model.batch_size // len(data["domains"])) * len(data["domains"]) * cfg.model.block_len
    recipe = {
        "what": "edgemoe default-upcycled model: a dense Mixtral-format LM whose FFN was copied into 16 experts "
                "(plus noise) under a fresh router, then trained as an MoE",
        "command": f"edgemoe train --upcycle --data {data_root} --out {out}"
                   + (f" --stop-after {cfg.stop_after}" if cfg.stop_after is not None else ""),
        "config": asdict(cfg),
        "parameters": n_params,
        "tokenizer": f"reused from the '{cfg.tokenizer_from}' model",
        "data": data["description"],
        "dense_steps_done": len(dense_losses),
        "moe_steps_done": len(moe_losses),
        "steps_done": steps_done,
        "tokens_seen": steps_done * tokens_per_step,
        "dense_minutes": round(dense_minutes, 2),
        "train_minutes": round(train_minutes, 2),
        "final_dense_loss": round(float(np.mean(dense_losses[-50:])), 4),
        "final_train_loss": round(float(np.mean(moe_losses[-50:])), 4) if moe_losses else None,
        "dense_heldout_perplexity": {k: round(v, 3) for k, v in dense_ppl.items()},
        "heldout_perplexity": {k: round(v, 3) for k, v in ppl.items()},
        "expert_spread": {"definition": "per MoE layer, mean over experts of ||W_e - mean W|| / ||mean W|| "
                                        "(gate_up and down matrices stacked)",
                          "by_step": {str(s): [round(x, 4) for x in v] for s, v in spread}},
        "environment": recipe_environment(cfg.threads),
    }
    save_model_folder(out, moe, tokenizer, cfg.model.save_dtype, recipe, lines)
    return recipe
