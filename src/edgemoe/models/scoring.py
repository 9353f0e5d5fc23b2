"""Quality under interventions: perplexity of the real model with a policy's decisions applied."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from edgemoe.models import MoEAdapter
from edgemoe.models.base import Policy


@torch.no_grad()
def token_nll(adapter: MoEAdapter, ids: np.ndarray, policy: Policy | None = None, batch_size: int = 8,
              on_batch: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Negative log-likelihood of every next token of blocks ids [B, S] -> [B, S-1].

    With `policy`, every forward pass asks it at each MoE layer what to run (see MoEAdapter.intervene).
    `on_batch(start, stop)` is called before each batch so a caller can tell the policy which rows follow.
    """
    return token_scores(adapter, ids, policy, batch_size, on_batch)[0]


@torch.no_grad()
def token_scores(adapter: MoEAdapter, ids: np.ndarray, policy: Policy | None = None, batch_size: int = 8,
                 on_batch: Callable[[int, int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(nll [B, S-1], top1 [B, S-1]): `token_nll` and the model's most likely next token at every position."""
    out = np.empty((ids.shape[0], ids.shape[1] - 1), dtype=np.float64)
    top1 = np.empty((ids.shape[0], ids.shape[1] - 1), dtype=np.int64)
    with adapter.intervene(policy):
        for i in range(0, len(ids), batch_size):
            x = torch.from_numpy(ids[i:i + batch_size])
            if on_batch is not None:
                on_batch(i, i + len(x))
            logits = adapter.forward_logits(x).float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
            out[i:i + len(x)] = nll.view(len(x), -1).double().numpy()
            top1[i:i + len(x)] = logits[:, :-1].argmax(dim=-1).numpy()
    return out, top1


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL)."""
    return float(math.exp(float(np.mean(nll))))


def quality_metrics(nll: np.ndarray, top1: np.ndarray | None, nll_exact: np.ndarray,
                    top1_exact: np.ndarray | None) -> dict:
    """The field's yardsticks of a method against exact execution on the same tokens (all [B, S-1]):
    ppl, ppl_rel_increase = ppl / ppl_exact - 1, extra_nats_per_token = mean(nll - nll_exact),
    top1_agreement = share of positions whose most likely next token is exact execution's, and
    quality_retention = ppl_exact / ppl (kept for older reports)."""
    ppl, ppl_exact = perplexity(nll), perplexity(nll_exact)
    agree = None if top1 is None or top1_exact is None else float(np.mean(top1 == top1_exact))
    return {"ppl": ppl, "ppl_rel_increase": ppl / ppl_exact - 1.0,
            "extra_nats_per_token": float(np.mean(nll) - np.mean(nll_exact)), "top1_agreement": agree,
            "quality_retention": ppl_exact / ppl}
