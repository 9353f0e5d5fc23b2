"""Models derived from a shipped one, for a ladder of expert distinctness between and beyond the two defaults.

`default-upcycled` has near-copy experts; `default` was trained as an MoE from scratch. The recipes here
start from `default-upcycled`'s weights and train as an MoE for a fixed number of steps:

- `upcycled-diverged`: the upcycled model trained on with the experts at the dense model's peak learning
  rate (10x the upcycling phase's), so the copies drift apart under the router's specialisation.
- `finegrained-shared`: a Qwen2-MoE-format model made the way Qwen1.5-MoE was made from a dense model:
  the dense FFN's intermediate channels are split into a shared expert (always on) and fine-grained slices,
  each slice copied into several routed experts (plus noise), top-K over many small experts. The dense FFN
  is taken as the mean of `default-upcycled`'s experts (they are that FFN's copies plus a ~5% drift).

Each recipe is a step budget: the same recipe, seed, data and thread count give the same bytes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError

from .train import (
    TrainConfig,
    evaluate_heldout,
    guard_deadline,
    heldout_perplexity,
    load_training_data,
    recipe_environment,
    save_model_folder,
    train_steps,
)
from .upcycle import _cosine, expert_spread


@dataclass(frozen=True)
class DeriveConfig:
    """One derived model's recipe: where it starts, how it is reshaped, and its MoE training schedule."""

    kind: str  # "continue": train the source as it is; "finegrain": split its FFN into shared + fine-grained experts
    what: str  # one line for the recipe
    source: str = "default-upcycled"  # the packaged model the weights (and the tokenizer) come from
    model: TrainConfig = TrainConfig(steps=1, schedule_steps=None)  # batch, block, weight decay, aux loss, eval
    steps: int = 300
    expert_lr: float = 3e-3  # routed and shared experts
    router_lr: float = 3e-3
    rest_lr: float = 3e-4  # embeddings, attention, norms: already trained, kept near where they are
    warmup: int = 20
    # finegrain only: the dense FFN's channels -> a shared expert of `shared_fraction` of them, the rest cut
    # into `slices` equal slices, each copied `copies` times (num_experts = slices * copies), top_k routed.
    shared_fraction: float = 0.5
    slices: int = 4
    copies: int = 4
    top_k: int = 4
    noise: float = 0.01  # per copy: Gaussian noise of this fraction of each matrix' std
    seed: int = 0
    threads: int = 1  # part of the recipe: float reduction order (and so the bytes) depends on it
    max_minutes: float = 0.0  # error-out guard only (<= 0: none)


RECIPES: dict[str, DeriveConfig] = {
    "upcycled-diverged": DeriveConfig(
        kind="continue", steps=300, expert_lr=3e-3, router_lr=3e-3, rest_lr=3e-4,
        what="edgemoe upcycled-diverged model: default-upcycled trained on as an MoE with its experts at 10x the "
             "upcycling learning rate, so that the copies diverge"),
    "finegrained-shared": DeriveConfig(
        kind="finegrain", steps=300, expert_lr=3e-3, router_lr=3e-3, rest_lr=3e-4,
        what="edgemoe finegrained-shared model: Qwen2-MoE format; default-upcycled's FFN (expert mean) split into "
             "a shared expert and 4 fine-grained slices x 4 noisy copies, top-4 of 16, then trained as an MoE"),
}
RECIPE_FOLDERS = {"upcycled-diverged": "upcycled_diverged_model", "finegrained-shared": "finegrained_shared_model"}


def dense_ffn(moe: torch.nn.Module, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of layer `layer`'s experts: gate_up [2I, H] and down [H, I] (Mixtral's fused layout)."""
    ex = moe.model.layers[layer].mlp.experts
    return ex.gate_up_proj.detach().float().mean(0), ex.down_proj.detach().float().mean(0)


def finegrain(source: torch.nn.Module, cfg: DeriveConfig) -> torch.nn.Module:
    """A Qwen2-MoE model from a Mixtral `source`: same attention, norms and embeddings; FFN split per `cfg`.

    Per layer, with the dense FFN down(silu(g x) * u x) over I channels (a sum over channels): a seeded
    permutation of the channels, the first `shared_fraction * I` form the shared expert (its down scaled by
    2, its sigmoid gate starting at 0 -> 0.5, so it starts as exactly those channels), the rest are cut
    into `slices` slices, each copied `copies` times with noise. Routed gates are renormalised over the top-K
    (norm_topk_prob) and every routed down is scaled by `slices`: a token whose top-K holds one copy of each
    slice at equal gates gets the dense FFN back. The router is fresh (N(0, initializer_range^2)).
    """
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    sc = source.config
    inter = sc.intermediate_size
    n_shared = int(round(cfg.shared_fraction * inter))
    if cfg.slices < 1 or cfg.copies < 1 or (inter - n_shared) % cfg.slices or n_shared < 1:
        raise EdgeMoEError(f"finegrain: {inter - n_shared} routed channels do not split into {cfg.slices} slices "
                           f"(shared_fraction={cfg.shared_fraction}, intermediate_size={inter})")
    width = (inter - n_shared) // cfg.slices
    n_exp = cfg.slices * cfg.copies
    if not 1 <= cfg.top_k <= n_exp:
        raise EdgeMoEError(f"finegrain: top_k must be in [1, {n_exp}], got {cfg.top_k}")
    qc = Qwen2MoeConfig(
        vocab_size=sc.vocab_size, hidden_size=sc.hidden_size, intermediate_size=inter,
        num_hidden_layers=sc.num_hidden_layers, num_attention_heads=sc.num_attention_heads,
        num_key_value_heads=sc.num_key_value_heads, max_position_embeddings=sc.max_position_embeddings,
        rms_norm_eps=sc.rms_norm_eps, rope_parameters=dict(sc.rope_parameters), tie_word_embeddings=True,
        num_experts=n_exp, num_experts_per_tok=cfg.top_k, moe_intermediate_size=width,
        shared_expert_intermediate_size=n_shared, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=cfg.model.router_aux_loss_coef, output_router_logits=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=sc.initializer_range,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2MoeForCausalLM(qc)
    gen = torch.Generator().manual_seed(cfg.seed)
    src = {k: v.float() for k, v in source.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name, w in model.state_dict().items():
        if name in src and ".mlp." not in name:
            out[name] = src[name]
        elif name.endswith("_proj.bias"):  # Qwen2 attention has q/k/v biases, Mixtral none: zero keeps the function
            out[name] = torch.zeros_like(w)
        else:
            out[name] = w  # filled per layer below
    for i in range(qc.num_hidden_layers):
        gate_up, down = dense_ffn(source, i)  # [2I, H], [H, I]
        perm = torch.randperm(inter, generator=gen)
        sh, routed = perm[:n_shared], perm[n_shared:]
        p = f"model.layers.{i}.mlp."
        out[p + "shared_expert.gate_proj.weight"] = gate_up[sh].clone()
        out[p + "shared_expert.up_proj.weight"] = gate_up[inter + sh].clone()
        out[p + "shared_expert.down_proj.weight"] = 2.0 * down[:, sh]
        out[p + "shared_expert_gate.weight"] = torch.zeros(1, qc.hidden_size)
        out[p + "gate.weight"] = torch.randn(n_exp, qc.hidden_size, generator=gen) * qc.initializer_range
        gus, downs = [], []
        for s in range(cfg.slices):
            ch = routed[s * width:(s + 1) * width]
            gu = torch.cat([gate_up[ch], gate_up[inter + ch]])  # [2w, H]
            dn = cfg.slices * down[:, ch]  # [H, w]
            for _ in range(cfg.copies):
                gus.append(gu + torch.randn(gu.shape, generator=gen) * (cfg.noise * gu.std()))
                downs.append(dn + torch.randn(dn.shape, generator=gen) * (cfg.noise * dn.std()))
        out[p + "experts.gate_up_proj"] = torch.stack(gus)  # expert e = slice e // copies
        out[p + "experts.down_proj"] = torch.stack(downs)
    model.load_state_dict(out)
    return model


def _optimizer(model: torch.nn.Module, cfg: DeriveConfig):
    """AdamW with three groups (experts, router, the rest) and a warmup + cosine-to-zero schedule over cfg.steps."""
    groups: dict[str, list] = {"experts": [], "router": [], "rest": []}
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            groups["router"].append(p)
        elif ".mlp." in name:
            groups["experts"].append(p)
        else:
            groups["rest"].append(p)
    lrs = {"experts": cfg.expert_lr, "router": cfg.router_lr, "rest": cfg.rest_lr}
    opt = torch.optim.AdamW([{"params": groups[g], "lr": lrs[g]} for g in groups], weight_decay=cfg.model.weight_decay,
                            betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _cosine(cfg.warmup, cfg.steps, 0.0))


def build_derived(cfg: DeriveConfig, source: torch.nn.Module) -> torch.nn.Module:
    """The model before training: `source` itself (kind 'continue') or its fine-grained split."""
    if cfg.kind == "continue":
        return source
    if cfg.kind == "finegrain":
        return finegrain(source, cfg)
    raise EdgeMoEError(f"derive: kind {cfg.kind!r}: expected 'continue' or 'finegrain'")


def train_derived_model(data_root: str | Path, out: str | Path, name: str, cfg: DeriveConfig | None = None,
                        log=print, source_model: torch.nn.Module | None = None, data: dict | None = None) -> dict:
    """Build recipe `name` (RECIPES) from its source model, train it cfg.steps steps, save to `out`; the recipe.

    `source_model` / `data`: already loaded (tests pass tiny ones); otherwise the packaged source model in
    float32 and the shared corpus at `data_root` with the source's tokenizer. Writes `train_log.txt` beside it.
    """
    from edgemoe.io import check_replaceable_dir

    from .loader import load_moe, load_tokenizer
    from .train import is_trained_model_folder

    if cfg is None:
        if name not in RECIPES:
            raise EdgeMoEError(f"--recipe {name!r}: expected one of {', '.join(RECIPES)}")
        cfg = RECIPES[name]
    if cfg.steps < 1:
        raise EdgeMoEError(f"recipe {name!r}: steps must be >= 1, got {cfg.steps}")
    check_replaceable_dir(out, "model", is_trained_model_folder)
    lines: list[str] = []

    def log_(msg: str) -> None:
        lines.append(msg)
        log(msg)

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        t_start, cpu_start = time.time(), time.process_time()
        tokenizer = load_tokenizer(cfg.source) if source_model is None else None
        if source_model is None:
            source_model = load_moe(cfg.source).model.float()
        if data is None:
            data = load_training_data(data_root, tokenizer, cfg.model, log=log_)
        torch.manual_seed(cfg.seed)
        model = build_derived(cfg, source_model)
        start_spread = expert_spread(model)
        # WikiText-2 test only before training: what the reshaping costs, at a fifth of the full evaluation's time
        start_ppl = {"wikitext2_test": heldout_perplexity(model, data["wiki_test"].ids)}
        model.train()
        log_(f"before training: WikiText-2 test perplexity {start_ppl['wikitext2_test']:.1f}")
        opt, sched = _optimizer(model, cfg)
        spread = [(0, start_spread)]

        def every_50(step: int) -> None:
            spread.append((step, expert_spread(model)))
            log_(f"step {step}: expert spread per layer {[round(s, 3) for s in spread[-1][1]]}")

        rng = np.random.default_rng([cfg.seed, 3])
        losses = train_steps(model, data["train"], rng, opt, sched, cfg.steps, cfg.model.batch_size, log=log_,
                             tag=name, deadline=guard_deadline(cfg.max_minutes, t_start), every_50=every_50)
        train_minutes, train_cpu = (time.time() - t_start) / 60, time.process_time() - cpu_start
        ppl = evaluate_heldout(model, data)
        log_("held-out perplexity: " + ", ".join(f"{k}={v:.1f}" for k, v in ppl.items()))
    finally:
        torch.set_num_threads(threads)

    n_dom = len(data["domains"])
    recipe = {
        "what": cfg.what,
        "command": f"edgemoe train --recipe {name} --data {data_root} --out {out}",
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer": f"reused from the '{cfg.source}' model",
        "data": data["description"],
        "steps_done": len(losses),
        "tokens_seen": len(losses) * (cfg.model.batch_size // n_dom) * n_dom * cfg.model.block_len,
        "train_minutes": round(train_minutes, 2),
        "train_cpu_seconds": round(train_cpu, 1),
        "final_train_loss": round(float(np.mean(losses[-50:])), 4),
        "start_heldout_perplexity": {k: round(v, 3) for k, v in start_ppl.items()},
        "heldout_perplexity": {k: round(v, 3) for k, v in ppl.items()},
        "expert_spread": {"definition": "per MoE layer, mean over routed experts of ||W_e - mean W|| / ||mean W|| "
                                        "(gate_up and down matrices stacked)",
                          "by_step": {str(s): [round(x, 4) for x in v] for s, v in spread}},
        "environment": recipe_environment(cfg.threads),
    }
    save_model_folder(out, model, tokenizer, cfg.model.save_dtype, recipe, lines)
    return recipe

