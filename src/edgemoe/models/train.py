"""Train the embedded default model: a small Mixtral-format MoE causal LM on a multi-domain corpus.

The result is a plain HF folder (config.json, model.safetensors, tokenizer.json, ...) that
`AutoModelForCausalLM.from_pretrained` loads without edgemoe, plus `recipe.json` saying how it was made.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from edgemoe.data import TextSource, shared_corpus, tokenize_blocks, wikitext_test
from edgemoe.errors import EdgeMoEError
from edgemoe.io import atomic_write_dir, check_replaceable_dir
from edgemoe.progress import bar


@dataclass(frozen=True)
class TrainConfig:
    """Shape and schedule of the default model. Sizes keep the bf16 checkpoint under 25 MB."""

    vocab_size: int = 4096  # byte-level BPE: big enough for four domains, small enough for the size cap
    hidden_size: int = 128
    intermediate_size: int = 256  # per expert
    num_layers: int = 4  # every layer is an MoE layer (Mixtral format)
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 16  # enough experts per layer that placement is a real problem
    top_k: int = 2
    block_len: int = 256
    batch_size: int = 16
    steps: int = 1039  # optimizer steps run: the shipped model's run (a 30 min clock once cut a 3000-step plan here)
    schedule_steps: int | None = 3000  # the cosine LR schedule's span (None: `steps`); the shipped run's plan
    max_minutes: float = 0.0  # error-out guard: fail (nothing saved) once training runs longer (<= 0: no guard)
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.05
    router_aux_loss_coef: float = 0.02  # Mixtral's load-balancing loss: keeps every expert in use
    tokenizer_chars_per_domain: int = 2_000_000  # BPE is trained on a balanced sample
    eval_tokens_per_domain: int = 40_000
    seed: int = 0
    save_dtype: str = "bfloat16"  # halves the checkpoint; evaluation loads it back in float32


def train_tokenizer(sources: list[TextSource], vocab_size: int, chars_per_domain: int):
    """A byte-level BPE tokenizer trained on an equal share of each source's text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )

    def texts():
        for src in sources:
            for _, text in src.truncated(chars_per_domain).docs:
                yield text

    tok.train_from_iterator(texts(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")


def build_model(cfg: TrainConfig):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, max_position_embeddings=cfg.block_len * 4,
        router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, rope_theta=10000.0,
    )
    torch.manual_seed(cfg.seed)
    return MixtralForCausalLM(config)


def heldout_perplexity(model, ids: np.ndarray, batch_size: int = 16) -> float:
    """Token-level perplexity of `model` on blocks ids [B, S], through the same scorer as every evaluation."""
    from edgemoe.models.scoring import perplexity, token_nll

    from .loader import adapter_for

    model.eval()
    adapter = adapter_for(model, "training run")
    try:
        return perplexity(token_nll(adapter, ids, batch_size=batch_size))
    finally:
        adapter.remove_hooks()


def load_training_data(data_root: str | Path, tokenizer, cfg: TrainConfig, log=print, train_src=None) -> dict:
    """The shared corpus at `data_root` as blocks: train, held-out per domain and WikiText-2 test, plus a description.

    `train_src`: the training sources when the caller has read them already (shared_corpus(data_root, "train")).
    """
    train_src = train_src if train_src is not None else shared_corpus(data_root, "train")
    heldout_src = shared_corpus(data_root, "heldout")
    domains = tuple(s.domain for s in train_src)
    train = tokenize_blocks(train_src, tokenizer, cfg.block_len, domains=domains)
    heldout = tokenize_blocks(heldout_src, tokenizer, cfg.block_len, domains=domains,
                              max_tokens_per_source=cfg.eval_tokens_per_domain)
    wiki_test = tokenize_blocks([wikitext_test(data_root)], tokenizer, cfg.block_len, domains=domains,
                                max_tokens_per_source=cfg.eval_tokens_per_domain)
    log(f"tokens: train {train.num_tokens:,} ({', '.join(f'{d}={int((train.domain == i).sum()) * cfg.block_len:,}' for i, d in enumerate(domains))})")
    description = {
        "train": {s.domain: {"source": s.name, "documents": len(s.docs), "chars": s.num_chars} for s in train_src},
        "train_tokens": train.num_tokens,
        "heldout": "10% of documents per domain by a hash of the document id (edgemoe.data.sources)",
        "never_trained_on": "WikiText-2 test",
    }
    return {"train": train, "heldout": heldout, "wiki_test": wiki_test, "domains": domains, "description": description}


def evaluate_heldout(model, data: dict) -> dict[str, float]:
    """Perplexity per held-out domain and on WikiText-2 test (`data` from load_training_data)."""
    heldout = data["heldout"]
    ppl = {d: heldout_perplexity(model, heldout.ids[heldout.domain == i]) for i, d in enumerate(data["domains"])}
    ppl["wikitext2_test"] = heldout_perplexity(model, data["wiki_test"].ids)
    model.train()
    return ppl


class TrainingGuardError(EdgeMoEError):
    """Training ran past its wall-clock guard (`max_minutes`); nothing was saved."""


def guard_deadline(max_minutes: float, start: float | None = None) -> float | None:
    """The `time.time()` past which training errors out: `start` + max_minutes (None when max_minutes <= 0)."""
    return (time.time() if start is None else start) + 60 * max_minutes if max_minutes > 0 else None


def train_steps(model, train, rng: np.random.Generator, opt, sched, steps: int, batch_size: int, router_loss: bool = True,
                log=print, tag: str = "", deadline: float | None = None, every_50=None, total: int | None = None) -> list[float]:
    """`steps` optimizer steps on blocks `train` (ids [B, S], domain [B]) -> the loss of each step.

    Every batch holds an equal share of each domain, so the router sees all of them all the time. The
    step count alone decides where training ends, so a recipe replays on any machine; `deadline` (a
    `time.time()` value) is only a guard: passing it raises TrainingGuardError instead of saving a run
    that some clock cut short. `every_50(step)` runs after every 50th step.
    """
    n_dom = len(train.domains)
    by_domain = [np.flatnonzero(train.domain == i) for i in range(n_dom)]
    model.train()
    losses: list[float] = []
    t0 = time.time()
    prefix = f"{tag} " if tag else ""
    for step in bar(range(1, steps + 1), desc=tag or "train", unit="step"):  # a bar on a terminal only
        pick = np.concatenate([rng.choice(ix, batch_size // n_dom) for ix in by_domain])
        x = torch.from_numpy(train.ids[pick])
        out_ = model(input_ids=x, labels=x, output_router_logits=router_loss)
        opt.zero_grad(set_to_none=True)
        out_.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(out_.loss.item())
        if step % 50 == 0:
            log(f"{prefix}step {step}/{total or steps} loss {np.mean(losses[-50:]):.3f} ({(time.time() - t0) / 60:.1f} min)")
            if every_50 is not None:
                every_50(step)
        if deadline is not None and time.time() > deadline and step < steps:
            raise TrainingGuardError(f"training passed its --max-minutes guard at {prefix}step {step} of {steps}; "
                                     "nothing was saved (the recipe's step count decides where training ends: "
                                     "raise --max-minutes, or 0 for no guard)")
    return losses


def train_default_model(data_root: str | Path, out: str | Path, cfg: TrainConfig = TrainConfig(), log=print,
                        tokenizer=None, data: dict | None = None) -> dict:
    """Train tokenizer and model on the shared corpus at `data_root`, save to `out`, return the recipe.

    The run is `cfg.steps` optimizer steps, whatever the clock says; the same config, seed, data and
    thread count give the same bytes (tests/models/test_train_determinism.py). `tokenizer` and `data`
    (as load_training_data returns it): already at hand (tests pass tiny ones), else built from `data_root`.
    """
    if cfg.steps < 1 or (cfg.schedule_steps is not None and cfg.schedule_steps < cfg.steps):
        raise EdgeMoEError(f"train: steps must be >= 1 and schedule_steps (None or >= steps); got steps={cfg.steps}, "
                           f"schedule_steps={cfg.schedule_steps}")
    from transformers import get_cosine_schedule_with_warmup

    check_replaceable_dir(out, "model", is_trained_model_folder)  # refuse before hours of training, not after
    t_start, cpu_start = time.time(), time.process_time()
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    if tokenizer is None:
        train_src = shared_corpus(data_root, "train")
        tokenizer = train_tokenizer(train_src, cfg.vocab_size, cfg.tokenizer_chars_per_domain)
        data = load_training_data(data_root, tokenizer, cfg, log=log, train_src=train_src) if data is None else data
    elif data is None:
        data = load_training_data(data_root, tokenizer, cfg, log=log)

    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    span = cfg.steps if cfg.schedule_steps is None else cfg.schedule_steps
    sched = get_cosine_schedule_with_warmup(opt, cfg.warmup, span)
    losses = train_steps(model, data["train"], rng, opt, sched, cfg.steps, cfg.batch_size, log=log,
                         deadline=guard_deadline(cfg.max_minutes, t_start))
    step = len(losses)
    train_minutes = (time.time() - t_start) / 60
    train_cpu_seconds = time.process_time() - cpu_start  # this process' CPU time: tokenizer, data and steps
    domains = data["domains"]

    ppl = evaluate_heldout(model, data)
    log("held-out perplexity: " + ", ".join(f"{k}={v:.1f}" for k, v in ppl.items()))
    recipe = {
        "what": "edgemoe default model: Mixtral-format MoE causal LM trained from scratch on four domains",
        "command": f"edgemoe train --data {data_root} --out {out}",
        "config": asdict(cfg),
        "parameters": n_params,
        "data": data["description"],
        "steps_done": step,
        "tokens_seen": step * (cfg.batch_size // len(domains)) * len(domains) * cfg.block_len,
        "train_minutes": round(train_minutes, 2),
        "train_cpu_seconds": round(train_cpu_seconds, 1),
        "final_train_loss": round(float(np.mean(losses[-50:])), 4),
        "heldout_perplexity": {k: round(v, 3) for k, v in ppl.items()},
        "environment": recipe_environment(torch.get_num_threads()),
    }
    save_model_folder(out, model, tokenizer, cfg.save_dtype, recipe)
    return recipe


def recipe_environment(threads: int) -> dict:
    """What a recipe's bytes depend on besides the recipe: the library versions, the thread count (the float
    reductions' order) and the machine."""
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "threads": threads,
            "machine": platform.machine()}


def save_model_folder(out: Path, model, tokenizer, save_dtype: str, recipe: dict,
                      log_lines: list[str] | None = None) -> None:
    """Write a trained model's folder `out` all or nothing: the weights in `save_dtype` (the model is cast in
    place), the tokenizer (None: none, for a model that reuses its source's), recipe.json and, given
    `log_lines`, train_log.txt."""

    def write(tmp: Path) -> None:
        model.to(getattr(torch, save_dtype)).save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
        if log_lines is not None:
            (tmp / "train_log.txt").write_text("\n".join(log_lines) + "\n")

    atomic_write_dir(out, write, kind="model", recognise=is_trained_model_folder)


TRAINED_MODEL_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "recipe.json",
                                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "train_log.txt"})


def is_trained_model_folder(path: Path) -> bool:
    """A folder `edgemoe train` wrote before output markers existed: the HF files and our recipe only."""
    try:
        names = {p.name for p in Path(path).iterdir()}
        recipe = json.loads((Path(path) / "recipe.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return names <= TRAINED_MODEL_FILES and str(recipe.get("command", "")).startswith("edgemoe train")
