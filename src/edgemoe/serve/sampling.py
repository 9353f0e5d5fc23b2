"""Next-token choice (greedy, temperature / top-k / top-p, seeded per token): one rule for both backends, kept in
edgemoe.distributed.sampling because the Ray homes sample there (the layer below this one)."""

from edgemoe.distributed.sampling import SamplingParams, filtered_logits, next_token, top_logprobs

__all__ = ["SamplingParams", "filtered_logits", "next_token", "top_logprobs"]
