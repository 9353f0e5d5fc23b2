"""edgemoe.io: outputs never destroy what the user had (symlinks, FIFOs, foreign folders, interrupted runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgemoe import io
from edgemoe.errors import EdgeMoEError


def tree(root: Path) -> dict:
    """Everything under `root` as {relative path: bytes | ('link', target) | 'dir' | 'fifo'}."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_fifo():
            out[rel] = "fifo"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = p.read_bytes()
    return out


# --------------------------------------------------------------------------------------------- files


def test_text_write_replaces_a_regular_file_and_keeps_its_mode(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    target.chmod(0o640)
    io.atomic_write_json(target, {"x": 1})
    assert json.loads(target.read_text()) == {"x": 1}
    assert target.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temporary left


def test_new_file_gets_the_umask_mode_and_parents(tmp_path):
    path = io.atomic_write_text(tmp_path / "d" / "e" / "f.txt", "hi")
    mask = os.umask(0)
    os.umask(mask)
    assert path.read_text() == "hi" and path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_symlink_is_written_through_and_stays_a_link(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    io.atomic_write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new"


def test_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "link.txt"
    link.symlink_to(tmp_path / "made.txt")
    io.atomic_write_text(link, "x")
    assert link.is_symlink() and (tmp_path / "made.txt").read_text() == "x"


@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "link-to-fifo"])
def test_non_regular_targets_are_refused_and_untouched(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "device":
        target.symlink_to("/dev/null")
    elif kind == "folder":
        target.mkdir()
        (target / "mine.txt").write_text("keep")
    else:
        os.mkfifo(tmp_path / "pipe")
        target.symlink_to(tmp_path / "pipe")
    before = tree(tmp_path)
    with pytest.raises(EdgeMoEError, match="regular files"):
        io.atomic_write_text(target, "x")
    assert tree(tmp_path) == before


def test_interrupted_writer_leaves_the_previous_file_whole(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("previous")

    def writer(tmp: Path) -> None:
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        io.atomic_write_with(target, writer)
    assert tree(tmp_path) == {"r.json": b"previous"}


def test_sigkill_mid_write_leaves_the_previous_file_and_folder_whole(tmp_path):
    """A real SIGKILL while the new file and the new folder are half written."""
    (tmp_path / "r.json").write_text("previous")
    io.atomic_write_dir(tmp_path / "prof", lambda d: (d / "a.txt").write_text("v1"), kind="profile")
    before = tree(tmp_path)
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from edgemoe import io
        def slow(tmp):
            Path(tmp).write_text("half") if not Path(tmp).is_dir() else (Path(tmp) / "a.txt").write_text("half")
            print("writing", flush=True)
            time.sleep(60)
        which = sys.argv[1]
        if which == "file":
            io.atomic_write_with({str(tmp_path / 'r.json')!r}, slow)
        else:
            io.atomic_write_dir({str(tmp_path / 'prof')!r}, slow, kind="profile")
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(io.__file__).parents[1])}
    for which in ("file", "dir"):
        proc = subprocess.Popen([sys.executable, "-c", script, which], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    after = tree(tmp_path)
    leftovers = {k for k in after if k.startswith(".")}
    assert {k: v for k, v in after.items() if k.split("/")[0] not in leftovers} == before
    # ... and the next run still recognises the folder as ours and replaces it
    io.atomic_write_dir(tmp_path / "prof", lambda d: (d / "a.txt").write_text("v2"), kind="profile")
    assert (tmp_path / "prof" / "a.txt").read_text() == "v2"


def test_publish_file_moves_only_the_named_file(tmp_path):
    (tmp_path / "X.json").write_text("sibling")
    src = tmp_path / "work.json"
    src.write_text("result")
    io.publish_file(src, tmp_path / "X.md")
    assert (tmp_path / "X.md").read_text() == "result" and (tmp_path / "X.json").read_text() == "sibling"
    assert not src.exists()


def test_distinct_outputs(tmp_path):
    io.check_distinct_outputs(out=tmp_path / "a", expert_map=tmp_path / "b", report=None)
    with pytest.raises(EdgeMoEError, match="--out and --expert-map name the same file"):
        io.check_distinct_outputs(out=tmp_path / "a", expert_map=tmp_path / "." / "a")


def test_read_json_errors_name_the_file(tmp_path):
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(EdgeMoEError, match="bad.json: placement is not UTF-8"):
        io.read_json(tmp_path / "bad.json", "placement")
    with pytest.raises(EdgeMoEError, match="missing.json: placement not found"):
        io.read_json(tmp_path / "missing.json", "placement")


# ------------------------------------------------------------------------------------------- folders


def _fill(text: str):
    def writer(d: Path) -> None:
        (d / "meta.json").write_text(text)

    return writer


def test_new_folder_is_marked_and_replaced_on_the_next_run(tmp_path):
    out = tmp_path / "prof"
    io.atomic_write_dir(out, _fill("v1"), kind="profile")
    marker = json.loads((out / io.MARKER).read_text())
    assert marker["kind"] == "profile" and marker["files"] == ["meta.json"]
    io.atomic_write_dir(out, _fill("v2"), kind="profile")
    assert (out / "meta.json").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prof"]  # nothing left beside it


def test_an_empty_folder_is_used(tmp_path):
    (tmp_path / "out").mkdir()
    io.atomic_write_dir(tmp_path / "out", _fill("v"), kind="profile")
    assert (tmp_path / "out" / "meta.json").read_text() == "v"


@pytest.mark.parametrize("case", ["foreign", "ours-plus-a-user-file", "other-kind", "a-file"])
def test_folders_that_are_not_ours_are_never_replaced(tmp_path, case):
    out = tmp_path / "out"
    if case == "a-file":
        out.write_text("user data")
    elif case == "foreign":
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "sub").mkdir()
        (out / "sub" / "weights.bin").write_bytes(b"\0" * 10)
    else:
        io.atomic_write_dir(out, _fill("ours"), kind="model" if case == "other-kind" else "profile")
        if case == "ours-plus-a-user-file":
            (out / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(EdgeMoEError, match="refusing|must be a folder"):
        io.atomic_write_dir(out, _fill("new"), kind="profile")
    with pytest.raises(EdgeMoEError):
        io.check_replaceable_dir(out, "profile")
    assert tree(tmp_path) == before


def test_legacy_outputs_are_recognised(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / "meta.json").write_text("legacy")
    io.atomic_write_dir(out, _fill("new"), kind="profile", recognise=lambda p: (p / "meta.json").read_text() == "legacy")
    assert (out / "meta.json").read_text() == "new"


def test_symlinked_folder_is_written_through(tmp_path):
    real = tmp_path / "real"
    io.atomic_write_dir(real, _fill("v1"), kind="profile")
    link = tmp_path / "link"
    link.symlink_to(real)
    io.atomic_write_dir(link, _fill("v2"), kind="profile")
    assert link.is_symlink() and (real / "meta.json").read_text() == "v2"


def test_interrupted_folder_writer_leaves_the_previous_folder_whole(tmp_path):
    out = tmp_path / "prof"
    io.atomic_write_dir(out, _fill("v1"), kind="profile")
    before = tree(tmp_path)

    def writer(d: Path) -> None:
        (d / "meta.json").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        io.atomic_write_dir(out, writer, kind="profile")
    assert tree(tmp_path) == before


def test_swap_without_renameat2_still_works(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "_exchange", lambda a, b: False)
    out = tmp_path / "prof"
    io.atomic_write_dir(out, _fill("v1"), kind="profile")
    io.atomic_write_dir(out, _fill("v2"), kind="profile")
    assert (out / "meta.json").read_text() == "v2" and sorted(p.name for p in tmp_path.iterdir()) == ["prof"]


def test_exchange_swaps_atomically(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    if not io._exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) not supported here")
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_a_legacy_report_folder_keeps_being_ours(tmp_path):
    """Claimed through `recognise` once (no marker yet), the folder's files are recorded: a second
    claim needs no recognition."""
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("# edgemoe report")
    (out / "results.json").write_text("{}")
    io.claim_output_dir(out, "report", ("report.md",), recognise=lambda p: True)
    io.claim_output_dir(out, "report", ("report.md",))
    assert set(json.loads((out / io.MARKER).read_text())["files"]) == {"report.md", "results.json"}


def test_claimed_folder_accepts_only_our_files(tmp_path):
    out = io.claim_output_dir(tmp_path / "rep", "report", ("report.md", "*.png"))
    (out / "report.md").write_text("r")
    (out / "a.png").write_bytes(b"png")
    (out / ".report.md.abc.tmp").write_text("left by a killed run")
    io.claim_output_dir(tmp_path / "rep", "report", ("report.md", "*.png"))  # ours: fine
    (out / ".notes.txt.tmp").write_text("a user's hidden file is not one of our temporaries")
    with pytest.raises(EdgeMoEError, match="notes"):
        io.claim_output_dir(tmp_path / "rep", "report", ("report.md", "*.png"))
    (out / ".notes.txt.tmp").unlink()
    (out / "thesis.tex").write_text("mine")
    with pytest.raises(EdgeMoEError, match="thesis.tex"):
        io.claim_output_dir(tmp_path / "rep", "report", ("report.md", "*.png"))
    user = tmp_path / "docs"
    user.mkdir()
    (user / "report.md").write_text("my own report")
    with pytest.raises(EdgeMoEError, match="not an edgemoe report"):
        io.claim_output_dir(user, "report", ("report.md",))
    assert (user / "report.md").read_text() == "my own report" and not (user / io.MARKER).exists()


# ---------------------------------------------------------------------------------- guarded reads


def test_reader_refuses_devices_fifos_and_folders_without_opening_them(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening a FIFO would block: the reader must not
    (tmp_path / "link").symlink_to("/dev/zero")
    for path, kind in (("/dev/zero", "a device"), (tmp_path / "fifo", "a FIFO"), (tmp_path / "link", "a device"),
                       (tmp_path, "a folder")):
        with pytest.raises(EdgeMoEError, match=kind):
            io.read_text(path, "cluster file")
        with pytest.raises(EdgeMoEError, match=kind):
            list(io.read_lines(path, "trace file"))


def test_reader_size_cap_is_checked_before_reading(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: 2 GiB on paper, nothing on disk
        f.truncate(2 << 30)
    with pytest.raises(EdgeMoEError, match=r"big.json: the results file is 2,048 MiB, more than the 256 MiB"):
        io.read_json(big, "results file")
    small = tmp_path / "t.jsonl"
    small.write_text('{"a": 1}\n' * 10)
    with pytest.raises(EdgeMoEError, match="more than the 50 bytes"):
        list(io.read_lines(small, "trace file", limit=50))
    with pytest.raises(EdgeMoEError, match=r"t.jsonl:1: a line longer than 5 bytes"):
        list(io.read_lines(small, "trace file", line_limit=5))


def test_gzip_damage_is_named_with_the_line(tmp_path):
    import gzip
    import zlib

    text = "".join(f'{{"i": {i}, "pad": "{"x" * (i % 50)}"}}\n' for i in range(20_000)).encode()
    whole = gzip.compress(text, mtime=0)
    assert [t for _, t in io.read_lines(_put(tmp_path / "ok.jsonl.gz", whole))] == text.decode().splitlines(True)
    cut = _put(tmp_path / "cut.jsonl.gz", whole[: len(whole) // 2])
    with pytest.raises(EdgeMoEError, match=r"cut.jsonl.gz:\d+: the trace file is damaged \(EOFError"):
        list(io.read_lines(cut, "trace file"))
    # a deflate block whose header is invalid: zlib.error, not an internal error
    raw = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = raw.compress(text[:1000]) + raw.flush(zlib.Z_FULL_FLUSH)
    bad = gzip.compress(b"", mtime=0)[:10] + body + b"\xff" * 64
    with pytest.raises(EdgeMoEError, match=r"bad.gz:\d+: the trace file is damaged \((zlib\.)?error"):
        list(io.read_lines(_put(tmp_path / "bad.gz", bad), "trace file"))
    with pytest.raises(EdgeMoEError, match="not-gz.gz:1: the trace file is damaged"):
        list(io.read_lines(_put(tmp_path / "not-gz.gz", b"plain"), "trace file"))


def _put(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_stdin_is_read_only_when_asked(tmp_path, monkeypatch):
    import io as stdio

    class Stdin:
        buffer = stdio.BufferedReader(stdio.BytesIO(b'{"a": 1}\n{"a": 2}\n'))

    monkeypatch.setattr("sys.stdin", Stdin)
    assert [n for n, _ in io.read_lines("-", "trace file")] == [1, 2]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EdgeMoEError, match="-: placement not found"):  # a file called "-" for other inputs
        io.read_json("-", "placement")


@pytest.mark.parametrize(("text", "message"), [
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    ("[" * 65 + "]" * 65, "nested deeper than 64"),
    ('{"n": ' + "7" * 5000 + "}", "an integer of 5000 digits"),
    ('{"n": ' + "7" * 41 + "}", "an integer of 41 digits"),
    ('{"n": 1,\n "m": }', r"x.json:2: invalid JSON"),
])
def test_json_limits(tmp_path, text, message):
    with pytest.raises(EdgeMoEError, match=message):
        io.read_json(_put(tmp_path / "x.json", text.encode()), "placement")


def test_json_within_the_limits_reads_as_before(tmp_path):
    doc = {"a": [[[1.5e300, -(2**63)]]], "b": {"c": None, "d": "x" * 1000}, "e": 2**64}
    assert io.read_json(_put(tmp_path / "x.json", json.dumps(doc).encode())) == doc


@pytest.mark.parametrize(("text", "message"), [
    ("a: " + "[" * 100_000, "nested too deep"),
    ("a: " + "1" * 5000, "an integer of 5000 digits"),
    ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)), "more than 2,000,000 values"),
    ("a: [1,\n  2\n  b: 3", r"c.yaml:\d+: cannot parse the YAML"),
])
def test_yaml_limits(text, message):
    with pytest.raises(EdgeMoEError, match=message):
        io.loads_yaml(text, "c.yaml")


def test_toml_limits():
    with pytest.raises(EdgeMoEError, match="integer of thousands of digits"):
        io.loads_toml("a = " + "1" * 5000, "c.toml")
    with pytest.raises(EdgeMoEError, match="nested too deep"):
        io.loads_toml("a = " + "[" * 100_000 + "]" * 100_000, "c.toml")


# ------------------------------------------------------------------------------- outputs (issue 22)


def test_a_250_byte_output_name_works(tmp_path):
    name = "r" * 245 + ".json"
    assert len(name.encode()) == 250
    io.atomic_write_json(tmp_path / name, {"x": 1})
    io.atomic_write_json(tmp_path / name, {"x": 2})  # replacing it too
    assert json.loads((tmp_path / name).read_text()) == {"x": 2}
    folder = tmp_path / ("é" * 125)  # 250 bytes of two-byte characters: the cut never splits one
    io.atomic_write_dir(folder, lambda t: (t / "a.txt").write_text("a"), kind="profile")
    io.atomic_write_dir(folder, lambda t: (t / "a.txt").write_text("b"), kind="profile")
    assert (folder / "a.txt").read_text() == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, folder.name])
    assert all(len(io.temp_prefix(n).encode()) + 12 <= io.NAME_MAX for n in (name, folder.name, "x" * 300))


def _fill_disk(_tmp: Path) -> None:
    """A writer whose disk is full: /dev/full answers every write with ENOSPC and no file name."""
    with open("/dev/full", "wb") as f:
        f.write(b"x" * 10)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_disk_full_names_the_output_and_keeps_the_old_one(tmp_path):
    target = tmp_path / "placement.json"
    target.write_text("old")
    with pytest.raises(EdgeMoEError, match=r"placement.json: cannot write the output \(no space left on the device\)"):
        io.atomic_write_with(target, _fill_disk)
    with pytest.raises(EdgeMoEError, match=r"prof: cannot write the output \(no space left"):
        io.atomic_write_dir(tmp_path / "prof", _fill_disk, kind="profile")
    with pytest.raises(EdgeMoEError, match=r"rep: cannot write the output \(no space left"):
        io.write_into_dir(tmp_path / "rep", _fill_disk, kind="report")
    assert tree(tmp_path) == {"placement.json": b"old"}


def test_write_into_dir_is_all_or_nothing(tmp_path):
    def half(stage: Path) -> None:
        (stage / "a.png").write_text("a")
        raise EdgeMoEError("the second plot failed")

    with pytest.raises(EdgeMoEError, match="second plot"):
        io.write_into_dir(tmp_path / "rep", half, "report", ("*.png",))
    assert list(tmp_path.iterdir()) == []  # not even created
    io.write_into_dir(tmp_path / "rep", lambda s: (s / "a.png").write_text("1"), "report", ("*.png",))
    with pytest.raises(EdgeMoEError, match="second plot"):
        io.write_into_dir(tmp_path / "rep", half, "report", ("*.png",))
    assert (tmp_path / "rep" / "a.png").read_text() == "1"  # the earlier report is whole


def test_check_outputs_claims_every_output_the_same_way(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("{}\n")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "similarity.png").write_text("my figure")
    cases = [
        ({"--out": io.Output(trace, "profile")}, {"--trace": [trace]}, "--out .* is also the input --trace"),
        ({"--out": io.Output(trace)}, {"--cluster": str(trace)}, "is also the input --cluster"),
        ({"--out": io.Output(tmp_path / "d", "profile"), "--report": io.Output(tmp_path / "d", "report")}, {},
         "--out and --report name the same file"),
        ({"--out": io.Output(tmp_path / "p", "profile"), "--report": io.Output(tmp_path / "p" / "r", "report")}, {},
         "--report .* is inside the profile folder --out"),
        ({"--out": io.Output(tmp_path, "profile")}, {"--trace": [trace]}, "inside the profile folder --out .* replaced whole"),
        ({"--report": io.Output(mine, "profile report", action="write into")}, {}, "--report: .*refusing to write into"),
        ({"--out": io.Output("/dev/null")}, {}, "--out: /dev/null is a device"),
    ]
    for outputs, inputs, message in cases:
        with pytest.raises(EdgeMoEError, match=message):
            io.check_outputs(outputs, inputs)
    io.check_outputs({"--out": io.Output(tmp_path / "new.json"), "--expert-map": io.Output(None)}, {"--trace": [trace, "-"]})
    assert (mine / "similarity.png").read_text() == "my figure"


def test_jsonable_strict_writes_strict_json_and_loose_keeps_what_rebuilds_a_policy():
    import math
    from typing import NamedTuple

    import numpy as np

    class Pair(NamedTuple):
        a: float
        b: float

    obj = {1: np.float64(0.5), "nan": np.nan, "arr": np.array([1.0, np.inf]), "tup": (np.int64(2), np.nan),
           "nested": [{"x": np.float32(0.25)}], "pair": Pair(np.float64(1.0), 2.0)}
    strict = io.jsonable(obj)
    assert strict == {"1": 0.5, "nan": None, "arr": [1.0, None], "tup": [2, None], "nested": [{"x": 0.25}],
                      "pair": [1.0, 2.0]}
    json.dumps(strict, allow_nan=False)  # strict JSON
    assert all(type(v) is not np.float64 for v in (strict["1"], strict["tup"][0]))
    loose = io.jsonable(obj, strict=False)
    assert set(loose) == {1, "nan", "arr", "tup", "nested", "pair"}
    assert math.isnan(loose["nan"]) and loose["arr"][1] == math.inf
    assert type(loose["tup"]) is tuple and loose["tup"][0] == 2 and type(loose["tup"][0]) is int
    assert type(loose["pair"]) is Pair and type(loose["pair"].a) is float
    assert type(loose[1]) is float and type(loose["nested"][0]["x"]) is float
