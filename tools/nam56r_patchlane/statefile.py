"""Where a materialized tree records its patch-lane state: `<tree>/.git/<STATE_FILE>` (inside .git, so it
never dirties the tree). Standard library only, so readers without GitPython (the training preflight) share it."""

from __future__ import annotations

from pathlib import Path

STATE_FILE = "nam56r-patchlane.json"


def state_path(git_dir: Path) -> Path:
    """The state file of the repository whose git directory is `git_dir`."""
    return Path(git_dir) / STATE_FILE
