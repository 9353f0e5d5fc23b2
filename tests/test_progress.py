"""Progress bars: a bar with an ETA on a terminal, nothing at all when stderr is not one."""

from __future__ import annotations

import io
import sys
import time

from edgemoe import progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_bar_off_the_terminal(capsys):
    assert not progress.interactive()  # pytest's captured stderr is not a terminal
    assert list(progress.bar(range(5), desc="work")) == list(range(5))
    with progress.ticker("solve", total_s=1.0):
        time.sleep(0.01)
    log = progress.StepLog(2, "methods", lambda line: line.startswith("  "))
    log("  a done")
    log.close()
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == "  a done\n"


def test_bar_with_eta_on_a_terminal(monkeypatch):
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.delenv("EDGEMOE_PROGRESS", raising=False)
    assert progress.interactive()
    b = progress.bar(total=4, desc="train", unit="step")
    b.update(2)
    b.refresh()
    b.close()
    shown = term.getvalue()
    assert "train" in shown and "2/4" in shown and "<" in shown  # elapsed<remaining: the ETA


def test_ticker_counts_seconds_towards_the_limit(monkeypatch):
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    with progress.ticker("planning with exact", total_s=30.0, every_s=0.01):
        # until the ticker thread has drawn once (a fixed 0.05 s sleep missed every tick at load 36)
        give_up = time.monotonic() + 120.0
        while "left" not in term.getvalue() and time.monotonic() < give_up:
            time.sleep(0.01)
    assert "planning with exact" in term.getvalue() and "left" in term.getvalue()


def test_opt_out_and_third_party_quiet(monkeypatch):
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    monkeypatch.setenv("EDGEMOE_PROGRESS", "0")
    assert not progress.interactive()
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    progress.quiet_unless_terminal()
    import os

    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"


def test_step_log_advances_only_on_step_lines(monkeypatch, capsys):
    monkeypatch.setattr(progress, "interactive", lambda: True)
    with progress.StepLog(3, "methods", lambda line: " ms" in line) as log:
        log("comparison x")
        log("  m1 mean 2.0 ms")
        assert log.bar.n == 1
