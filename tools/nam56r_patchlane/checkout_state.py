"""The superproject checkout's state: the commit that validation records and bench stamps name.

A pure reader (git only). `patches/manifest.toml` does not count towards `dirty`: a check appends its
records (packs, GPU tests, train runs) to it while it runs, and a later record would otherwise call the
same code dirty. The build records the state it built from in the environment's build record
(`built_checkout`), so a copy of a built tree without `.git` still names its commit.
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from .environment import read_build_record
from .manifest import MANIFEST_RELATIVE_PATH


@dataclass(frozen=True)
class CheckoutState:
    commit: str | None  # HEAD; None when `root` is not the top of a git checkout (a tarball or rsync copy)
    dirty: bool | None  # tracked files other than the manifest differ from HEAD; None without a commit
    reason: str = ""  # why there is no commit


def checkout_state(root: Path) -> CheckoutState:
    """HEAD of the git checkout whose top is `root`, and whether its tracked files differ from it. A copy
    unpacked inside another repository is no checkout: that repository's HEAD is not the copy's commit."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        return CheckoutState(None, None, f"{root} is not a git checkout ({top.stderr.strip()})")
    if Path(top.stdout.strip()).resolve() != root.resolve():
        return CheckoutState(None, None, f"{root} is not the top of a git checkout (it lies inside {top.stdout.strip()})")
    head = _git(root, "rev-parse", "HEAD")
    if head.returncode != 0:
        return CheckoutState(None, None, f"{root} has no commit ({head.stderr.strip()})")
    changed = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){MANIFEST_RELATIVE_PATH.as_posix()}")
    return CheckoutState(head.stdout.strip(), bool(changed.stdout.strip()))


def state_record(state: CheckoutState) -> dict:
    """The checkout part of a build record."""
    return asdict(state)


def built_checkout(env_dir: Path) -> CheckoutState | None:
    """The checkout state the last build of `env_dir` recorded, or None when no build recorded one."""
    recorded = (read_build_record(env_dir) or {}).get("checkout")
    return CheckoutState(**recorded) if recorded else None


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(args, 1, "", str(exc))
