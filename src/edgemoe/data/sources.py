"""Text sources with a domain label: files, folders, HF datasets, the shared corpus, and the Python stdlib.

A `TextSource` is a named list of documents (strings) with one domain label. Splits are deterministic:
a document's split is decided by a hash of its identifier, so every machine draws the same held-out set.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from edgemoe.errors import EdgeMoEError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".csv", ".tsv", ".text")


@dataclass(frozen=True)
class TextSource:
    """Documents of one domain. `docs` are (identifier, text) pairs."""

    name: str
    domain: str
    docs: tuple[tuple[str, str], ...]

    @property
    def num_chars(self) -> int:
        return sum(len(text) for _, text in self.docs)

    def split(self, part: str, heldout_fraction: float = 0.1) -> TextSource:
        """The 'train' or 'heldout' part, chosen per document by a hash of its identifier."""
        if part not in ("train", "heldout"):
            raise EdgeMoEError(f"split part must be 'train' or 'heldout', got {part!r}")
        keep = [(i, t) for i, t in self.docs if (_unit_hash(i) < heldout_fraction) == (part == "heldout")]
        return TextSource(f"{self.name}:{part}", self.domain, tuple(keep))

    def truncated(self, max_chars: int) -> TextSource:
        """At most `max_chars` characters, documents taken in order (the last one cut)."""
        out, used = [], 0
        for ident, text in self.docs:
            if used >= max_chars:
                break
            piece = text[: max_chars - used]
            out.append((ident, piece))
            used += len(piece)
        return TextSource(self.name, self.domain, tuple(out))


def _unit_hash(identifier: str) -> float:
    """A stable number in [0, 1) for a document identifier."""
    return int(hashlib.sha256(identifier.encode()).hexdigest()[:12], 16) / float(1 << 48)


def _read_text(path: Path) -> str:
    """A text file through edgemoe.io's guarded reader (a regular file within the size cap); bytes that are
    not UTF-8 become U+FFFD."""
    from edgemoe.io import TEXT_LIMIT_BYTES, read_bytes

    return read_bytes(path, "text file", "UTF-8 text", TEXT_LIMIT_BYTES).decode("utf-8", errors="replace")


def from_path(path: str | Path, domain: str | None = None, chunk_chars: int = 20_000) -> TextSource:
    """Text from one file or every text file under a folder.

    Large files are cut into documents of about `chunk_chars` characters on line boundaries, so that a
    deterministic split can hold out part of a single book. Raises EdgeMoEError for a missing path, a
    folder with no text files, or empty text.
    """
    path = Path(path)
    if not path.exists():
        raise EdgeMoEError(f"data path {str(path)!r} does not exist (expected a text file or a folder of them)")
    files = [path] if not path.is_dir() else sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise EdgeMoEError(f"data folder {str(path)!r} holds no text files (suffixes {', '.join(TEXT_SUFFIXES)})")
    docs: list[tuple[str, str]] = []
    for f in files:
        text = _read_text(f)
        rel = f.name if path.is_file() else str(f.relative_to(path))
        docs.extend((f"{rel}#{i}", chunk) for i, chunk in enumerate(_chunks(text, chunk_chars)))
    source = TextSource(path.name, domain or path.stem, tuple(d for d in docs if d[1].strip()))
    if not source.docs:
        raise EdgeMoEError(f"data path {str(path)!r} holds only empty text")
    return source


def _chunks(text: str, size: int) -> Iterable[str]:
    """Cut `text` into pieces of about `size` characters, ending at line breaks where possible."""
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            nl = text.rfind("\n", start + size // 2, end)
            end = nl + 1 if nl > 0 else end
        yield text[start:end]
        start = end


def stdlib_root() -> Path:
    """The folder of this Python's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_code(max_files: int | None = None) -> TextSource:
    """The Python standard library's own sources (domain 'code'), present on every machine with Python.

    Tests, site-packages, IDLE and the lib2to3 fixtures are left out: they are not typical code or not
    the stdlib's own.
    """
    root = stdlib_root()
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo", "pydoc_data"}
    files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))
    if max_files is not None:
        files = files[:max_files]
    docs = tuple((str(p.relative_to(root)), _read_text(p)) for p in files)
    return TextSource("python-stdlib", "code", tuple(d for d in docs if d[1].strip()))


def stdlib_docs() -> TextSource:
    """The documentation topics shipped with pydoc (`pydoc_data.topics`), domain 'docs'."""
    from pydoc_data.topics import topics

    docs = tuple((f"pydoc:{k}", v) for k, v in sorted(topics.items()) if v.strip())
    return TextSource("pydoc-topics", "docs", docs)


def offline_default(part: str = "heldout") -> list[TextSource]:
    """The built-in offline corpus: stdlib sources and pydoc topics, with a deterministic split."""
    return [stdlib_code().split(part), stdlib_docs().split(part)]


SHARED_DOMAINS = ("wiki", "gutenberg", "shakespeare", "code")


def shared_corpus(root: str | Path, part: str = "train") -> list[TextSource]:
    """The multi-domain corpus the default model is trained on, from `../shared/data` at `root`.

    part='train' gives the training text and part='heldout' its validation split, per domain:
    wiki = WikiText-2 valid, gutenberg = the Gutenberg books except Shakespeare's plays (those belong to
    the shakespeare domain), shakespeare = tinyshakespeare, code = the Python stdlib sources.
    WikiText-2 test is never part of either: see `wikitext_test`.
    """
    root = Path(root)
    if not root.is_dir():
        raise EdgeMoEError(f"shared data folder {str(root)!r} not found (expected ../shared/data with wikitext-2/, gutenberg/, tinyshakespeare/)")
    wiki = from_path(root / "wikitext-2" / "valid.txt", domain="wiki")
    books = [p for p in sorted((root / "gutenberg").glob("*.txt")) if not p.name.startswith("shakespeare-")]
    gutenberg_docs = tuple(d for p in books for d in from_path(p, domain="gutenberg").docs)
    gutenberg = TextSource("gutenberg", "gutenberg", tuple((f"gutenberg/{i}", t) for i, t in gutenberg_docs))
    shakespeare = from_path(root / "tinyshakespeare" / "input.txt", domain="shakespeare")
    return [s.split(part) for s in (wiki, gutenberg, shakespeare, stdlib_code())]


def wikitext_test(root: str | Path) -> TextSource:
    """WikiText-2 test, the held-out evaluation text (never trained on)."""
    return from_path(Path(root) / "wikitext-2" / "test.txt", domain="wiki")


def hf_dataset(dataset_id: str, split: str = "test", text_field: str = "text", config: str | None = None,
               domain: str | None = None) -> TextSource:
    """Text from a Hugging Face dataset id, when the `datasets` package and the hub are reachable."""
    try:
        import datasets
    except ImportError as exc:
        raise EdgeMoEError(f"HF dataset {dataset_id!r}: the 'datasets' package is not installed (pip install datasets)") from exc
    try:
        ds = datasets.load_dataset(dataset_id, config, split=split)
    except Exception as exc:  # network, missing id, missing split: all end the same way for the user
        raise EdgeMoEError(f"HF dataset {dataset_id!r} (split {split!r}) could not be loaded: {exc}") from exc
    if text_field not in ds.column_names:
        raise EdgeMoEError(f"HF dataset {dataset_id!r} has no field {text_field!r}; fields: {ds.column_names}")
    docs = tuple((f"{dataset_id}:{i}", t) for i, t in enumerate(ds[text_field]) if t and t.strip())
    if not docs:
        raise EdgeMoEError(f"HF dataset {dataset_id!r} split {split!r} holds no text")
    return TextSource(dataset_id, domain or dataset_id.split("/")[-1], docs)


def resolve(spec: str, domain: str | None = None) -> list[TextSource]:
    """Sources from a data spec given on the command line.

    'offline' (the stdlib corpus, held-out part), 'shared:PATH' (the shared corpus' held-out part),
    'wikitext-test:PATH', 'hf:ID[:SPLIT]', or a file/folder path.
    """
    if spec == "offline":
        return offline_default("heldout")
    if spec.startswith("shared:"):
        return shared_corpus(spec.split(":", 1)[1], part="heldout")
    if spec.startswith("wikitext-test:"):
        return [wikitext_test(spec.split(":", 1)[1])]
    if spec.startswith("hf:"):
        parts = spec[3:].split(":")
        return [hf_dataset(parts[0], split=parts[1] if len(parts) > 1 else "test", domain=domain)]
    return [from_path(spec, domain=domain)]
