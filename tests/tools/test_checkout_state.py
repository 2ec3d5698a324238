"""The superproject's commit and dirty flag as records and bench stamps read them (checkout_state), on real git repos."""

from __future__ import annotations

import subprocess
from pathlib import Path

from nam56r_patchlane.checkout_state import checkout_state


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def _checkout(repo: Path) -> Path:
    (repo / "patches").mkdir(parents=True)
    (repo / "patches" / "manifest.toml").write_text("# records\n")
    (repo / "README.md").write_text("readme\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "files")
    return repo


def test_a_clean_checkout_names_its_head(tmp_path: Path) -> None:
    repo = _checkout(tmp_path / "repo")
    state = checkout_state(repo)
    assert (state.commit, state.dirty) == (_git(repo, "rev-parse", "HEAD"), False)


def test_the_manifest_the_records_go_into_does_not_make_the_checkout_dirty(tmp_path: Path) -> None:
    repo = _checkout(tmp_path / "repo")
    (repo / "patches" / "manifest.toml").write_text("# records\n[[record]]\nwhat = 'pack'\n")
    assert checkout_state(repo).dirty is False

    (repo / "README.md").write_text("edited\n")
    assert checkout_state(repo).dirty is True


def test_a_copy_outside_git_or_inside_another_repository_has_no_commit(tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    state = checkout_state(copy)
    assert state.commit is None and state.dirty is None and "not a git checkout" in state.reason

    _git(tmp_path, "init", "-q")
    _git(tmp_path, "commit", "-q", "--allow-empty", "-m", "outer")
    state = checkout_state(copy)
    assert state.commit is None and f"inside {tmp_path.resolve()}" in state.reason
