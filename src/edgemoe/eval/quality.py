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
    out = np.empty((ids.shape[0], ids.shape[1] - 1), dtype=np.float64)
    with adapter.intervene(policy):
        for i in range(0, len(ids), batch_size):
            x = torch.from_numpy(ids[i:i + batch_size])
            if on_batch is not None:
                on_batch(i, i + len(x))
            logits = adapter.forward_logits(x).float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
            out[i:i + len(x)] = nll.view(len(x), -1).double().numpy()
    return out


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL)."""
    return float(math.exp(float(np.mean(nll))))
