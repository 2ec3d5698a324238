"""Run a command with its output kept in a log file and echoed live under a prefix, within a time limit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_TIMED_OUT = 124  # what coreutils' timeout(1) returns


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every process descended from it, parents first, from /proc. torchrun starts each
    rank in a session of its own, so a kill of the launcher's process group leaves the ranks running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, index = [root_pid], 0
    while index < len(tree):
        tree += children.get(tree[index], [])
        index += 1
    return tree


def kill_tree(root_pid: int) -> list[int]:
    """SIGKILL `root_pid` and all its descendants (found first, then killed: none can start another meanwhile
    unnoticed, as SIGSTOP holds each until the kill); the pids killed."""
    tree = process_tree(root_pid)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    tree = list(dict.fromkeys(tree + [p for pid in tree for p in process_tree(pid)]))  # forked before the stop
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return tree


@dataclass(frozen=True)
class LoggedRun:
    command: list[str]
    exit_code: int
    seconds: float
    log: Path

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace").splitlines() if self.log.is_file() else []
        return "\n".join(text[-lines:]) or "(no output)"


def run_logged(command: list[str], log: Path, prefix: str, cwd: Path, timeout_s: float | None = None,
               echo: bool = True) -> LoggedRun:
    """stdout and stderr, interleaved, to `log` and (when `echo`) to this process's stdout as
    '[prefix] line'. Past `timeout_s` the command is killed and the exit code is 124."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log.open("w") as sink:
        # Its own session, so Ctrl-C at the terminal reaches only us; a timeout kills its whole process tree.
        proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sink.write(line)
                sink.flush()
                if echo:
                    print(f"[{prefix}] {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            code = EXIT_TIMED_OUT
        except BaseException:  # Ctrl-C reaches only this process: what it started would run on
            kill_tree(proc.pid)
            raise
        reader.join()
        if code == EXIT_TIMED_OUT:
            sink.write(f"(killed after {timeout_s:.0f} s)\n")
    return LoggedRun(command, code, time.monotonic() - started, log)
