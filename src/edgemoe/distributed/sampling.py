"""Next-token choice for one sequence: greedy, or temperature / top-k / top-p sampling, seeded per token.

The draw of a request's i-th generated token comes from a `torch.Generator` seeded by (seed, i) alone, so
neither what other sequences share its batch nor where it runs changes it: a stream that fails over to
another Ray home mid-way resumes at token i with the draws it would have made (edgemoe.distributed.batching).
The in-process engine (edgemoe.serve.engine) and the Ray homes use this one rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from edgemoe.errors import EdgeMoEError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0: greedy (argmax); top_k 0: no top-k cut; top_p 1: no nucleus cut."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 100.0:
            raise EdgeMoEError(f"temperature {self.temperature}: expected a number in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise EdgeMoEError(f"top_p {self.top_p}: expected a number in (0, 1]")
        if self.top_k < 0:
            raise EdgeMoEError(f"top_k {self.top_k}: expected an integer >= 0 (0: no top-k cut)")

    def generator(self, index: int = 0) -> torch.Generator:
        """The generator of the request's `index`-th generated token: seeded by (seed, index) through numpy's
        SeedSequence (well-mixed 64-bit seeds, so nearby seeds and indices give unrelated draws)."""
        state = np.random.SeedSequence([int(self.seed) & (2**63 - 1), int(index)]).generate_state(1, np.uint64)[0]
        g = torch.Generator()
        g.manual_seed(int(state) & (2**63 - 1))
        return g


def filtered_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] (float32) -> [V] scaled by 1/temperature with the tokens outside top-k / top-p set to -inf."""
    # Shifted by the largest logit first (the same distribution), so that at a tiny temperature the others go to
    # -inf and the most likely to 0 rather than inf - inf = nan; and a temperature below float32's smallest
    # normal number (which float32 would round to 0: 0 / 0) divides as that number, the same distribution to
    # float32's precision (every logit but the largest, or those tied with it, goes to -inf).
    x = (logits - logits.max()) / max(p.temperature, float(torch.finfo(logits.dtype).tiny))
    if 0 < p.top_k < x.shape[0]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        probs, order = torch.sort(torch.softmax(x, dim=0), descending=True)
        before = torch.cumsum(probs, dim=0) - probs  # mass of the tokens ranked above each one
        cut = order[before >= p.top_p]  # the smallest prefix reaching top_p is kept (always at least one token)
        x = x.clone()
        x[cut] = float("-inf")
    return x


def next_token(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    """The request's `index`-th generated token from logits [V]: argmax when temperature is 0, else one draw
    from `p.generator(index)`."""
    logits = logits.float().cpu()  # the generators are CPU ones (a draw must not depend on the device)
    if p.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(filtered_logits(logits, p), dim=0)
    return int(torch.multinomial(probs, 1, generator=p.generator(index)))


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """(log-probability of `token`, the n most likely tokens with theirs) under the model's own distribution
    (before temperature and cuts, as OpenAI's and vLLM's `logprobs` report)."""
    logp = torch.log_softmax(logits.float().cpu(), dim=0)
    top: list[tuple[int, float]] = []
    if n > 0:
        vals, ids = torch.topk(logp, min(n, logp.shape[0]))
        top = [(int(i), float(v)) for i, v in zip(ids, vals, strict=True)]
    return float(logp[token]), top
