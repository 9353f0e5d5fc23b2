"""Progress bars with an ETA on a terminal, silence in logs.

Every bar goes to stderr and only when stderr is a terminal (and EDGEMOE_PROGRESS is not "0"): a CI log
or `2> file` gets no bar and no carriage-return noise. `say` prints a line without tearing a live bar.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator


def interactive() -> bool:
    """True when bars should be drawn: stderr is a terminal and EDGEMOE_PROGRESS is not "0"."""
    if os.environ.get("EDGEMOE_PROGRESS") == "0":
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stderr
        return False


def quiet_unless_terminal() -> None:
    """Turn off third-party bars (tqdm in transformers, huggingface_hub) when stderr is not a terminal."""
    if interactive():
        return
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        with contextlib.suppress(Exception):
            sys.modules["transformers"].utils.logging.disable_progress_bar()


def bar(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it"):
    """A tqdm bar (count, rate, ETA) over `iterable` on a terminal; a silent pass-through otherwise."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=not interactive(),
                leave=False, dynamic_ncols=True)


def say(message: str) -> None:
    """Print a line on stdout, above any live bar."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stdout)


@contextlib.contextmanager
def ticker(desc: str, total_s: float | None = None, every_s: float = 0.25) -> Iterator[None]:
    """A bar of elapsed seconds while the body runs (work that reports no steps, e.g. a solver).

    total_s: a known upper bound (a solver's time limit, a load run's duration), which gives the ETA;
    None shows elapsed time only. Off the terminal this does nothing.
    """
    if not interactive():
        yield
        return
    b = bar(total=total_s, desc=desc, unit="s")
    b.bar_format = "{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed, at most {remaining} left" if total_s else \
        "{desc}: {elapsed} elapsed"
    stop = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not stop.wait(every_s):
            b.n = min(time.monotonic() - start, total_s) if total_s else time.monotonic() - start
            b.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        b.close()


class StepLog:
    """A `log` callback for library functions that report each finished step as a line: lines are
    printed (`say`), and those for which `is_step(line)` holds advance a bar of `total` steps."""

    def __init__(self, total: int, desc: str, is_step: Callable[[str], bool]):
        self.bar = bar(total=total, desc=desc, unit="step")
        self.is_step = is_step

    def __call__(self, message: str) -> None:
        say(message)
        if self.is_step(message):
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
