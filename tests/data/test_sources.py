"""Text sources: deterministic splits, clear errors, tokenisation into labelled blocks."""

import numpy as np
import pytest

from edgemoe.data import TextSource, from_path, offline_default, resolve, tokenize_blocks
from edgemoe.errors import EdgeMoEError


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(EdgeMoEError, match="does not exist"):
        from_path(tmp_path / "nope.txt")
    with pytest.raises(EdgeMoEError, match="no text files"):
        from_path(tmp_path)
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(EdgeMoEError, match="only empty text"):
        from_path(tmp_path / "empty.txt")


def test_split_is_deterministic_and_disjoint():
    docs = tuple((f"doc{i}", f"text {i}") for i in range(500))
    src = TextSource("s", "d", docs)
    train, held = src.split("train"), src.split("heldout")
    assert {i for i, _ in train.docs}.isdisjoint({i for i, _ in held.docs})
    assert len(train.docs) + len(held.docs) == 500
    assert 20 < len(held.docs) < 80  # about 10%
    assert held == src.split("heldout")


def test_offline_default_has_code_and_docs():
    sources = offline_default()
    assert [s.domain for s in sources] == ["code", "docs"]
    assert all(s.num_chars > 1000 for s in sources)


def test_large_file_is_chunked(tmp_path):
    (tmp_path / "big.txt").write_text("line of text\n" * 5000)
    src = from_path(tmp_path / "big.txt", chunk_chars=10_000)
    assert len(src.docs) > 5 and src.num_chars == 13 * 5000


def test_tokenize_blocks(tmp_path):
    from edgemoe.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    (tmp_path / "a.txt").write_text("alpha beta gamma " * 200)
    (tmp_path / "b.txt").write_text("def f(x):\n    return x\n" * 200)
    blocks = tokenize_blocks([from_path(tmp_path / "a.txt", "prose"), from_path(tmp_path / "b.txt", "code")], tok, 32)
    assert blocks.ids.shape[1] == 32 and blocks.domains == ("prose", "code")
    assert set(np.unique(blocks.domain)) == {0, 1}
    with pytest.raises(EdgeMoEError, match="fewer than one block"):
        tokenize_blocks([TextSource("tiny", "x", (("a", "hi"),))], tok, 32)


def test_resolve_specs(tmp_path):
    (tmp_path / "t.txt").write_text("hello world\n")
    assert resolve(str(tmp_path / "t.txt"))[0].docs
    assert len(resolve("offline")) == 2
    with pytest.raises(EdgeMoEError):
        resolve(str(tmp_path / "missing"))
