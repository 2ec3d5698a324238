"""The startup marks: one time zero for the launcher and its ranks, lines only from rank 0, read back from a log."""

from __future__ import annotations

import os
import time

import pytest

from nam56r.training.launcher.startup_marks import STARTUP_T0_ENV, mark, process_started, read_marks, start_clock


def test_the_launcher_sets_the_time_zero_unless_its_caller_did() -> None:
    env: dict[str, str] = {}
    before = time.time()
    t0 = start_clock(env)
    assert before <= t0 <= time.time() and float(env[STARTUP_T0_ENV]) == t0
    assert start_clock({STARTUP_T0_ENV: "1234.5"}) == 1234.5
    with pytest.raises(ValueError, match=f"{STARTUP_T0_ENV}='soon' is not a time in seconds since the epoch"):
        start_clock({STARTUP_T0_ENV: "soon"})


def test_marks_print_seconds_since_the_time_zero_on_rank_0_only(capsys) -> None:
    t0 = time.time() - 12.34
    mark("rank 0 imported torch, Megatron and NAM56R's modules", env={STARTUP_T0_ENV: repr(t0)})
    mark("launcher: torchrun started", env={STARTUP_T0_ENV: repr(t0), "RANK": "0"})
    mark("a rank 1 line", env={STARTUP_T0_ENV: repr(t0), "RANK": "1"})
    mark("no time zero", env={})
    mark("a mark at a given time", at=t0 + 3.0, env={STARTUP_T0_ENV: repr(t0)})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    marks = read_marks(["noise", *lines, "[startup +99.0 s] launcher: torchrun started"])  # the first of each counts
    assert list(marks) == ["rank 0 imported torch, Megatron and NAM56R's modules", "launcher: torchrun started", "a mark at a given time"]
    assert 12.3 <= marks["launcher: torchrun started"] <= 12.6 and marks["a mark at a given time"] == 3.0


def test_a_mark_once_prints_once_per_process(capsys) -> None:
    env = {STARTUP_T0_ENV: repr(time.time())}
    for _ in range(3):
        mark("first micro-batch: forward begins (test)", once=True, env=env)
    assert capsys.readouterr().out.count("forward begins (test)") == 1


def test_a_process_start_is_read_from_proc() -> None:
    started = process_started()
    if not os.path.exists("/proc/self/stat"):
        assert started is None
        return
    assert started is not None and 0 <= time.time() - started < 3600
    assert process_started(2**31) is None  # no such process
