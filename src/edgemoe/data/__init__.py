"""Text data: sources with domain labels, deterministic splits, tokenisation into blocks."""

from .blocks import TokenBlocks, tokenize_blocks
from .sources import (
    TextSource,
    from_path,
    hf_dataset,
    offline_default,
    resolve,
    shared_corpus,
    stdlib_code,
    stdlib_docs,
    wikitext_test,
)

__all__ = [
    "TextSource", "TokenBlocks", "from_path", "hf_dataset", "offline_default", "resolve", "shared_corpus",
    "stdlib_code", "stdlib_docs", "tokenize_blocks", "wikitext_test",
]
