"""nam56r.training.runs.logged_run on real processes: a timeout or a kill ends a command's whole process tree, also
the children that run in sessions of their own (as torchrun starts its ranks)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from nam56r.training.runs.logged_run import EXIT_TIMED_OUT, kill_tree, process_tree, run_logged

# A parent that starts a child in a new session (not holding the output pipe), prints the child's pid, then waits.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True,\n"
    "                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(300)\n"
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_timeout_kills_the_child_in_its_own_session_too(tmp_path: Path) -> None:
    log = tmp_path / "run.log"

    run = run_logged([sys.executable, "-c", PARENT], log, "t", tmp_path, timeout_s=5, echo=False)

    assert run.exit_code == EXIT_TIMED_OUT
    child = int(log.read_text().split()[0])
    assert _wait_gone(child), f"child {child} outlived the timeout"


def test_kill_tree_finds_and_kills_every_descendant(tmp_path: Path) -> None:
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert process_tree(parent.pid) == [parent.pid, child]

    killed = kill_tree(parent.pid)

    parent.wait(timeout=10)
    assert killed == [parent.pid, child] and parent.returncode == -9
    assert _wait_gone(child)
