"""Run a command with its output kept in a log file and echoed live under a prefix, within a time limit."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_TIMED_OUT = 124  # what coreutils' timeout(1) returns


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
        # Its own process group, so a timeout also ends what it started (torchrun's ranks hold the pipe too).
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
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = EXIT_TIMED_OUT
        except BaseException:  # Ctrl-C reaches only this process: its own group would run on
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        reader.join()
        if code == EXIT_TIMED_OUT:
            sink.write(f"(killed after {timeout_s:.0f} s)\n")
    return LoggedRun(command, code, time.monotonic() - started, log)
