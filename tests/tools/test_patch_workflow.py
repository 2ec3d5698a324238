"""Round trips of the series commands: new, refresh, export, import, push, pop."""

from __future__ import annotations

import re

import pytest
from nam56r_patchlane.patchfile import parse_patch_text, read_patch
from patchlane_testlib import V1_FILES, VERSIONS, Lane, diff_for, edit, header_fields, other_identity

MEAN = '\n\ndef mean(items):\n    """Arithmetic mean of items."""\n    return sum(items) / len(items)\n'
NEW_ARGS = (
    "new", "add-mean", "-u", "fakeup", "--subject", "Add mean() for the loss logger", "--category", "integration",
    "--retire-when", "never: a local helper", "--upstream-tests", "none: a test fixture",
    "--why", "The NAM56R loss logger averages with it.",
    "--upstream-status", "not-for-upstream: a test fixture",  # check requires a pack or this reason
)
ALL = ["0001-core-scale.patch", "0002-util-guard.patch", "0003-io-encoding.patch"]


def patch_bytes(lane: Lane) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(lane.patches.iterdir())}


def test_new_records_edits_as_a_numbered_patch_on_top(built: Lane) -> None:
    comment = "# fakeup series (one patch file per line)\n"
    built.series_file.write_text(comment + built.series_file.read_text())
    with (built.tree / "fakeup/util.py").open("a") as handle:
        handle.write(MEAN)

    result = built.run(*NEW_ARGS)

    assert result.code == 0, result.text
    path = built.patches / "0004-add-mean.patch"
    assert path.is_file()
    assert built.series_file.read_text() == comment + "".join(f"{n}\n" for n in [*ALL, "0004-add-mean.patch"])
    patch = read_patch(path)
    assert patch.fields == header_fields(
        "Add mean() for the loss logger", "integration", retire_when="never: a local helper"
    )
    assert patch.description == "The NAM56R loss logger averages with it."
    assert patch.touched_files() == ["fakeup/util.py"]
    assert "+def mean(items):" in patch.diff
    assert built.status_porcelain() == ""
    assert len(built.log()) == 4
    assert built.message("HEAD") == patch.commit_message()
    assert built.state()["applied"][-1]["name"] == "0004-add-mean.patch"
    assert built.state()["applied"][-1]["commit"] == built.head()
    # The new patch is canonical and the series consistent; nothing is left for build to do.
    assert built.run("check").code == 0
    assert "no-op" in built.build().out


def test_new_without_edits_is_refused(built: Lane) -> None:
    result = built.run(*NEW_ARGS)

    assert result.code == 1
    assert "no edits" in result.err
    assert built.series_names() == ALL
    assert not (built.patches / "0004-add-mean.patch").exists()


def test_refresh_rewrites_only_the_diff(built: Lane) -> None:
    with (built.tree / "fakeup/util.py").open("a") as handle:
        handle.write(MEAN)
    assert built.run(*NEW_ARGS).code == 0
    path = built.patches / "0004-add-mean.patch"
    before = read_patch(path)
    edit(built.tree / "fakeup/util.py", "    return sum(items) / len(items)\n", "    return sum(items) / max(len(items), 1)\n")

    result = built.run("refresh", "-u", "fakeup")

    assert result.code == 0, result.text
    after = read_patch(path)
    assert after.fields == before.fields
    assert after.description == before.description
    assert after.diff != before.diff
    assert "+    return sum(items) / max(len(items), 1)" in after.diff
    assert "len(items)\n" not in after.diff.replace("max(len(items), 1)", "")
    text = path.read_text()
    assert text.split("\n---\n", 1)[0] == before.to_text().split("\n---\n", 1)[0]  # header and description bytes kept
    assert built.status_porcelain() == ""
    assert len(built.log()) == 4  # folded into the top patch, no new commit
    assert built.series_names() == [*ALL, "0004-add-mean.patch"]
    assert built.run("check").code == 0


def test_export_after_a_fresh_apply_is_byte_identical(built: Lane) -> None:
    # A series file with comments, as the repository's are.
    built.series_file.write_text("# Patch series for fakeup, applied in order (one patch file per line).\n" + built.series_file.read_text())
    before = patch_bytes(built)
    assert built.build().code == 0

    result = built.run("export", "-u", "fakeup")

    assert result.code == 0, result.text
    assert "fakeup: 0 patch file(s) written" in result.out
    assert patch_bytes(built) == before


def test_export_turns_a_hand_made_commit_into_a_patch(built: Lane) -> None:
    with (built.tree / "fakeup/util.py").open("a") as handle:
        handle.write(MEAN)
    message = "Add mean() for the loss logger\n\nPack: none\nCategory: integration\nUpstream-Status: not-for-upstream: a test fixture\n" \
              "Retire-When: never\nReproducer: none\nUpstream-Tests: none: a test fixture\n\nThe loss logger averages with it.\n"
    built.git("commit", "--quiet", "-a", "--cleanup=verbatim", "-m", message)

    result = built.run("export", "-u", "fakeup")

    assert result.code == 0, result.text
    assert built.series_names() == [*ALL, "0004-add-mean-for-the-loss-logger.patch"]
    patch = read_patch(built.patches / "0004-add-mean-for-the-loss-logger.patch")
    assert patch.subject == "Add mean() for the loss logger" and patch.get("Retire-When") == "never"
    assert patch.commit_message() == message
    assert "no-op" in built.build().out  # the commit is now the series' own
    assert built.run("check").code == 0


def test_pop_all_then_push_all_restores_the_same_head(built: Lane, monkeypatch: pytest.MonkeyPatch) -> None:
    head = built.head()
    commits = built.log()
    other_identity(monkeypatch)

    popped = built.run("pop", "-u", "fakeup", "--all")

    assert popped.code == 0, popped.text
    assert "0/3 applied" in popped.out
    assert built.head() == built.git("rev-parse", "upstream^{commit}").strip()
    for rel, text in V1_FILES.items():
        assert (built.tree / rel).read_text() == text
    assert built.state()["applied"] == []
    assert built.run("series").out.count("  - ") == 3

    pushed = built.run("push", "-u", "fakeup", "--all")

    assert pushed.code == 0, pushed.text
    assert "3/3 applied" in pushed.out
    assert built.head() == head
    assert built.log() == commits
    assert built.run("series").out.count("  + ") == 3


def test_push_and_pop_one_at_a_time_and_by_name(built: Lane) -> None:
    commits = built.log()

    assert built.run("pop", "-u", "fakeup").code == 0
    assert built.head() == commits[1]
    assert built.run("pop", "-u", "fakeup", "core-scale").code == 0  # down to (keeping) 0001
    assert built.head() == commits[0]
    assert "nothing to pop" in built.run("pop", "-u", "fakeup", "0001-core-scale.patch").out
    assert built.run("push", "-u", "fakeup").code == 0
    assert built.head() == commits[1]
    assert built.run("push", "-u", "fakeup", "0003-io-encoding").code == 0
    assert built.head() == commits[2]
    assert "nothing to push" in built.run("push", "-u", "fakeup").out
    series = built.run("series").out
    assert "  + 0001-core-scale.patch" in series and "  + 0003-io-encoding.patch" in series


def test_import_of_an_outside_patch_lands_canonical_and_numbered(built: Lane, tmp_path) -> None:
    # As someone might write it by hand: short index hashes, five lines of context, its own number.
    files = dict(VERSIONS["v1"])
    for name in ALL:
        patch = parse_patch_text(built.fake.series[name], name)
        for rel in patch.touched_files():
            files[rel] = (built.tree / rel).read_text()
    diff = diff_for(files, [("fakeup/util.py", "    return list(zip(items, items[1:]))\n",
                             "    return list(zip(items[:-1], items[1:]))\n")], "-U5")
    assert re.search(r"^index [0-9a-f]{7,12}\.\.[0-9a-f]{7,12} ", diff, re.M)
    header = "Subject: Spell out pairs()\nPack: none\nCategory: bugfix\nUpstream-Status: not-for-upstream: a test fixture\n" \
             "Retire-When: upstream takes it\nReproducer: none\nUpstream-Tests: none: a test fixture\n"
    outside = tmp_path / "0042-spell-out-pairs.patch"
    outside.write_text(f"{header}\nClearer.\n---\n{diff}")

    result = built.run("import", str(outside), "-u", "fakeup")

    assert result.code == 0, result.text
    landed = built.patches / "0004-spell-out-pairs.patch"
    assert built.series_names() == [*ALL, landed.name]
    text = landed.read_text()
    assert text != outside.read_text()
    assert re.search(r"^index [0-9a-f]{40}\.\.[0-9a-f]{40} ", text, re.M)
    patch = read_patch(landed)
    assert patch.subject == "Spell out pairs()" and patch.description == "Clearer."
    assert "@@ -24,7 +24,7 @@" in patch.diff  # three lines of context, as export writes
    assert built.message("HEAD") == patch.commit_message()
    assert "zip(items[:-1], items[1:])" in (built.tree / "fakeup/util.py").read_text()
    assert built.run("export", "-u", "fakeup").out.strip() == "fakeup: 0 patch file(s) written"
    assert built.run("check").code == 0
