"""Safe output writes: a crash or a mistake never loses a file the user had.

Rules every output of edgemoe follows (files, folders, figures, reports):

- Written beside the target under a temporary name, flushed and fsync'ed, then renamed onto it; the
  folder is fsync'ed after the rename. An interrupted run (Ctrl-C, SIGKILL, power loss) leaves the
  previous output whole; at worst a `.NAME.*.tmp` entry is left beside it.
- A symlink is written through (its target is replaced, the link stays); a FIFO, device, socket or a
  folder where a file is expected is refused with an EdgeMoEError, never replaced.
- Output folders (a profile, a trained model, a report) carry a marker file, `.edgemoe-output.json`,
  listing what edgemoe wrote there. An existing folder is replaced only when it is empty or one of ours
  (marker present, nothing foreign added); anything else is refused and left untouched. The swap is one
  atomic `renameat2(RENAME_EXCHANGE)` on Linux, so the path never stops existing.
- Only the named target is touched: no sibling is created, renamed or removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgemoe.errors import EdgeMoEError

MARKER = ".edgemoe-output.json"
MARKER_SCHEMA = "edgemoe.output/1"


# ------------------------------------------------------------------------------------------- targets


def _kind_of(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "not a regular file"


def resolve_target(path: str | os.PathLike) -> Path:
    """The real path an output named `path` is written to: symlinks are followed (written through).

    A dangling symlink is written through too (its target is created). Parent folders are not created.
    """
    path = Path(path)
    if path.is_symlink():
        return Path(os.path.realpath(path))
    return path


def file_target(path: str | os.PathLike) -> Path:
    """Check that `path` may receive a file and return where to write it (symlinks followed).

    Raises EdgeMoEError when it exists as anything but a regular file (a folder, FIFO, device, socket).
    """
    real = resolve_target(path)
    try:
        mode = real.stat().st_mode
    except FileNotFoundError:
        return real
    if not stat.S_ISREG(mode):
        via = f" (through the symlink {path})" if real != Path(path) else ""
        raise EdgeMoEError(f"{real}{via} is {_kind_of(mode)}; edgemoe writes only regular files: give a file path")
    return real


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise EdgeMoEError(f"{path}: a parent of the output path is a file, not a folder") from None
    except NotADirectoryError:
        raise EdgeMoEError(f"{path}: a parent of the output path is a file, not a folder") from None


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _output_mode(existing: Path | None, directory: bool = False) -> int:
    """The mode a new output gets: the replaced file's, else the umask-based default.

    mkstemp/mkdtemp create private (0600/0700) entries, which is not what a user expects of an output.
    """
    if existing is not None:
        try:
            return stat.S_IMODE(existing.stat().st_mode)
        except OSError:
            pass
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


NAME_MAX = 255  # bytes in one file name on Linux file systems (ext4, xfs, btrfs, tmpfs)


def temp_prefix(name: str) -> str:
    """The prefix of a temporary beside an output called `name`: ".NAME." cut so that the whole temporary
    name (prefix, 8 random characters, ".tmp") fits NAME_MAX bytes, whatever the length of `name`."""
    room = NAME_MAX - len(".") - len(".") - 8 - len(".tmp")
    raw = os.fsencode(name)[:room]
    return "." + os.fsdecode(raw.decode("utf-8", "ignore").encode("utf-8")) + "."


def _write_error(path, exc: BaseException) -> EdgeMoEError | None:
    """The EdgeMoEError for a write that the system refused (disk full, quota, read-only, I/O error), naming
    the output `path` (the OS error often names only a temporary, or nothing); None for anything else."""
    code = exc.errno if isinstance(exc, OSError) else None
    text = str(exc)
    if code is None and ("StorageFull" in text or "No space left" in text or "os error 28" in text):
        code = errno.ENOSPC  # safetensors reports the OS error inside its own message
    if code is None:
        return None
    why = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
           errno.EROFS: "the file system is read-only", errno.EFBIG: "the file is too large for the file system"}
    reason = why.get(code, os.strerror(code))
    return EdgeMoEError(f"{path}: cannot write the output ({reason}); nothing was replaced: free space or give "
                        "another path")


# --------------------------------------------------------------------------------------------- files


def _raise_write_error(path: str | os.PathLike, exc: BaseException) -> None:
    """Re-raise `exc` (being handled) as the error naming output `path` that `_write_error` makes of it, or
    as it is (an EdgeMoEError, an interrupt, anything not a refused write)."""
    err = None if isinstance(exc, EdgeMoEError) else _write_error(path, exc)
    if err is not None:
        raise err from None
    raise exc


def _sibling_dir(path: str | os.PathLike, target: Path) -> Path:
    """A fresh private folder beside `target` (a name that fits the file system's limit), or EdgeMoEError
    naming `path`."""
    try:
        return Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(target.name), suffix=".tmp"))
    except OSError as exc:
        raise EdgeMoEError(f"{path}: cannot write in {target.parent} ({exc.strerror})") from None


def atomic_write_with(path: str | os.PathLike, writer: Callable[[Path], None]) -> Path:
    """Call `writer(tmp_path)` to produce a file beside `path`, fsync it, rename it onto `path`.

    Returns `path` as given. A symlink at `path` is written through; a non-regular file is refused.
    """
    target = file_target(path)
    _make_parent(target)
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=temp_prefix(target.name), suffix=".tmp")
    except OSError as exc:
        raise EdgeMoEError(f"{path}: cannot write in {target.parent} ({exc.strerror})") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer(tmp)
        os.chmod(tmp, _output_mode(target if target.exists() else None))
        _fsync_file(tmp)
        file_target(path)  # still a regular file (or absent) at the last moment
        os.replace(tmp, target)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        _raise_write_error(path, exc)
    _fsync_dir(target.parent)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically (see `atomic_write_with`)."""
    return atomic_write_with(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically (see `atomic_write_with`)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj, indent: int = 2) -> Path:
    """Serialise `obj` as JSON and write it atomically."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n")


def jsonable(obj, strict: bool = True):
    """obj with numpy arrays and scalars turned into Python values, through dicts, lists and tuples.

    strict (what a results file needs, so that json.dumps writes strict JSON): NaN and inf become None,
    tuples become lists and dict keys strings. strict=False (a policy's recorded parameters, which rebuild
    the policy): NaN, inf, tuples and keys stay as they are, so the values rebuild the same policy.
    """
    import numpy as np

    if isinstance(obj, dict):
        return {(str(k) if strict else k): jsonable(v, strict) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [jsonable(v, strict) for v in obj]
        if strict or isinstance(obj, list):
            return items
        return tuple(items) if type(obj) is tuple else type(obj)(*items)  # a NamedTuple stays one
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist(), strict)
    if isinstance(obj, np.generic):
        obj = obj.item()
    if strict and isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def atomic_write_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """Save a matplotlib figure as PNG (dpi 110 unless given) atomically, then release it."""
    import matplotlib.pyplot as plt

    kwargs = {"format": "png", "dpi": 110, **savefig_kwargs}
    try:
        return atomic_write_with(path, lambda tmp: fig.savefig(tmp, **kwargs))
    finally:
        plt.close(fig)


def publish_file(src: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Move a finished file `src` (on the same file system) onto `path` with the output rules.

    Used when a library function chose its own file name: the file is fsync'ed and renamed onto the
    target (written through a symlink), and `src` no longer exists afterwards.
    """
    src = Path(src)
    target = file_target(path)
    _make_parent(target)
    os.chmod(src, _output_mode(target if target.exists() else None))
    _fsync_file(src)
    os.replace(src, target)
    _fsync_dir(target.parent)
    return Path(path)


def check_distinct_outputs(**paths: str | os.PathLike | None) -> None:
    """Raise EdgeMoEError if two named outputs (e.g. out=..., expert_map=...) are the same file."""
    seen: dict[str, str] = {}
    for name, p in paths.items():
        if p is None:
            continue
        key = os.path.realpath(p)
        if key in seen:
            raise EdgeMoEError(f"--{seen[key].replace('_', '-')} and --{name.replace('_', '-')} name the same file "
                               f"{p}; give each output its own path")
        seen[key] = name


# ------------------------------------------------------------------------------------------- folders


def read_marker(folder: Path) -> dict | None:
    """The folder's edgemoe output marker, or None when it has none (or an unreadable one)."""
    try:
        d = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("schema") == MARKER_SCHEMA else None


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def _listed(name: str, patterns: list[str]) -> bool:
    """`name` matches one of the marker's patterns, or is our temporary for one (".NAME.XXXX.tmp", left
    beside a target by a killed run)."""
    if name.startswith(".") and name.endswith((".tmp", ".old")) and name.count(".") >= 3:
        name = name[1:].rsplit(".", 2)[0]
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def folder_is_ours(folder: Path, kind: str | None = None,
                   recognise: Callable[[Path], bool] | None = None) -> bool:
    """True when `folder` is an edgemoe output that may be replaced: its marker lists every entry in it
    (and names `kind`, when given), or it has no marker and `recognise(folder)` says it is ours."""
    marker = read_marker(folder)
    if marker is not None:
        if kind is not None and marker.get("kind") != kind:
            return False
        patterns = list(marker.get("files", []))
        return all(_listed(n, patterns) for n in _entries(folder) - {MARKER})
    return bool(recognise is not None and recognise(folder))


def check_replaceable_dir(path: str | os.PathLike, kind: str,
                          recognise: Callable[[Path], bool] | None = None, action: str = "replace") -> None:
    """Raise EdgeMoEError now (before long work) if `atomic_write_dir(path, ..., kind)` (or, with
    action="write into", `claim_output_dir`) would refuse `path`."""
    target = resolve_target(path)
    if target.exists():
        _refuse_foreign(target, kind, recognise, action)


def _refuse_foreign(folder: Path, kind: str, recognise: Callable[[Path], bool] | None,
                    action: str = "replace") -> None:
    if not folder.is_dir():
        raise EdgeMoEError(f"{folder} exists and is {_kind_of(folder.stat().st_mode)}; "
                           f"the {kind} output must be a folder: give a new folder path")
    if not _entries(folder) or folder_is_ours(folder, kind, recognise):
        return
    marker = read_marker(folder)
    if marker is not None and marker.get("kind") != kind:
        why = f"it holds an edgemoe {marker.get('kind')!r} output, not a {kind}"
    elif marker is not None:
        extra = sorted(n for n in _entries(folder) - {MARKER} if not _listed(n, list(marker.get("files", []))))
        why = f"it holds files edgemoe did not write there ({', '.join(extra[:5])})"
    else:
        why = f"it is not an edgemoe {kind} output (no {MARKER})"
    raise EdgeMoEError(f"{folder}: refusing to {action} an existing folder: {why}; "
                       "give a new or empty folder, or remove it yourself")


def _write_marker(folder: Path, kind: str) -> None:
    files = sorted(_entries(folder) - {MARKER})
    (folder / MARKER).write_text(json.dumps({"schema": MARKER_SCHEMA, "kind": kind, "files": files}, indent=1) + "\n",
                                 encoding="utf-8")


def _fsync_tree(folder: Path) -> None:
    for root, _dirs, files in os.walk(folder):
        for name in files:
            _fsync_file(Path(root) / name)
        _fsync_dir(Path(root))


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def atomic_write_dir(path: str | os.PathLike, writer: Callable[[Path], None], kind: str = "output",
                     recognise: Callable[[Path], bool] | None = None) -> Path:
    """Call `writer(tmp_dir)` to fill a fresh folder beside `path`, mark it as ours, swap it into place.

    kind: what the folder is ("profile", "model", ...), recorded in the marker. An existing `path` is
    replaced only if it is empty or ours (`folder_is_ours`; `recognise` identifies outputs written before
    markers existed); otherwise EdgeMoEError and nothing is touched. A symlink is followed.
    Returns `path` as given.
    """
    target = resolve_target(path)
    if target.exists():
        _refuse_foreign(target, kind, recognise)
    _make_parent(target)
    tmp = _sibling_dir(path, target)
    try:
        writer(tmp)
        _write_marker(tmp, kind)
        os.chmod(tmp, _output_mode(target if target.is_dir() else None, directory=True))
        _fsync_tree(tmp)
        if target.exists():
            _refuse_foreign(target, kind, recognise)  # re-check: it may have changed while we worked
            if not _exchange(tmp, target):
                # No atomic swap on this platform: move the old one aside first (a short window).
                aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(target.name), suffix=".old"))
                os.rmdir(aside)
                os.replace(target, aside)
                os.replace(tmp, target)
                tmp = aside
            _fsync_dir(target.parent)
            shutil.rmtree(tmp)  # the previous output (ours, checked twice) now sits at tmp
        else:
            os.replace(tmp, target)
            _fsync_dir(target.parent)
    except BaseException as exc:
        if tmp.exists() and tmp != target:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)
        _raise_write_error(path, exc)
    return Path(path)


def claim_output_dir(path: str | os.PathLike, kind: str, files: list[str] | tuple[str, ...] = (),
                     recognise: Callable[[Path], bool] | None = None) -> Path:
    """Make `path` a folder edgemoe may write named files into (a report, a demo run), or refuse.

    A new or empty folder is created and marked; an existing folder must be ours (`folder_is_ours`),
    else EdgeMoEError. `files` (names or fnmatch patterns of what will be written there, e.g. "*.png")
    are recorded in the marker first, so a run killed half-way still leaves a folder we recognise.
    Returns the real folder (symlinks followed).
    """
    target = resolve_target(path)
    if target.exists():
        _refuse_foreign(target, kind, recognise, action="write into")
    _make_parent(target)
    target.mkdir(exist_ok=True)
    # A folder recognised as ours without a marker (written before markers existed): what is in it is ours.
    marker = read_marker(target) or {"schema": MARKER_SCHEMA, "kind": kind, "files": sorted(_entries(target))}
    marker["files"] = sorted(set(marker.get("files", [])) | set(files))
    atomic_write_json(target / MARKER, marker, indent=1)
    return target


def write_into_dir(path: str | os.PathLike, writer: Callable[[Path], None], kind: str,
                   files: list[str] | tuple[str, ...] = (), recognise: Callable[[Path], bool] | None = None) -> Path:
    """Fill a folder edgemoe writes named files into (a report) all or nothing: `writer(stage)` fills a
    private folder beside `path`; only when it returns is `path` claimed (`claim_output_dir`) and each
    entry moved in with one rename. A failed writer leaves `path` as it was (not even created).
    Returns the real folder."""
    target = resolve_target(path)
    check_replaceable_dir(target, kind, recognise, action="write into")
    _make_parent(target)
    stage = _sibling_dir(path, target)
    try:
        writer(stage)
        names = sorted(_entries(stage))
        claim_output_dir(target, kind, tuple(files) + tuple(names), recognise)
        _fsync_tree(stage)
        for name in names:
            if (target / name).is_dir() and not (target / name).is_symlink():
                raise EdgeMoEError(f"{target / name}: is a folder where the {kind} writes a file")
            os.replace(stage / name, target / name)
        _fsync_dir(target)
    except BaseException as exc:
        _raise_write_error(path, exc)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return target


@dataclass(frozen=True)
class Output:
    """One output a command is about to write: a file (`folder=None`) or a folder of `folder` kind that
    is replaced whole (`action="replace"`, a profile, a model) or written into (`"write into"`, a report)."""

    path: str | os.PathLike | None
    folder: str | None = None
    recognise: Callable[[Path], bool] | None = None
    action: str = "replace"


def _inside(child: str, parent: str) -> bool:
    return child != parent and child.startswith(parent.rstrip(os.sep) + os.sep)


def check_outputs(outputs: dict[str, Output], inputs: dict[str, object] | None = None) -> None:
    """Claim every output of a command before any work, the same way for all commands.

    outputs: flag -> Output; inputs: flag -> a path or a list of paths the command reads. Refused, each
    with one EdgeMoEError naming the flags and paths: two outputs that are the same file; an output inside
    another output folder; an output that is one of the inputs; an input inside a folder that would be
    replaced; an output file that exists as anything but a regular file; an output folder that is not ours
    (`check_replaceable_dir`). Nothing is created or changed.
    """
    real = {flag: os.path.realpath(o.path) for flag, o in outputs.items() if o.path is not None}
    seen: dict[str, str] = {}
    for flag, key in real.items():
        if key in seen:
            raise EdgeMoEError(f"{seen[key]} and {flag} name the same file {outputs[flag].path}; "
                               "give each output its own path")
        seen[key] = flag
    for flag, key in real.items():
        for other, okey in real.items():
            if outputs[other].folder is not None and _inside(key, okey):
                raise EdgeMoEError(f"{flag} {outputs[flag].path} is inside the {outputs[other].folder} folder "
                                   f"{other} {outputs[other].path}; give it a path outside")
    for iflag, given in (inputs or {}).items():
        paths = given if isinstance(given, list | tuple) else [given]
        for p in paths:
            if p is None or is_stdin(p) or not os.path.lexists(p):
                continue
            ikey = os.path.realpath(p)
            for flag, key in real.items():
                if ikey == key:
                    raise EdgeMoEError(f"{flag} {outputs[flag].path} is also the input {iflag} {p}; "
                                       "give the output its own path (edgemoe never writes over its inputs)")
                out = outputs[flag]
                if out.folder is not None and out.action == "replace" and _inside(ikey, key):
                    raise EdgeMoEError(f"the input {iflag} {p} is inside the {out.folder} folder {flag} {out.path}, "
                                       "which is replaced whole; give the output another path")
    for flag, o in outputs.items():
        if o.path is None:
            continue
        try:
            if o.folder is None:
                file_target(o.path)
            else:
                check_replaceable_dir(o.path, o.folder, o.recognise, o.action)
        except EdgeMoEError as exc:
            raise EdgeMoEError(f"{flag}: {exc}") from None


# --------------------------------------------------------------------------------------------- reads
#
# One guarded reader for every file a user gives (traces, clusters, placements, profiles, results, model
# configs, text): `input_file` checks it is a regular file (symlinks followed) no larger than its cap, and
# the readers below keep to the cap while reading (a file that grows, stdin, a gzip stream that inflates).
# Every failure is one EdgeMoEError naming the file, and the line where there is one.

MiB = 1 << 20
DOC_LIMIT_BYTES = 256 * MiB  # a JSON/YAML/TOML document (cluster, placement, results, meta.json, config.json)
TRACE_LIMIT_BYTES = 64 * 1024 * MiB  # one routing trace, after decompression
LINE_LIMIT_BYTES = 16 * MiB  # one JSONL line (a trace line of 4096 router logits is ~100 kB)
TEXT_LIMIT_BYTES = 2048 * MiB  # one calibration text file
MAX_DEPTH = 64  # nesting of lists/objects in a document; ours need 6
MAX_VALUES = 2_000_000  # values in one document (counting YAML aliases as often as they are used)
MAX_INT_DIGITS = 40  # longer integers are refused while parsing; every count edgemoe reads fits int64 (19 digits)
STDIN = "-"


def _size_text(n: int) -> str:
    return f"{n / MiB:,.0f} MiB" if n >= MiB else f"{n:,} bytes"


def is_stdin(path: str | os.PathLike) -> bool:
    return str(path) == STDIN


def input_file(path: str | os.PathLike, what: str = "file", expected: str = "JSON",
               limit: int = DOC_LIMIT_BYTES) -> Path:
    """Check that `path` is a readable regular file of at most `limit` bytes; return it.

    Missing, a folder, a FIFO, a device (`/dev/zero`), a socket, or too large: EdgeMoEError naming the
    path, `what` it is and the format `expected`.
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise EdgeMoEError(f"{path}: {what} not found") from None
    except OSError as exc:
        raise EdgeMoEError(f"{path}: cannot read the {what} ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise EdgeMoEError(f"{path}: is a folder, expected a {what} ({expected})")
    if not stat.S_ISREG(st.st_mode):
        raise EdgeMoEError(f"{path}: is {_kind_of(st.st_mode)}, expected a {what} ({expected}) in a regular file")
    if st.st_size > limit:
        raise EdgeMoEError(f"{path}: the {what} is {_size_text(st.st_size)}, more than the {_size_text(limit)} "
                           f"edgemoe reads from one {what}")
    return path


def _read_capped(stream, limit: int, path, what: str) -> bytes:
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise EdgeMoEError(f"{path}: the {what} holds more than the {_size_text(limit)} edgemoe reads from one {what}")
    return data


def read_bytes(path: str | os.PathLike, what: str = "file", expected: str = "JSON", limit: int = DOC_LIMIT_BYTES,
               allow_stdin: bool = False) -> bytes:
    """The bytes of a user's file (`input_file`'s checks), or of stdin for "-" when `allow_stdin`."""
    if allow_stdin and is_stdin(path):
        import sys

        return _read_capped(sys.stdin.buffer, limit, "<stdin>", what)
    real = input_file(path, what, expected, limit)
    try:
        with open(real, "rb") as f:
            return _read_capped(f, limit, path, what)
    except OSError as exc:
        raise EdgeMoEError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None


def _decode(data: bytes, path, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise EdgeMoEError(f"{path}: {what} is not UTF-8 text (line {line}, byte {exc.start})") from None


def read_text(path: str | os.PathLike, what: str = "file", expected: str = "JSON", limit: int = DOC_LIMIT_BYTES,
              allow_stdin: bool = False) -> str:
    """A UTF-8 text file's contents (`read_bytes`); bytes that are not UTF-8 are an EdgeMoEError naming the
    path and line."""
    return _decode(read_bytes(path, what, expected, limit, allow_stdin), path, what)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _TooBig(len(text.lstrip("-")))
    return int(text)


class _TooBig(ValueError):
    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


def _parse_error(exc: BaseException, source: str) -> EdgeMoEError | None:
    """A clear EdgeMoEError for the limits parsers run into (deep nesting, huge integers), else None."""
    if isinstance(exc, RecursionError):
        return EdgeMoEError(f"{source}: lists or objects nested too deep (edgemoe reads at most {MAX_DEPTH} levels)")
    if isinstance(exc, _TooBig):
        return EdgeMoEError(f"{source}: an integer of {exc.digits} digits; edgemoe reads integers of at most "
                            f"{MAX_INT_DIGITS} digits (counts and sizes fit 64 bits)")
    if isinstance(exc, ValueError) and "integer string conversion" in str(exc):
        return EdgeMoEError(f"{source}: an integer of thousands of digits; edgemoe reads integers of at most "
                            f"{MAX_INT_DIGITS} digits")
    return None


def check_tree(obj, source: str, max_depth: int = MAX_DEPTH, max_values: int = MAX_VALUES):
    """Return `obj` (parsed JSON/YAML/TOML) if it nests at most `max_depth` levels, holds at most `max_values`
    values and no integer longer than MAX_INT_DIGITS digits; else EdgeMoEError naming `source`.

    Iterative, so it never recurses itself; a YAML alias counts each time it is used, so an alias bomb
    stops at `max_values` instead of expanding in whatever walks the document next.
    """
    stack = [(obj, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > max_values:
            raise EdgeMoEError(f"{source}: more than {max_values:,} values (YAML aliases count each time they are used)")
        if isinstance(node, dict | list | tuple):
            if depth > max_depth:
                raise EdgeMoEError(f"{source}: lists or objects nested deeper than {max_depth} levels")
            items = node.values() if isinstance(node, dict) else node
            stack.extend((v, depth + 1) for v in items)
            if isinstance(node, dict):
                stack.extend((k, depth + 1) for k in node if not isinstance(k, str))
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) >= 10**MAX_INT_DIGITS:
            raise EdgeMoEError(f"{source}: an integer of more than {MAX_INT_DIGITS} digits; counts and sizes fit 64 bits")
    return obj


def loads_json(text: str, source: str, line_numbers: bool = True):
    """Parse JSON text with the document limits (`check_tree`); errors name `source` (and the line, unless
    `source` names it already: `line_numbers=False`)."""
    try:
        obj = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        where = f"{source}:{exc.lineno}" if line_numbers else source
        raise EdgeMoEError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except (RecursionError, ValueError) as exc:
        err = _parse_error(exc, source)
        if err is None:
            raise
        raise err from None
    return check_tree(obj, source)


def read_json(path: str | os.PathLike, what: str = "file", limit: int = DOC_LIMIT_BYTES):
    """Parse a user's JSON file (`read_text`, `loads_json`); every failure is an EdgeMoEError naming the path
    and `what` it is."""
    return loads_json(read_text(path, what, "JSON", limit), str(Path(path)))


def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """PyYAML's safe loader with integers bounded like JSON's (MAX_INT_DIGITS)."""

    def construct_int(loader, node):
        digits = len(str(node.value).replace("_", "").lstrip("+-"))
        if digits > MAX_INT_DIGITS:
            raise _TooBig(digits)
        return yaml.SafeLoader.construct_yaml_int(loader, node)

    Loader.add_constructor("tag:yaml.org,2002:int", construct_int)
    return Loader


def loads_yaml(text: str, source: str):
    """Parse YAML text (safe loader, integers bounded) with the document limits; errors name `source`."""
    import yaml

    try:
        obj = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise EdgeMoEError(f"{source}{where}: cannot parse the YAML ({one_line_of(exc)})") from None
    except (RecursionError, ValueError) as exc:
        err = _parse_error(exc, source)
        if err is None:
            raise
        raise err from None
    return check_tree(obj, source)


def loads_toml(text: str, source: str):
    """Parse TOML text with the document limits; errors name `source`."""
    import tomllib

    try:
        obj = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise EdgeMoEError(f"{source}: cannot parse the TOML ({exc})") from None
    except (RecursionError, ValueError) as exc:
        err = _parse_error(exc, source)
        if err is None:
            raise
        raise err from None
    return check_tree(obj, source)


def one_line_of(exc: BaseException) -> str:
    return " ".join(str(exc).split())


class _RawOf:
    """A readable stream as a raw one, so that io.BufferedReader can give it peek()."""

    def __init__(self, stream):
        self.stream = stream
        self.closed = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        data = self.stream.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.closed = True


def read_lines(path: str | os.PathLike, what: str = "file", expected: str = "JSONL, optionally gzip (.gz)",
               limit: int = TRACE_LIMIT_BYTES, line_limit: int = LINE_LIMIT_BYTES,
               allow_stdin: bool = True):
    """Yield (line number from 1, text) of a text file, gzip-compressed when its name ends in .gz or its
    bytes start with gzip's magic number; "-" reads stdin (when `allow_stdin`).

    At most `limit` bytes after decompression and `line_limit` per line. A corrupt or truncated gzip
    stream, bytes that are not UTF-8, or a limit passed: EdgeMoEError naming the path and line.
    """
    import gzip
    import io as stdlib_io
    import sys
    import zlib

    name = "<stdin>" if allow_stdin and is_stdin(path) else str(path)
    if allow_stdin and is_stdin(path):
        raw = sys.stdin.buffer
        if not hasattr(raw, "peek"):  # a pipe-like stream without look-ahead: buffer it to see gzip's magic
            raw = stdlib_io.BufferedReader(_RawOf(raw))
        close = False
    else:
        real = input_file(path, what, expected, limit)
        try:
            raw = open(real, "rb")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise EdgeMoEError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
        close = True
    lineno, total = 0, 0
    try:
        head = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if name.endswith(".gz") or head == b"\x1f\x8b" else raw
        while True:
            try:
                line = stream.readline(line_limit + 1)
            except (OSError, EOFError, zlib.error) as exc:
                raise EdgeMoEError(f"{name}:{lineno + 1}: the {what} is damaged ({type(exc).__name__}: "
                                   f"{one_line_of(exc) or 'stream ends early'}); expected {expected}") from None
            if not line:
                return
            lineno += 1
            total += len(line)
            if len(line) > line_limit:
                raise EdgeMoEError(f"{name}:{lineno}: a line longer than {_size_text(line_limit)}; expected {expected}")
            if total > limit:
                raise EdgeMoEError(f"{name}: the {what} holds more than the {_size_text(limit)} edgemoe reads "
                                   f"from one {what}")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise EdgeMoEError(f"{name}:{lineno}: not UTF-8 text (byte {exc.start} of the line); "
                                   f"expected {expected}") from None
            yield lineno, text
    finally:
        if close:
            raw.close()
