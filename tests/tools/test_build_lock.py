"""One command at a time writes a checkout: a second build (or push, pop, new, refresh, import, export,
rebase, cache fill) waits for the first, naming it once, or refuses with --lock-timeout; a refused or
waiting command changes nothing. The holder is a real second process; the waiting or refused command
is the real CLI script (tools/apply_patches.py) in another process where the timing matters."""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from nam56r_patchlane.checkout_lock import CHECKOUT_LOCK_RELATIVE_PATH, EXIT_LOCK_BUSY, checkout_lock, read_holder
from nam56r_patchlane.cli import build_parser
from nam56r_patchlane.environment import write_build_record
from nam56r_patchlane.noxsupport import session_build_options
from patchlane_testlib import Lane

TOOLS = Path(__file__).resolve().parents[2] / "tools"
HOLDER_COMMAND = "apply_patches.py build (the first build)"
HOLDER = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(TOOLS)!r})
from nam56r_patchlane.checkout_lock import checkout_lock
with checkout_lock(Path(sys.argv[1]), command={HOLDER_COMMAND!r}):
    print("HELD", flush=True)
    sys.stdin.readline()  # holds until the test closes stdin (or kills it)
"""


class LockHolder:
    """Another process holding the checkout's lock until release() (or kill())."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "HELD"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def holder_factory():
    holders: list[LockHolder] = []

    def make(root: Path) -> LockHolder:
        holders.append(LockHolder(root))
        return holders[-1]

    yield make
    for holder in holders:
        if holder.proc.poll() is None:
            holder.kill()


def cli(lane: Lane, *args: str) -> list[str]:
    """The real script, as a user runs it."""
    return [sys.executable, str(TOOLS / "apply_patches.py"), "--root", str(lane.root), "--cache", str(lane.cache), "--offline",
            "--python", sys.executable, *args]


def build_cli(lane: Lane, *args: str) -> list[str]:
    return cli(lane, "build", "--no-install", "--profile", "cpu", *args)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (the trees' .git included) by content, the lock file aside."""
    lock = root / CHECKOUT_LOCK_RELATIVE_PATH
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p != lock}


def popped(lane: Lane) -> Lane:
    """A built root with its series popped: a build now has work to do (it applies 3 patches)."""
    assert lane.run("pop", "--all", "-u", "fakeup").code == 0
    assert lane.state()["applied"] == []
    return lane


def test_a_second_build_with_lock_timeout_0_refuses_at_once_naming_the_holder_and_changes_nothing(
    built: Lane, holder_factory
) -> None:
    lane = popped(built)
    before = snapshot(lane.root)
    holder = holder_factory(lane.root)

    start = time.monotonic()
    proc = subprocess.run(build_cli(lane, "--lock-timeout", "0"), capture_output=True, text=True, timeout=60)

    assert proc.returncode == EXIT_LOCK_BUSY, proc.stdout + proc.stderr
    assert time.monotonic() - start < 20
    assert f"pid {holder.pid} (`{HOLDER_COMMAND}`) since " in proc.stderr
    assert "refused at once (--lock-timeout 0), nothing was changed" in proc.stderr
    assert f"kill {holder.pid}" in proc.stderr
    assert snapshot(lane.root) == before
    assert lane.state()["applied"] == []


def test_a_second_build_waits_for_the_first_saying_so_once_then_builds(built: Lane, holder_factory) -> None:
    lane = popped(built)
    before = snapshot(lane.root)
    holder = holder_factory(lane.root)
    second = subprocess.Popen(build_cli(lane), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in second.stderr], daemon=True).start()

    notice = lines.get(timeout=60)
    time.sleep(1.5)  # it keeps waiting, and touches nothing meanwhile

    assert notice.startswith(f"waiting for the checkout {lane.root}: ")
    assert f"held by pid {holder.pid} (`{HOLDER_COMMAND}`)" in notice
    assert "Ctrl-C stops waiting and changes nothing" in notice and "--lock-timeout SECONDS" in notice
    assert second.poll() is None
    assert snapshot(lane.root) == before

    holder.release()
    out, _ = second.communicate(timeout=120)
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert second.returncode == 0, out + "".join(rest)
    assert not any(line.startswith("waiting for") for line in rest)  # said once
    assert [a["name"] for a in lane.state()["applied"]] == lane.series_names()
    assert read_holder(lane.root / CHECKOUT_LOCK_RELATIVE_PATH) is None  # released: nobody is named


def test_lock_timeout_waits_that_long_then_refuses(built: Lane, holder_factory) -> None:
    lane = popped(built)
    before = snapshot(lane.root)
    holder_factory(lane.root)

    start = time.monotonic()
    proc = subprocess.run(build_cli(lane, "--lock-timeout", "1.5"), capture_output=True, text=True, timeout=60)

    assert proc.returncode == EXIT_LOCK_BUSY, proc.stdout + proc.stderr
    assert time.monotonic() - start >= 1.5
    assert proc.stderr.count("waiting for the checkout") == 1 and "waiting up to 1.5s" in proc.stderr
    assert "gave up after waiting 1.5s (--lock-timeout), nothing was changed" in proc.stderr
    assert snapshot(lane.root) == before


def test_a_holder_that_died_never_blocks(built: Lane, holder_factory) -> None:
    lane = popped(built)
    holder = holder_factory(lane.root)
    holder.kill()
    assert read_holder(lane.root / CHECKOUT_LOCK_RELATIVE_PATH).pid == holder.pid  # its record is left behind

    proc = subprocess.run(build_cli(lane, "--lock-timeout", "0"), capture_output=True, text=True, timeout=120)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [a["name"] for a in lane.state()["applied"]] == lane.series_names()


def test_a_build_inside_a_held_lock_of_the_same_process_does_not_deadlock(built: Lane) -> None:
    lane = popped(built)

    with checkout_lock(lane.root, timeout=0):
        result = lane.build("--lock-timeout", "0")  # a second, non-re-entrant acquisition would refuse here
        assert read_holder(lane.root / CHECKOUT_LOCK_RELATIVE_PATH).pid == os.getpid()  # still held after the inner release

    assert result.code == 0, result.text
    assert [a["name"] for a in lane.state()["applied"]] == lane.series_names()
    assert read_holder(lane.root / CHECKOUT_LOCK_RELATIVE_PATH) is None


WRITING_COMMANDS = {
    "push": ["push", "-u", "fakeup"],
    "pop": ["pop", "-u", "fakeup"],
    "new": ["new", "scratch", "-u", "fakeup", "--subject", "s", "--category", "bugfix", "--retire-when", "r",
            "--upstream-tests", "none: t", "--why", "w"],
    "refresh": ["refresh", "-u", "fakeup"],
    "import": ["import", "{patch}", "-u", "fakeup"],
    "export": ["export", "-u", "fakeup"],
    "rebase": ["rebase", "-u", "fakeup", "--to", "upstream"],
    "cache fill": ["cache", "fill", "{cache}", "--artifacts-only"],
}


@pytest.mark.parametrize("command", list(WRITING_COMMANDS))
def test_every_command_that_writes_the_checkout_refuses_while_it_is_held(built: Lane, holder_factory, command: str) -> None:
    with (built.tree / "fakeup" / "core.py").open("a") as handle:
        handle.write("# an edit new/refresh would take\n")
    patch = built.root / "outside.patch"
    patch.write_text(built.fake.series["0001-core-scale.patch"])
    args = [a.format(patch=patch, cache=built.root / "fill") for a in WRITING_COMMANDS[command]]
    before = snapshot(built.root)
    holder = holder_factory(built.root)

    result = built.run(*args, "--lock-timeout", "0")

    assert result.code == EXIT_LOCK_BUSY, result.text
    assert f"pid {holder.pid}" in result.err and "nothing was changed" in result.err
    assert snapshot(built.root) == before


@pytest.mark.parametrize("args", [["status"], ["series"], ["manifest", "list"], ["check"]])
def test_commands_that_only_read_do_not_wait(built: Lane, holder_factory, args: list[str]) -> None:
    holder_factory(built.root)

    result = built.run(*args, "--lock-timeout", "0")

    assert result.code in (0, 1), result.text  # check reports the fixture's missing packs; it does not wait
    assert "the checkout" not in result.err


def test_help_explains_the_lock() -> None:
    parser = build_parser()
    build_help = parser._subparsers._group_actions[0].choices["build"].format_help()

    assert "--lock-timeout SECONDS" in build_help and "third_party/.patchlane.lock" in build_help
    assert "0: refuses at once, exit 75" in " ".join(build_help.split())
    assert "waits, naming the holder" in " ".join(parser.format_help().split())


def test_nox_passes_lock_timeout_through_beside_the_replayed_offline_options(tmp_path: Path) -> None:
    env = tmp_path / "venv"
    env.mkdir()
    write_build_record(env, {"cache": str(tmp_path / "cache"), "offline": True, "profile": "cpu", "base_python": None})
    recorded = ["--cache", str(tmp_path / "cache"), "--offline", "--profile", "cpu"]

    assert session_build_options(env, ["--lock-timeout", "0"])[0] == [*recorded, "--lock-timeout", "0"]
    assert session_build_options(env, ["--lock-timeout=5"])[0] == [*recorded, "--lock-timeout=5"]
    assert session_build_options(env, ["--profile", "gpu", "--lock-timeout", "0"])[0] == ["--profile", "gpu", "--lock-timeout", "0"]
