"""What noxfile.py takes from the patch lane: where a session's pip installs come from, and which build
options a session replays. Standard library only (nox's own interpreter has no GitPython).

An `--offline` build installs from its cache only. The build records how it built the environment
(environment.BUILD_RECORD in it); a session that builds without options of its own (tests, train, ...)
replays an offline build's cache and profile, so that on a machine without an index every session
installs from the same cache without being told again.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .artifacts import default_cache_dir
from .cachemanifest import WHEELS_DIR
from .environment import read_build_record

LOCK_OPTION = "--lock-timeout"  # apply_patches.py's: how long a build waits for the checkout's lock


@dataclass(frozen=True)
class InstallSource:
    """Where pip installs from: the user's index configuration, or an offline cache's wheels only."""

    offline_cache: Path | None

    def pip_args(self) -> list[str]:
        return ["--no-index", "--find-links", str(self.offline_cache / WHEELS_DIR)] if self.offline_cache else []


def install_source(options: Sequence[str]) -> InstallSource:
    """From apply_patches.py options (`--offline`, `--cache DIR`, anywhere among them)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--cache", type=Path, default=default_cache_dir())
    parser.add_argument("--offline", action="store_true")
    known, _ = parser.parse_known_args(list(options))
    return InstallSource(offline_cache=known.cache.resolve() if known.offline else None)


def recorded_build_options(env_dir: Path) -> list[str]:
    """The options an offline build of `env_dir` was made with ([] when it was built online or never)."""
    record = read_build_record(env_dir)
    if not record or not record.get("offline"):
        return []
    return ["--cache", record["cache"], "--offline", "--profile", record["profile"], *(["--with-te"] if record.get("te") else [])]


def session_build_options(env_dir: Path, options: Sequence[str]) -> tuple[list[str], str]:
    """(options for the build a session starts with, a line saying where they come from).

    Sessions run the stack in `env_dir`: `--python` (install into another interpreter) is refused;
    `--base-python EXE` builds `env_dir` over EXE's packages instead. `--lock-timeout SECONDS` passes through
    to the build, beside the recorded options."""
    if any(o == "--python" or o.startswith("--python=") for o in options):
        raise ValueError("nox sessions run the stack in .venv, so `--python EXE` is not a session build option:"
                         " pass `--base-python EXE` to build .venv over that interpreter's packages (its torch)")
    lock, others = _split_lock_option(options)
    if others:
        return list(options), ""
    recorded = recorded_build_options(env_dir)
    return [*recorded, *lock], (f"build options of {env_dir}'s last (offline) build: {' '.join(recorded)}" if recorded else "")


def _split_lock_option(options: Sequence[str]) -> tuple[list[str], list[str]]:
    """(`--lock-timeout SECONDS`, the other options): how long to wait for the checkout's lock says nothing about
    how to build, so on its own it keeps the replay of the recorded options."""
    lock, others, rest = [], [], list(options)
    while rest:
        option = rest.pop(0)
        if option == LOCK_OPTION and rest:
            lock += [option, rest.pop(0)]
        elif option.startswith(f"{LOCK_OPTION}="):
            lock.append(option)
        else:
            others.append(option)
    return lock, others
