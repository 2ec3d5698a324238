"""Materializing from a git checkout of the upstream at the pinned commit (the submodule case)."""

from __future__ import annotations

from patchlane_testlib import SDIST, Lane, git


def test_checkout_at_the_pin_is_used_instead_of_the_artifact(lane: Lane) -> None:
    (lane.cache / SDIST).unlink()  # nothing to fall back to: the checkout must be the source
    lane.clone_submodule()

    assert "not materialized" in lane.run("status").out
    result = lane.build()

    assert result.code == 0, result.text
    assert "using the git submodule checkout" in result.out
    assert lane.git("rev-parse", "upstream^{commit}").strip() == lane.fake.pinned
    assert lane.git("rev-parse", "--abbrev-ref", "HEAD").strip() == "patched"
    assert lane.git("rev-parse", "HEAD~3").strip() == lane.fake.pinned
    assert len(lane.log()) == 3
    assert lane.status_porcelain() == ""
    state = lane.state()
    assert state["source"] == "submodule"
    assert state["base_commit"] == lane.fake.pinned
    assert state["artifact_sha256"] == ""

    status = lane.run("status")
    assert status.code == 0
    row = next(line for line in status.out.splitlines() if line.startswith("fakeup"))
    assert row.split()[3:6] == ["submodule", "3/3", "clean"]

    again = lane.build()
    assert again.code == 0 and "no-op" in again.out


def test_checkout_without_the_pinned_commit_is_refused(lane: Lane) -> None:
    lane.tree.mkdir(parents=True)
    git(lane.tree, "init", "--quiet")
    (lane.tree / "other.txt").write_text("not the upstream\n")
    git(lane.tree, "add", "--all")
    git(lane.tree, "commit", "--quiet", "-m", "unrelated")
    head = lane.head()

    result = lane.build()

    assert result.code == 1
    assert "neither this tool made nor holds the pinned commit" in result.err
    assert lane.fake.pinned[:12] in result.err
    assert lane.head() == head
    assert lane.git("tag").strip() == ""


def test_non_git_directory_with_content_is_not_overwritten(lane: Lane) -> None:
    lane.tree.mkdir(parents=True)
    (lane.tree / "notes.txt").write_text("mine\n")

    result = lane.build()

    assert result.code == 1
    assert "refusing to overwrite" in result.err
    assert (lane.tree / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in lane.tree.iterdir()) == ["notes.txt"]
