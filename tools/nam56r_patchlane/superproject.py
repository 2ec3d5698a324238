"""The superproject's gitlinks: third_party/<name> records the lock's upstream commit, never a tree's.

The materialized trees live where the submodules check out, and each is its own git repository
whose HEAD is a local commit (the `upstream` base made from a PyPI release, or a patch on
`patched`) that no remote has. `.gitmodules`' `ignore = all` hides that from status and diff, but
`git add -A` and `git commit -a` in the superproject still record the tree's HEAD as the submodule
commit. Two guards: building marks each gitlink skip-worktree in the superproject's index, which
add and commit -a honour; and `check` fails when a committed or staged gitlink is not the lock's.
"""

from __future__ import annotations

from pathlib import Path

import git

from .lock import Lock, Upstream

GITLINK_MODE = "160000"


def _superproject(root: Path) -> git.Git | None:
    if not (root / ".git").exists():
        return None
    return git.Git(str(root))


def _gitlink(repo: git.Git, path: str, where: str) -> str | None:
    """The commit recorded for `path` in the index ("index") or in HEAD ("HEAD"); None if no gitlink."""
    if where == "index":
        line = repo.ls_files("--stage", "--", path)  # "<mode> <sha> <stage>\t<path>"
    else:
        line = repo.ls_tree("HEAD", "--", path) if repo.rev_parse("--verify", "-q", "HEAD", with_exceptions=False) else ""
    fields = line.split()
    return fields[2 if where == "HEAD" else 1] if fields and fields[0] == GITLINK_MODE else None


def protect_gitlink(root: Path, upstream: Upstream) -> bool:
    """Mark third_party/<name> skip-worktree in the superproject's index; False when it is no gitlink there."""
    repo = _superproject(root)
    path = upstream.path.as_posix()
    if repo is None or _gitlink(repo, path, "index") is None:
        return False
    repo.update_index("--skip-worktree", "--", path)
    return True


def gitlink_problems(root: Path, lock: Lock, only: list[str] | None = None) -> list[str]:
    """Each gitlink (in HEAD or staged) whose commit differs from the lock's pin, with the fix."""
    repo = _superproject(root)
    if repo is None:
        return []
    problems = []
    for upstream in lock.select(only):
        path = upstream.path.as_posix()
        for where in ("HEAD", "index"):
            recorded = _gitlink(repo, path, where)
            if recorded is not None and recorded != upstream.commit:
                problems.append(
                    f"{path}: the superproject's {where} records submodule commit {recorded[:12]}, the lock pins"
                    f" {upstream.commit[:12]} (a materialized tree's own commit was staged, e.g. by `git add -A`);"
                    f" fix: git update-index --cacheinfo {GITLINK_MODE},{upstream.commit},{path}"
                    f" && git update-index --skip-worktree {path}, then commit"
                )
                break
    return problems
