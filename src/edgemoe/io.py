"""Atomic file and folder writes: a crash never leaves a half-written output behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def _public_mode(path: Path, directory: bool = False) -> None:
    """mkstemp/mkdtemp create private (0600/0700) entries; give outputs the usual umask-based mode."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if directory else 0o666) & ~mask)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same folder, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        _public_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | os.PathLike, obj, indent: int = 2) -> Path:
    """Serialise `obj` as JSON and write it atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def atomic_write_with(path: str | os.PathLike, writer: Callable[[Path], None]) -> Path:
    """Call `writer(tmp_path)` to produce a file, then rename it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        writer(Path(tmp))
        _public_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_dir(path: str | os.PathLike, writer: Callable[[Path], None]) -> Path:
    """Call `writer(tmp_dir)` to fill a fresh folder, then swap it in place of `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        writer(tmp)
        _public_mode(tmp, directory=True)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def atomic_write_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """Save a matplotlib figure as PNG (dpi 110 unless given) atomically, then release it."""
    import matplotlib.pyplot as plt

    kwargs = {"format": "png", "dpi": 110, **savefig_kwargs}
    try:
        return atomic_write_with(path, lambda tmp: fig.savefig(tmp, **kwargs))
    finally:
        plt.close(fig)


def read_json(path: str | os.PathLike, what: str = "file"):
    """Parse a JSON file; a missing file or bad JSON is an EdgeMoEError naming the path and `what` it is."""
    from edgemoe.errors import EdgeMoEError

    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EdgeMoEError(f"{path}: {what} not found") from None
    except json.JSONDecodeError as exc:
        raise EdgeMoEError(f"{path}: invalid JSON ({exc})") from None

