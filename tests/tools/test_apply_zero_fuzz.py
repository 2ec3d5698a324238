"""Patches apply with zero fuzz: a hunk whose outermost context line no longer matches the tree is refused, even
though its inner context and changed lines still match and `git apply -C1` would take it (quilt's and patch's fuzz,
which STYLE.md rules out)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from nam56r_patchlane.apply import apply_patch
from nam56r_patchlane.errors import PatchApplyError
from nam56r_patchlane.gittree import UpstreamTree
from nam56r_patchlane.series import SeriesEntry
from patchlane_testlib import UPSTREAM, V1_FILES, Lane, diff_for, patch_text, write_files

UTIL = "fakeup/util.py"
# GUARD_LAST's hunk ends with three lines of context: two blank lines, then `def pairs(items):`. Written against a
# util.py where that third line read differently, only the outermost context line disagrees with the release.
OUTER_LINE, STALE_OUTER_LINE = "def pairs(items):\n", "def pairs(seq):\n"
STALE_OUTER = dict(V1_FILES, **{UTIL: V1_FILES[UTIL].replace(OUTER_LINE, STALE_OUTER_LINE)})
GUARD_LAST = (UTIL, "    return items[-1]\n", "    return items[-1] if items else None\n")
PATCH = "0001-util-guard-last.patch"


@pytest.fixture
def stale_outer_patch(tmp_path: Path) -> Path:
    diff = diff_for(STALE_OUTER, [GUARD_LAST])
    hunk = diff.splitlines()
    assert hunk[-1] == " " + STALE_OUTER_LINE.rstrip("\n"), diff  # the hunk's last (outermost) context line
    path = tmp_path / PATCH
    path.write_text(patch_text("Guard last()", "bugfix", diff))
    return path


@pytest.fixture
def release_tree(tmp_path: Path, isolated_git) -> UpstreamTree:
    """A git tree (git init, one commit) of the release that the series applies to."""
    write_files(tmp_path / "tree", V1_FILES)
    return UpstreamTree.init_from_directory(tmp_path / "tree", "fakeup v1")


def test_a_hunk_whose_outer_context_moved_is_refused_though_fuzz_would_apply_it(
        release_tree: UpstreamTree, stale_outer_patch: Path) -> None:
    fuzzed = subprocess.run(["git", "apply", "--check", "-C1", str(stale_outer_patch)], cwd=release_tree.path,
                            capture_output=True, text=True)
    assert fuzzed.returncode == 0, fuzzed.stderr  # only the outermost line differs: one line of context matches
    base = release_tree.head()

    with pytest.raises(PatchApplyError) as refused:
        apply_patch(release_tree, UPSTREAM, SeriesEntry(PATCH, stale_outer_patch))

    message = str(refused.value)
    assert f"{UPSTREAM}: patch {stale_outer_patch} does not apply" in message
    assert f"{UTIL}: hunk #1" in message and "does not match" in message
    assert release_tree.head() == base
    assert (release_tree.path / UTIL).read_text() == V1_FILES[UTIL]


def test_build_stops_at_a_patch_whose_outer_context_moved(lane: Lane, stale_outer_patch: Path) -> None:
    names = ["0001-core-scale.patch", "0002-util-guard-last.patch"]
    lane.write_series(names, {**lane.fake.series, "0002-util-guard-last.patch": stale_outer_patch.read_text()})

    result = lane.build()

    assert result.code == 1, result.text
    assert f"{UPSTREAM}: patch {lane.patches / '0002-util-guard-last.patch'} does not apply" in result.err
    assert [a["name"] for a in lane.state()["applied"]] == ["0001-core-scale.patch"]
    assert (lane.tree / UTIL).read_text() == V1_FILES[UTIL]
