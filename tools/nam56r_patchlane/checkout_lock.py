"""Exclusive advisory locks (flock) that keep two commands from writing the same files at once.

`checkout_lock(root)` guards everything the patch lane writes in a checkout: third_party/ trees,
the target environment (.venv) and the artifact cache. A second command waits for the first,
saying once who holds the lock, or refuses after `timeout` seconds (0: at once) with
LockBusyError, before it has changed anything. The lock file records its holder's pid, command
and start time for that message; the kernel releases a flock when its holder exits, however it
exits, so a holder that died never blocks anyone (what it recorded is then simply overwritten).

Locks are re-entrant within one process (a build that runs a series operation takes the same
lock again), not between threads: a second thread of the holding process shares the hold.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchlaneError

CHECKOUT_LOCK_RELATIVE_PATH = Path("third_party/.patchlane.lock")
EXIT_LOCK_BUSY = 75  # sysexits EX_TEMPFAIL: try again later
_POLL_S = 0.1
_COMMAND_SHOWN = 200  # characters of the holder's command line in messages

_registry_guard = threading.Lock()
_held: dict[tuple[str, int], list[int]] = {}  # (lock file, thread) -> [file descriptor, depth]


class LockBusyError(PatchlaneError):
    """Another process held the lock for longer than the caller would wait; nothing was changed."""


@dataclass(frozen=True)
class Holder:
    """What a lock's holder recorded in the lock file."""

    pid: int
    command: str
    since: str  # UTC, ISO 8601
    started: float  # time.time() at acquisition

    def describe(self) -> str:
        ago = max(time.time() - self.started, 0.0)
        command = " ".join(self.command.split())  # one line, however it was typed
        command = command if len(command) <= _COMMAND_SHOWN else command[: _COMMAND_SHOWN - 3] + "..."
        return f"pid {self.pid} (`{command}`) since {self.since} ({ago:.0f}s ago)"


def read_holder(path: Path) -> Holder | None:
    """The holder recorded in `path`, or None when none is recorded (released, or not written yet)."""
    try:
        raw = json.loads(path.read_text() or "null")
        return Holder(pid=int(raw["pid"]), command=str(raw["command"]), since=str(raw["since"]), started=float(raw["started"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host; one of another user counts (signal 0 is refused, not unanswered)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _current_holder(path: Path) -> Holder | None:
    """The recorded holder, if that process is alive. A new holder writes its record right after it gets the lock,
    so an empty or dead record is read again briefly before giving up on it."""
    for _ in range(10):
        holder = read_holder(path)
        if holder is not None and process_alive(holder.pid):
            return holder
        time.sleep(0.05)
    return None


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def this_command() -> str:
    """This process's command line as it was typed (`python tools/apply_patches.py build`, `python -m pytest ...`)."""
    argv = list(sys.orig_argv) or [sys.executable]
    return " ".join(shlex.quote(a) for a in [Path(argv[0]).name, *argv[1:]])


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _busy_error(path: Path, what: str, timeout: float) -> LockBusyError:
    holder = _current_holder(path)
    by = holder.describe() if holder else "another process (it recorded no pid)"
    stop = f"kill {holder.pid}" if holder else f"fuser -v {path}"
    waited = "refused at once (--lock-timeout 0)" if timeout == 0 else f"gave up after waiting {timeout:g}s (--lock-timeout)"
    return LockBusyError(
        f"{what} is in use: {path} is held by {by}; {waited}, nothing was changed",
        f"run again when it has finished; without --lock-timeout the command waits for it (if it is stuck, stop it: `{stop}`)",
        exit_code=EXIT_LOCK_BUSY,
    )


def _acquire(path: Path, what: str, timeout: float | None, notice_after: float, wait_hint: str, log: Callable[[str], None]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        start = time.monotonic()
        told = False
        while not _try_flock(fd):
            waited = time.monotonic() - start
            if timeout is not None and waited >= timeout:
                raise _busy_error(path, what, timeout)
            if not told and waited >= notice_after:
                holder = _current_holder(path)
                by = holder.describe() if holder else "another process (it recorded no pid)"
                limit = f"up to {timeout:g}s" if timeout is not None else "until it finishes"
                log(f"waiting for {what}: {path} is held by {by}; waiting {limit} (Ctrl-C stops waiting and changes nothing{wait_hint})")
                told = True
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        os.close(fd)
        raise LockBusyError(f"stopped waiting for {what} ({path}); nothing was changed", exit_code=130) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _record(fd: int, command: str) -> None:
    now = time.time()
    since = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    data = json.dumps({"pid": os.getpid(), "command": command, "since": since, "started": now}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data + b"\n", 0)


@contextlib.contextmanager
def held_exclusively(
    path: Path, what: str, timeout: float | None = None, command: str | None = None,
    notice_after: float = 0.0, wait_hint: str = "", log: Callable[[str], None] = _stderr,
) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the block; re-entrant within a thread.

    timeout: seconds to wait for another holder (None: as long as it takes; 0: refuse at once), then LockBusyError.
    notice_after: seconds of waiting before the one line that names the holder (and `wait_hint`) is logged."""
    if timeout is not None and timeout < 0:
        raise PatchlaneError(f"--lock-timeout {timeout:g}: must be 0 (refuse at once) or more seconds")
    # Per thread: a nested use in one thread re-enters; another thread of this process opens its own
    # descriptor, whose flock waits like another process's (two threads appending to the manifest at once).
    key = (str(path.resolve()), threading.get_ident())
    with _registry_guard:
        entry = _held.get(key)
        if entry is not None:
            entry[1] += 1
    if entry is None:
        fd = _acquire(path, what, timeout, notice_after, wait_hint, log)
        _record(fd, command or this_command())
        with _registry_guard:
            _held[key] = entry = [fd, 1]
    try:
        yield
    finally:
        with _registry_guard:
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                del _held[key]
        if last:
            os.ftruncate(entry[0], 0)  # released: no holder to name
            os.close(entry[0])  # closing the only descriptor releases the flock


def checkout_lock(root: Path, timeout: float | None = None, command: str | None = None) -> contextlib.AbstractContextManager[None]:
    """The lock of the checkout at `root`: held while a command writes its third_party/ trees, .venv or the cache."""
    return held_exclusively(root / CHECKOUT_LOCK_RELATIVE_PATH, f"the checkout {root}", timeout, command,
                            wait_hint="; --lock-timeout SECONDS bounds the wait, 0 refuses at once")
