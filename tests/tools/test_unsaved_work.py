"""Work in the tree that no series file holds is never thrown away: the build refuses and says how
to keep it; --discard proceeds and keeps it reachable under refs/patchlane/discarded/."""

from __future__ import annotations

import pytest
from patchlane_testlib import V1_FILES, Lane, git

EDITED = "fakeup/core.py"
EDIT_LINE = "# local experiment\n"
NEW_FILE = "fakeup/scratch.py"


def make_work(lane: Lane, kind: str) -> str:
    """Leave work of the given kind in the tree; returns what the refusal message must name."""
    if kind == "tracked-edit":
        with (lane.tree / EDITED).open("a") as handle:
            handle.write(EDIT_LINE)
        return EDITED
    if kind == "untracked-file":
        (lane.tree / NEW_FILE).write_text(EDIT_LINE)
        return NEW_FILE
    with (lane.tree / EDITED).open("a") as handle:
        handle.write(EDIT_LINE)
    lane.git("commit", "--quiet", "-am", "An experiment committed by hand")
    return "An experiment committed by hand"


def work_present(lane: Lane, kind: str, rev: str | None = None) -> bool:
    path = NEW_FILE if kind == "untracked-file" else EDITED
    if rev:
        return git(lane.tree, "show", f"{rev}:{path}", check=False).endswith(EDIT_LINE)
    return (lane.tree / path).is_file() and (lane.tree / path).read_text().endswith(EDIT_LINE)


def discarded_refs(lane: Lane) -> list[str]:
    return lane.git("for-each-ref", "--format=%(refname)", "refs/patchlane/discarded/").split()


KINDS = ["tracked-edit", "untracked-file", "extra-commit"]


@pytest.mark.parametrize("kind", KINDS)
def test_changed_series_with_unsaved_work_is_refused(built: Lane, kind: str) -> None:
    named = make_work(built, kind)
    head = built.head()
    built.write_series(["0001-core-scale.patch", "0002-util-guard.patch"])  # the series changed

    result = built.build()

    assert result.code == 1
    assert "holds work that is not in patches/fakeup/series; refusing to touch it" in result.err
    assert named in result.err
    for advice in ("refresh -u fakeup", "new SLUG -u fakeup", "export -u fakeup", "--discard"):
        assert advice in result.err
    assert work_present(built, kind)
    assert built.head() == head
    assert discarded_refs(built) == []
    # Nothing was re-applied: the dropped patch is still in the tree.
    assert (built.tree / "fakeup/io.py").read_text() != V1_FILES["fakeup/io.py"]


@pytest.mark.parametrize("kind", KINDS)
def test_discard_proceeds_and_keeps_the_work_recoverable(built: Lane, kind: str) -> None:
    make_work(built, kind)
    built.write_series(["0001-core-scale.patch", "0002-util-guard.patch"])

    result = built.build("--discard")

    assert result.code == 0, result.text
    assert "--discard" in result.out and "refs/patchlane/discarded/" in result.out
    # The tree is exactly the new series, clean.
    assert len(built.log()) == 2
    assert (built.tree / "fakeup/io.py").read_text() == V1_FILES["fakeup/io.py"]
    assert not work_present(built, kind)
    assert built.status_porcelain() == ""
    (ref,) = discarded_refs(built)
    assert ref in result.out
    assert work_present(built, kind, rev=ref)
    # A later build finds nothing in the way.
    again = built.build()
    assert again.code == 0 and "no-op" in again.out


def test_two_discards_in_a_row_keep_both(built: Lane) -> None:
    make_work(built, "tracked-edit")
    built.write_series(["0001-core-scale.patch", "0002-util-guard.patch"])
    assert built.build("--discard").code == 0
    (built.tree / NEW_FILE).write_text(EDIT_LINE)
    built.write_series(["0001-core-scale.patch"])
    assert built.build("--discard").code == 0

    refs = discarded_refs(built)

    assert len(refs) == 2
    assert any(work_present(built, "tracked-edit", rev=r) for r in refs)
    assert any(work_present(built, "untracked-file", rev=r) for r in refs)


def test_unchanged_series_with_edits_is_a_noop_that_keeps_them(built: Lane) -> None:
    make_work(built, "tracked-edit")

    result = built.build()

    assert result.code == 0
    assert "no-op" in result.out and "uncommitted edits" in result.out
    assert work_present(built, "tracked-edit")


def test_discard_with_an_unchanged_series_sets_the_edits_aside(built: Lane) -> None:
    make_work(built, "untracked-file")
    make_work(built, "tracked-edit")
    head = built.head()

    result = built.build("--discard")

    assert result.code == 0, result.text
    assert built.status_porcelain() == ""
    assert built.head() == head  # the same series gives the same commits
    (ref,) = discarded_refs(built)
    assert work_present(built, "tracked-edit", rev=ref) and work_present(built, "untracked-file", rev=ref)


@pytest.mark.parametrize(
    ("kind", "condition"),
    [("tracked-edit", "dirty"), ("untracked-file", "dirty"), ("extra-commit", "clean, 1 unexported commit(s)")],
)
def test_status_names_the_unsaved_work(built: Lane, kind: str, condition: str) -> None:
    make_work(built, kind)

    result = built.run("status")

    row = next(line for line in result.out.splitlines() if line.startswith("fakeup"))
    assert row.endswith(condition), row


def test_status_and_series_flag_a_changed_patch_file(built: Lane) -> None:
    path = built.patches / "0002-util-guard.patch"
    path.write_text(path.read_text().replace("Retire-When: upstream fixes it", "Retire-When: 1.1 ships"))

    status = built.run("status").out
    series = built.run("series").out

    assert "series changed (build re-applies)" in status
    assert "  ! 0002-util-guard.patch" in series and "  + 0001-core-scale.patch" in series


def test_pop_refuses_with_edits_and_discard_keeps_them(built: Lane) -> None:
    make_work(built, "tracked-edit")
    head = built.head()

    refused = built.run("pop", "-u", "fakeup")
    assert refused.code == 1 and "--discard" in refused.err
    assert built.head() == head and work_present(built, "tracked-edit")

    popped = built.run("pop", "-u", "fakeup", "--discard")
    assert popped.code == 0, popped.text
    assert len(built.log()) == 2
    (ref,) = discarded_refs(built)
    assert work_present(built, "tracked-edit", rev=ref)
