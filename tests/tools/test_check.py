"""`check`, the CI gate: passes on a good series, fails with exit 1 and a message naming the problem."""

from __future__ import annotations

import pytest
from patchlane_testlib import CORE_EDIT, V1_FILES, VERSIONS, Lane, diff_for, patch_text

GOOD = "0001-core-scale.patch"


def replace_in(lane: Lane, name: str, old: str, new: str) -> None:
    path = lane.patches / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_check_passes_on_a_good_series(lane: Lane) -> None:
    result = lane.run("check")

    assert result.code == 0, result.text
    assert "3 patch(es) checked against a fresh `upstream` base" in result.out
    assert "check: passed" in result.out
    assert not lane.tree.exists()  # the base was materialized in a scratch directory


def test_check_uses_the_materialized_tree_and_leaves_it_alone(built: Lane) -> None:
    head = built.head()

    result = built.run("check")

    assert result.code == 0, result.text
    assert "check: passed" in result.out
    assert built.head() == head and built.status_porcelain() == ""


def test_check_passes_a_patch_whose_file_name_says_offset(lane: Lane) -> None:
    """git apply --verbose prints each file name; a name containing "offset" is not an offset."""
    new_file = ("fakeup/offset_table.py", "", "OFFSETS = {}\n")
    text = patch_text("Add the offset table", "integration", diff_for(V1_FILES, [new_file]))
    assert "new file mode" in text
    (lane.patches / "0004-offset-table.patch").write_text(text)
    lane.series_file.write_text(lane.series_file.read_text() + "0004-offset-table.patch\n")

    result = lane.run("check")

    assert result.code == 0, result.text
    assert "check: passed" in result.out


def _missing_field(lane: Lane) -> None:
    replace_in(lane, GOOD, "Retire-When: upstream fixes it\n", "")


def _bad_category(lane: Lane) -> None:
    replace_in(lane, GOOD, "Category: perf\n", "Category: speedup\n")


def _bad_upstream_status(lane: Lane) -> None:
    replace_in(lane, GOOD, "Upstream-Status: not-for-upstream: a test fixture\n", "Upstream-Status: filed somewhere\n")


def _missing_file(lane: Lane) -> None:
    lane.series_file.write_text(lane.series_file.read_text() + "0004-ghost.patch\n")


def _unlisted_file(lane: Lane) -> None:
    (lane.patches / "0004-stray.patch").write_text(lane.fake.series[GOOD])


def _out_of_order(lane: Lane) -> None:
    lane.series_file.write_text("0002-util-guard.patch\n0001-core-scale.patch\n0003-io-encoding.patch\n")


def _empty_patch(lane: Lane) -> None:
    text = patch_text("Nothing yet", "bugfix", "")
    (lane.patches / "0004-nothing.patch").write_text(text)
    lane.series_file.write_text(lane.series_file.read_text() + "0004-nothing.patch\n")


def _not_canonical(lane: Lane) -> None:
    # The same change as a plain `git diff`: abbreviated blob ids instead of --full-index.
    plain = diff_for(V1_FILES, [CORE_EDIT], "--no-color")
    (lane.patches / GOOD).write_text(patch_text("Round scaled values to six decimals", "perf", plain))


def _does_not_apply(lane: Lane) -> None:
    core = V1_FILES["fakeup/core.py"].replace("    result = x * factor\n", "    result = factor * x\n")
    stale = dict(V1_FILES, **{"fakeup/core.py": core})
    changed = ("fakeup/core.py", "    result = factor * x\n", "    result = round(factor * x, 6)\n")
    (lane.patches / GOOD).write_text(patch_text("Round scaled values to six decimals", "perf", diff_for(stale, [changed])))


def _offset(lane: Lane) -> None:
    # Made against v2, whose core.py has five more lines at the top: applies to the v1 base only with an offset.
    (lane.patches / GOOD).write_text(patch_text("Round scaled values to six decimals", "perf", diff_for(VERSIONS["v2"], [CORE_EDIT])))


def _bad_pack(lane: Lane) -> None:
    replace_in(lane, GOOD, "Pack: none\n", "Pack: Memory Pack\n")


def _no_description(lane: Lane) -> None:
    replace_in(lane, GOOD, "\nWhy: round scaled values to six decimals.\n", "\n\n")


def _missing_reproducer(lane: Lane) -> None:
    replace_in(lane, GOOD, "Reproducer: none\n", "Reproducer: tests/repro_scale.py\n")


CASES = {
    "missing-field": (_missing_field, ["0001-core-scale.patch", "missing header field 'Retire-When'"]),
    "bad-category": (_bad_category, ["0001-core-scale.patch", "Category 'speedup' is not one of"]),
    "bad-upstream-status": (_bad_upstream_status, ["0001-core-scale.patch", "Upstream-Status 'filed somewhere' is not one of"]),
    "bad-pack": (_bad_pack, ["Pack 'Memory Pack'"]),
    "no-description": (_no_description, ["0001-core-scale.patch", "no description"]),
    "missing-reproducer": (_missing_reproducer, ["Reproducer 'tests/repro_scale.py' is not a file"]),
    "series-names-missing-file": (_missing_file, ["names 0004-ghost.patch, which does not exist"]),
    "file-not-in-series": (_unlisted_file, ["0004-stray.patch: not listed in"]),
    "numbering-out-of-order": (_out_of_order, ["0002-util-guard.patch is number 2 but stands at position 1"]),
    "empty-patch": (_empty_patch, ["0004-nothing.patch", "the patch is empty"]),
    "not-canonical": (_not_canonical, ["0001-core-scale.patch: not in canonical form", "export -u fakeup"]),
    "does-not-apply": (_does_not_apply, ["0001-core-scale.patch: does not apply to the base", "fakeup/core.py"]),
    "applies-with-offset": (_offset, ["0001-core-scale.patch: applies only with offsets (1 hunk(s))"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_fails_naming_the_problem(lane: Lane, case: str) -> None:
    damage, expected = CASES[case]
    damage(lane)

    result = lane.run("check")

    assert result.code == 1, result.text
    assert "check: FAILED" in result.out
    errors = [line for line in result.out.splitlines() if "ERROR" in line]
    assert errors, result.out
    for fragment in expected:
        assert any(fragment in line for line in errors), f"{fragment!r} not in:\n" + "\n".join(errors)
