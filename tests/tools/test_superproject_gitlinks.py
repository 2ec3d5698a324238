"""The superproject records the lock's commit for each submodule, whatever the materialized tree's HEAD is."""

from __future__ import annotations

from patchlane_testlib import UPSTREAM, Lane, git

GITLINK = f"third_party/{UPSTREAM}"


def make_superproject(lane: Lane, commit: str) -> None:
    """lane.root as a git repository whose index and HEAD record `commit` for the submodule path."""
    git(lane.root, "init", "--quiet")
    git(lane.root, "add", "--all")
    git(lane.root, "update-index", "--add", "--cacheinfo", f"160000,{commit},{GITLINK}")
    git(lane.root, "commit", "--quiet", "-m", "superproject")


def recorded(lane: Lane, where: str) -> str:
    if where == "index":
        return git(lane.root, "ls-files", "--stage", "--", GITLINK).split()[1]
    return git(lane.root, "ls-tree", "HEAD", "--", GITLINK).split()[2]


def test_add_all_after_a_build_keeps_the_pinned_gitlink(lane: Lane) -> None:
    make_superproject(lane, lane.fake.pinned)

    assert lane.build().code == 0
    assert lane.head() != lane.fake.pinned  # the tree's HEAD is a local patch commit
    git(lane.root, "add", "--all")
    git(lane.root, "commit", "--quiet", "--allow-empty", "-a", "-m", "everything")

    assert recorded(lane, "index") == recorded(lane, "HEAD") == lane.fake.pinned
    result = lane.run("check")
    assert result.code == 0, result.text
    assert "gitlinks: ok" in result.out


def test_check_fails_on_a_gitlink_that_is_not_the_lock_commit(lane: Lane) -> None:
    make_superproject(lane, lane.fake.pinned)
    assert lane.build().code == 0
    tree_head = lane.head()
    git(lane.root, "update-index", "--no-skip-worktree", GITLINK)
    git(lane.root, "add", "--all")  # unprotected, add records the tree's own HEAD
    assert recorded(lane, "index") == tree_head

    result = lane.run("check")

    assert result.code == 1
    assert f"{GITLINK}: the superproject's index records submodule commit {tree_head[:12]}" in result.out
    assert f"git update-index --cacheinfo 160000,{lane.fake.pinned},{GITLINK}" in result.out
    git(lane.root, "update-index", "--cacheinfo", f"160000,{lane.fake.pinned},{GITLINK}")
    assert lane.run("check").code == 0
