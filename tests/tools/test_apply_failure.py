"""A patch that does not apply stops the build, names upstream, patch file, file and hunk, and
leaves the tree at the last patch that applied."""

from __future__ import annotations

import pytest
from patchlane_testlib import IO_EDIT, V1_FILES, Lane, diff_for, patch_text

# Written against a util.py whose last() reads differently from the release's: the hunk cannot match.
STALE_UTIL = dict(V1_FILES, **{"fakeup/util.py": V1_FILES["fakeup/util.py"].replace('"""The last item of items."""', '"""Last."""')})
GUARD_LAST = ("fakeup/util.py", "    return items[-1]\n", "    return items[-1] if items else None\n")
BAD_HUNK = patch_text("Guard last()", "bugfix", diff_for(STALE_UTIL, [GUARD_LAST]))
# Changes a file the release does not have.
MISSING_FILE = patch_text(
    "Touch a file upstream lacks", "bugfix",
    diff_for(dict(V1_FILES, **{"fakeup/extra.py": "A = 1\n"}), [("fakeup/extra.py", "A = 1\n", "A = 2\n")]),
)


@pytest.mark.parametrize(
    ("text", "where"),
    [(BAD_HUNK, ["fakeup/util.py", "hunk #1", "does not match"]), (MISSING_FILE, ["fakeup/extra.py"])],
    ids=["hunk-mismatch", "missing-file"],
)
def test_failing_patch_stops_at_the_last_good_one(lane: Lane, text: str, where: list[str]) -> None:
    names = ["0001-core-scale.patch", "0002-broken.patch", "0003-io-encoding.patch"]
    lane.write_series(names, {**lane.fake.series, "0002-broken.patch": text})

    result = lane.build()

    assert result.code == 1
    assert "fakeup: patch" in result.err
    assert str(lane.patches / "0002-broken.patch") in result.err
    assert "does not apply" in result.err
    for fragment in where:
        assert fragment in result.err
    assert "left at the last patch that applied" in result.err
    assert "1/3" in result.out and "FAILED" in result.out
    # HEAD is the commit of 0001, the last patch that applied; nothing of 0002 or 0003 is in the tree.
    (first,) = lane.log()
    assert lane.head() == first
    assert lane.message(first).startswith("Round scaled values to six decimals\n")
    assert [a["name"] for a in lane.state()["applied"]] == ["0001-core-scale.patch"]
    assert lane.state()["applied"][0]["commit"] == first
    assert lane.status_porcelain() == ""
    assert IO_EDIT[2] not in (lane.tree / "fakeup/io.py").read_text()
    assert (lane.tree / "fakeup/util.py").read_text() == V1_FILES["fakeup/util.py"]


def test_fixing_the_patch_lets_the_next_build_finish(lane: Lane) -> None:
    names = ["0001-core-scale.patch", "0002-util-guard.patch", "0003-io-encoding.patch"]
    lane.write_series(names, {**lane.fake.series, "0002-util-guard.patch": BAD_HUNK})
    assert lane.build().code == 1

    lane.write_series(names)
    result = lane.build()

    assert result.code == 0, result.text
    assert len(lane.log()) == 3
    assert [a["name"] for a in lane.state()["applied"]] == names
