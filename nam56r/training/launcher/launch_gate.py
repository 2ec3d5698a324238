"""The gate between the launcher and the ranks it starts, so that their start-up overlaps the launcher's checks.

`nam56r.training.launcher` starts `torchrun` first, then runs what only it does before a real run: Megatron's
parser over the lowered flags, the preflight, and building the data when it is missing. Meanwhile each rank
imports torch, Megatron, mamba_ssm and TileLang (tens of seconds), then waits in `wait_for_launch` before
Megatron parses a flag. The launcher writes the gate file once: ``go`` (the ranks continue) or ``stop`` and
the reason (each rank exits with `GATE_STOPPED_EXIT`, having built nothing). A rank whose launcher is gone
without a word stops too.

Without `GATE_ENV` (Slurm scripts, where no launcher process runs beside the ranks) a rank does not wait.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nam56r_patchlane.checkout_lock import process_alive

GATE_ENV = "NAM56R_LAUNCH_GATE"  # the gate file's path
LAUNCHER_PID_ENV = "NAM56R_LAUNCHER_PID"  # the launcher's process id, on the ranks' node
GATE_STOPPED_EXIT = 3
GO, STOP = "go", "stop"


class GateStopped(SystemExit):
    """The launcher refused the run, or is gone: the rank exits with GATE_STOPPED_EXIT after saying why."""

    def __init__(self, reason: str) -> None:
        print(f"error: the launcher stopped this run before Megatron started: {reason}", file=sys.stderr, flush=True)
        super().__init__(GATE_STOPPED_EXIT)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class LaunchGate:
    """The launcher's side: a gate file the ranks poll; `env` is what they need to find it."""

    path: Path

    @classmethod
    def fresh(cls, path: Path) -> LaunchGate:
        """A closed gate at `path` (a leftover file from an earlier launch into the same run dir is removed)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        return cls(path)

    def env(self) -> dict[str, str]:
        return {GATE_ENV: str(self.path), LAUNCHER_PID_ENV: str(os.getpid())}

    def open(self) -> None:
        self._write(GO)

    def refuse(self, reason: str) -> None:
        self._write(f"{STOP}\n{reason}")

    def _write(self, text: str) -> None:
        # Written whole, then renamed: a polling rank never reads half a verdict.
        partial = self.path.with_suffix(".partial")
        partial.write_text(text + "\n")
        partial.replace(self.path)


def wait_for_launch(env: Mapping[str, str] = os.environ, poll_s: float = 0.1) -> float | None:
    """The ranks' side: return once the launcher opens the gate (seconds waited; None without a gate); raise
    GateStopped when it refuses the run or its process is gone."""
    gate = env.get(GATE_ENV)
    if not gate:
        return None
    path, launcher = Path(gate), int(env.get(LAUNCHER_PID_ENV, "0"))
    start = time.monotonic()
    while True:
        launcher_gone = bool(launcher) and not process_alive(launcher)
        if path.exists():  # checked after the launcher: a verdict written just before it exited still counts
            verdict, _, reason = path.read_text().partition("\n")
            if verdict == GO:
                return time.monotonic() - start
            if verdict == STOP:
                raise GateStopped(reason.strip() or "no reason given")
            raise GateStopped(f"the gate file {path} holds {verdict!r}, neither {GO!r} nor {STOP!r}")
        if launcher_gone:
            raise GateStopped(f"the launcher (pid {launcher}) exited without opening the gate {path}")
        time.sleep(poll_s)
