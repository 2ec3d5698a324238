"""`rebase --to REF`: the series re-applied onto another upstream version in a scratch tree, a
per-patch report (printed and markdown), and the real tree untouched."""

from __future__ import annotations

import pytest
from patchlane_testlib import Lane, git


@pytest.fixture
def submodule_lane(lane: Lane) -> Lane:
    lane.clone_submodule()
    result = lane.build()
    assert result.code == 0, result.text
    assert lane.state()["source"] == "submodule"
    return lane


def report_rows(text: str) -> dict[str, str]:
    """patch name -> the rest of its table row, from the printed table."""
    return {line.split()[0]: line for line in text.splitlines() if line.startswith("000")}


def snapshot(lane: Lane) -> tuple[str, str, str, dict]:
    return lane.head(), lane.status_porcelain(), lane.git("for-each-ref"), lane.state()


def test_rebase_onto_v2_applies_clean_and_with_offset(submodule_lane: Lane) -> None:
    lane = submodule_lane
    before = snapshot(lane)

    result = lane.run("rebase", "-u", "fakeup", "--to", "v2")

    assert result.code == 0, result.text
    assert f"onto git v2 ({lane.fake.commits['v2'][:12]})" in result.out
    rows = report_rows(result.out)
    assert "applies with offset" in rows["0001-core-scale.patch"] and "offsets 5" in rows["0001-core-scale.patch"]
    assert "applies clean" in rows["0002-util-guard.patch"]
    assert "applies clean" in rows["0003-io-encoding.patch"]
    report = lane.root / "third_party" / ".rebase" / "fakeup-v2.md"
    assert report.is_file()
    markdown = report.read_text()
    assert markdown.startswith("# Rebase report: fakeup onto git v2")
    assert "| 0001-core-scale.patch | applies with offset | offsets 5 |" in markdown
    # The scratch tree holds the series on top of v2; the real tree is as it was.
    scratch = lane.root / "third_party" / ".rebase" / "fakeup-v2"
    assert git(scratch, "rev-list", "--count", f"{lane.fake.commits['v2']}..HEAD").strip() == "3"
    assert snapshot(lane) == before


def test_rebase_onto_v3_reports_absorbed_and_conflicts(submodule_lane: Lane, tmp_path) -> None:
    lane = submodule_lane
    before = snapshot(lane)
    report = tmp_path / "reports" / "v3.md"
    report.parent.mkdir()

    result = lane.run("rebase", "-u", "fakeup", "--to", "v3", "--report", str(report))

    assert result.code == 1, result.text
    rows = report_rows(result.out)
    assert "applies with offset" in rows["0001-core-scale.patch"]
    assert "absorbed upstream" in rows["0002-util-guard.patch"]
    assert "conflicts" in rows["0003-io-encoding.patch"] and "fakeup/io.py" in rows["0003-io-encoding.patch"]
    assert "fakeup/core.py" not in rows["0003-io-encoding.patch"]
    markdown = report.read_text()
    assert "| patch | result | detail |" in markdown
    assert "| 0002-util-guard.patch | absorbed upstream |" in markdown
    assert "| 0003-io-encoding.patch | conflicts | files: fakeup/io.py |" in markdown
    assert str(report) in result.out
    assert not (lane.root / "third_party" / ".rebase" / "fakeup-v3.md").exists()
    assert snapshot(lane) == before
    # The series itself is untouched as well.
    assert {p.name: p.read_text() for p in lane.patches.glob("*.patch")} == lane.fake.series


def test_rebase_again_replaces_its_own_scratch_tree(submodule_lane: Lane) -> None:
    lane = submodule_lane
    assert lane.run("rebase", "-u", "fakeup", "--to", "v3").code == 1

    result = lane.run("rebase", "-u", "fakeup", "--to", "v3")

    assert result.code == 1
    scratch = lane.root / "third_party" / ".rebase" / "fakeup-v3"
    # v3 absorbed 0002: offset 0001 + conflicting 0003 leave one commit above v3.
    assert git(scratch, "rev-list", "--count", f"{lane.fake.commits['v3']}..HEAD").strip() == "1"
    assert "absorbed upstream" in (lane.root / "third_party" / ".rebase" / "fakeup-v3.md").read_text()
