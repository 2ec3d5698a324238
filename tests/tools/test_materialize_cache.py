"""Materializing from the offline artifact cache: tree, base tag, one commit per patch, no-op rebuild,
re-apply from the base when a patch file changes."""

from __future__ import annotations

from pathlib import Path

import pytest
from nam56r_patchlane.patchfile import parse_patch_text
from patchlane_testlib import (
    CORE_EDIT,
    IO_EDIT,
    SDIST,
    UTIL_EDIT,
    V1_FILES,
    Lane,
    diff_for,
    git,
    make_lane,
    other_identity,
    patch_text,
    sha256_of,
)


def test_build_materializes_the_sdist_and_applies_one_commit_per_patch(lane: Lane) -> None:
    result = lane.build()

    assert result.code == 0, result.text
    assert "unpacking fakeup-1.0.tar.gz (sdist, from cache)" in result.out
    # The tree is the sdist's content (its top-level folder dropped), patched.
    files = [p.relative_to(lane.tree).as_posix() for p in lane.tree.rglob("*") if p.is_file() and ".git" not in p.parts]
    assert sorted(files) == sorted(V1_FILES)
    for rel, _, new in (CORE_EDIT, UTIL_EDIT, IO_EDIT):
        assert new in (lane.tree / rel).read_text()
    # Base: tagged `upstream`, its message names the pin and the artifact's checksum.
    base = lane.git("rev-parse", "upstream^{commit}").strip()
    base_message = lane.message(base)
    assert base_message.startswith("upstream: fakeup==1.0 (sdist fakeup-1.0.tar.gz)")
    assert sha256_of(lane.cache / SDIST) in base_message
    assert lane.fake.pinned in base_message
    assert lane.git("rev-parse", "--abbrev-ref", "HEAD").strip() == "patched"
    # One commit per patch, in series order, each message the patch header plus description.
    commits = lane.log()
    assert len(commits) == 3
    for commit, (name, text) in zip(commits, lane.fake.series.items(), strict=True):
        patch = parse_patch_text(text, name)
        assert lane.message(commit) == patch.commit_message()
        assert "Pack: none\n" in lane.message(commit) and f"Category: {patch.get('Category')}\n" in lane.message(commit)
    assert lane.status_porcelain() == ""
    state = lane.state()
    assert state["source"] == "cache"
    assert state["artifact_sha256"] == sha256_of(lane.cache / SDIST)
    assert state["base_commit"] == base
    assert [a["name"] for a in state["applied"]] == list(lane.fake.series)
    assert [a["commit"] for a in state["applied"]] == commits
    assert "3/3" in result.out and "materialized, patched" in result.out


def test_second_build_is_a_noop(built: Lane) -> None:
    head = built.head()
    state = built.state()

    result = built.build()

    assert result.code == 0, result.text
    assert "no-op" in result.out
    assert "applying" not in result.out and "unpacking" not in result.out
    assert built.head() == head
    assert built.state() == state


def test_changed_patch_file_reapplies_from_the_base(built: Lane) -> None:
    first_two = built.log()[:2]
    changed = ("fakeup/io.py", "    with open(path) as handle:\n", '    with open(path, encoding="latin-1") as handle:\n')
    (built.patches / "0003-io-encoding.patch").write_text(
        patch_text("Read text files as Latin-1", "compat", diff_for(V1_FILES, [changed]))
    )

    result = built.build()

    assert result.code == 0, result.text
    assert "the series changed: applying 3 patch(es) from the base" in result.out
    io_text = (built.tree / "fakeup/io.py").read_text()
    assert 'encoding="latin-1"' in io_text and 'encoding="utf-8"' not in io_text
    commits = built.log()
    assert len(commits) == 3
    assert commits[:2] == first_two  # deterministic commits: unchanged patches give the same ids
    assert built.message(commits[2]).startswith("Read text files as Latin-1\n")
    assert built.status_porcelain() == ""


def test_dropping_a_patch_from_the_series_unapplies_it(built: Lane) -> None:
    built.write_series(["0001-core-scale.patch"])

    result = built.build()

    assert result.code == 0, result.text
    assert (built.tree / "fakeup/util.py").read_text() == V1_FILES["fakeup/util.py"]
    assert (built.tree / "fakeup/io.py").read_text() == V1_FILES["fakeup/io.py"]
    assert len(built.log()) == 1
    assert [a["name"] for a in built.state()["applied"]] == ["0001-core-scale.patch"]


def test_same_release_and_series_give_the_same_commit_ids_in_another_root(
    lane: Lane, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = make_lane(tmp_path / "other", lane.cache, lane.fake)

    assert lane.build().code == 0
    other_identity(monkeypatch)
    assert other.build().code == 0
    built = lane
    assert other.head() == built.head()
    assert git(other.tree, "rev-parse", "upstream^{commit}") == built.git("rev-parse", "upstream^{commit}")


def test_moved_pin_refuses_to_touch_the_tree(built: Lane) -> None:
    lock = built.root / "third_party" / "upstreams.toml"
    lock.write_text(lock.read_text().replace('version = "1.0"', 'version = "1.1"'))
    head = built.head()

    result = built.build()

    assert result.code == 1
    assert "fakeup==1.0" in result.err and "fakeup==1.1" in result.err
    assert built.head() == head


def test_global_options_work_after_the_command(built: Lane) -> None:
    result = Lane.main(["status", "--root", str(built.root), "--cache", str(built.cache), "--offline"])

    assert result.code == 0, result.text
    row = next(line for line in result.out.splitlines() if line.startswith("fakeup"))
    assert row.split()[3:6] == ["cache", "3/3", "clean"]
