"""Tokenisation of text sources into fixed-length blocks with a domain label per block."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgemoe.errors import EdgeMoEError

from .sources import TextSource


@dataclass(frozen=True)
class TokenBlocks:
    """ids [B, S] token ids; domain [B] index into `domains`."""

    ids: np.ndarray
    domain: np.ndarray
    domains: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.ids.size)


def tokenize_blocks(
    sources: Sequence[TextSource],
    tokenizer,
    block_len: int,
    max_tokens_per_source: int | None = None,
    domains: Sequence[str] | None = None,
) -> TokenBlocks:
    """Tokenise each source's documents, concatenate them (EOS between documents) and cut into blocks.

    tokenizer: a HF tokenizer (callable returning input_ids). A trailing partial block is dropped.
    `domains` fixes the domain order (default: order of first appearance). Raises EdgeMoEError when a
    source yields less than one block.
    """
    if not sources:
        raise EdgeMoEError("no text sources given")
    order = list(domains) if domains is not None else list(dict.fromkeys(s.domain for s in sources))
    eos = tokenizer.eos_token_id
    all_ids, all_dom = [], []
    for src in sources:
        if src.domain not in order:
            raise EdgeMoEError(f"source {src.name!r} has domain {src.domain!r}, not among {order}")
        stream: list[int] = []
        limit = None if max_tokens_per_source is None else max_tokens_per_source
        for _, text in src.docs:
            stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if eos is not None:
                stream.append(eos)
            if limit is not None and len(stream) >= limit:
                break
        if limit is not None:
            stream = stream[:limit]
        n = len(stream) // block_len
        if n == 0:
            raise EdgeMoEError(
                f"source {src.name!r} gives {len(stream)} tokens, fewer than one block of {block_len}"
            )
        all_ids.append(np.asarray(stream[: n * block_len], dtype=np.int64).reshape(n, block_len))
        all_dom.append(np.full(n, order.index(src.domain), dtype=np.int64))
    return TokenBlocks(np.concatenate(all_ids), np.concatenate(all_dom), tuple(order))
