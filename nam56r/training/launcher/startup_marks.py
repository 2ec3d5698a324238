"""Where a run's time to its first step goes: marks from the launcher and rank 0 on one clock.

The launcher takes its start as the run's time zero (or the one its caller set in `STARTUP_T0_ENV`, as the
compile-tax bench does with its own start) and hands it to torchrun's ranks in the same variable. Each mark
prints one line, ``[startup +12.3 s] what``, seconds since that zero on the wall clock every process of the
node shares; ranks other than 0 print none. `read_marks` collects them from a log.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

STARTUP_T0_ENV = "NAM56R_STARTUP_T0"  # the run's time zero, seconds since the epoch
MARK = re.compile(r"\[startup \+(?P<seconds>[0-9]+\.[0-9]) s\] (?P<what>.+?)\s*$")


def start_clock(env: MutableMapping[str, str] = os.environ) -> float:
    """The run's time zero: `STARTUP_T0_ENV` when the caller set it, else now, written there for the ranks."""
    if (given := env.get(STARTUP_T0_ENV)) is not None:
        try:
            return float(given)
        except ValueError:
            raise ValueError(f"{STARTUP_T0_ENV}={given!r} is not a time in seconds since the epoch") from None
    now = time.time()
    env[STARTUP_T0_ENV] = repr(now)
    return now


_MARKED: set[str] = set()


def mark(what: str, *, at: float | None = None, once: bool = False, env: Mapping[str, str] = os.environ) -> None:
    """Print `what` with the seconds from the run's time zero to `at` (a `time.time()`, default now); nothing
    without a time zero, on ranks other than 0, or with `once` for a `what` this process marked already."""
    t0 = env.get(STARTUP_T0_ENV)
    if t0 is None or env.get("RANK", "0") != "0" or (once and what in _MARKED):
        return
    _MARKED.add(what)
    print(f"[startup +{(time.time() if at is None else at) - float(t0):.1f} s] {what}", flush=True)


def process_started(pid: int | str = "self") -> float | None:
    """When process `pid` started, seconds since the epoch, from Linux's /proc (None elsewhere): a rank's start,
    before the imports that are most of its start-up."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])  # since boot
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, IndexError, ValueError, AttributeError):
        return None
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def read_marks(lines: Iterable[str]) -> dict[str, float]:
    """{what: seconds} of the marks in `lines`, the first of each."""
    marks: dict[str, float] = {}
    for line in lines:
        if (found := MARK.search(line)) and found["what"] not in marks:
            marks[found["what"]] = float(found["seconds"])
    return marks
