"""One exception type for every bad input, and how the command line turns any failure into one line.

`EdgeMoEError` is what library code raises for bad input. `describe(exc)` maps an exception to
(one-line message, exit status): expected failures (bad input, a file the system refuses, a usage
mistake) give exit status 2; anything else is a bug, reported with the path of a file holding the full
traceback (`write_traceback`) and exit status 1.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import time
import traceback
from pathlib import Path

EXIT_BAD_INPUT = 2
EXIT_BUG = 1
EXIT_INTERRUPTED = 130


class EdgeMoEError(ValueError):
    """Bad input: the message names the field or file and what was expected."""


def require_in_range(a, lo, hi, what: str) -> None:
    """Raise EdgeMoEError "{what} in [lo, hi), got [min, max]" unless every entry of the array `a` is in [lo, hi)
    (a NaN is not). what names the field and the kind of value, e.g. "trace.topk must hold expert ids"."""
    if a.size and not (a.min() >= lo and a.max() < hi):
        raise EdgeMoEError(f"{what} in [{lo}, {hi}), got [{a.min()}, {a.max()}]")


def one_line(text: str) -> str:
    """Collapse a message onto one line (newlines and runs of spaces become single separators)."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    return re.sub(r"\s+", " ", "; ".join(parts)) or "(no message)"


def _pydantic_message(exc) -> str:
    errs = exc.errors()
    shown = [f"{'.'.join(str(x) for x in e.get('loc', ())) or 'value'}: {e.get('msg')}" for e in errs[:3]]
    more = f" (and {len(errs) - 3} more)" if len(errs) > 3 else ""
    return f"{exc.title}: " + "; ".join(shown) + more


def expected_message(exc: BaseException) -> str | None:
    """The one-line message for an expected failure, or None if `exc` is not one (a bug)."""
    if isinstance(exc, EdgeMoEError):
        return one_line(str(exc))
    if isinstance(exc, UnicodeDecodeError):
        return one_line(f"a file is not UTF-8 text ({exc.reason} at byte {exc.start}); give a UTF-8 text file")
    if isinstance(exc, OSError) and exc.errno is not None:
        where = f"{exc.filename}: " if exc.filename else ""
        if not where and exc.errno == errno.ENOSPC:  # a write outside edgemoe.io's paths, which name the output
            return one_line("no space left on the device (the file being written was not named); free space and rerun")
        return one_line(f"{where}{exc.strerror or exc}")
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if name == "ValidationError" and module.startswith("pydantic"):
        return one_line(_pydantic_message(exc))
    if name == "SafetensorError" or module.startswith("safetensors"):
        text = str(exc)
        if "StorageFull" in text or "No space left" in text or "os error 28" in text:
            return one_line(f"a safetensors file could not be written: no space left on the device ({exc})")
        return one_line(f"a safetensors file is corrupt or unreadable ({exc}); re-create it")
    return None


def write_traceback(exc: BaseException) -> Path | None:
    """Write the full traceback of `exc` to a new file in the temp folder; its path (None if unwritable)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        fd, name = tempfile.mkstemp(prefix=f"edgemoe-crash-{stamp}-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        return None
    return Path(name)


def describe(exc: BaseException) -> tuple[str, int]:
    """(message for stderr, exit status) for an exception that reached the command line."""
    msg = expected_message(exc)
    if msg is not None:
        return f"error: {msg}", EXIT_BAD_INPUT
    path = write_traceback(exc)
    where = f"the full traceback is in {path}" if path else "the traceback could not be written"
    summary = one_line(f"{type(exc).__name__}: {exc}")[:300]
    return f"error: internal error ({summary}); {where}; please report it", EXIT_BUG


def fail(exc: BaseException):
    """Print `exc` as one `error: ...` line on stderr and exit with status 2 (for command functions that
    are also used outside the `edgemoe` entry point, which catches everything itself)."""
    import sys

    import typer

    print(f"error: {expected_message(exc) or one_line(str(exc))}", file=sys.stderr)
    raise typer.Exit(code=EXIT_BAD_INPUT) from None
