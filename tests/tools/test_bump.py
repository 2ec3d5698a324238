"""`bump`: a pin moves only when every gate passes on a candidate checkout, on a real git upstream with its own tests
and real sdists; a failing gate or a skipped suite leaves the lock as it was."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from nam56r_patchlane.lock import load_lock
from patchlane_testlib import (
    CORE_EDIT,
    IO_EDIT,
    UTIL_EDIT,
    VERSIONS,
    FakeUpstream,
    Lane,
    diff_for,
    git,
    make_lane,
    patch_text,
    write_files,
)

TEST_UTIL = "from fakeup.util import clamp\n\n\ndef test_clamp():\n    assert clamp(5, 0, 3) == 3\n"


@pytest.fixture
def lane(tmp_path: Path, cache: Path, fake_upstream: FakeUpstream) -> Lane:
    """fakeup at v1 and v2, each tag with tests/; the root a git checkout pinning v1 with 0001 (util) and 0002 (io), both apply
    clean to v2) and the tests' tree id."""
    origin = tmp_path / "origin"
    origin.mkdir()
    git(origin, "init", "--quiet")
    commits = {}
    for tag in ("v1", "v2"):
        write_files(origin, {**VERSIONS[tag], "tests/test_util.py": TEST_UTIL})
        git(origin, "add", "--all")
        git(origin, "commit", "--quiet", "-m", f"fakeup {tag}")
        git(origin, "tag", tag)
        commits[tag] = git(origin, "rev-parse", "HEAD").strip()
    fake = dataclasses.replace(fake_upstream, path=origin, commits=commits)
    lane = make_lane(tmp_path / "repo", cache, fake)
    lock = lane.root / "third_party" / "upstreams.toml"
    lock.write_text(lock.read_text() + f'\n[upstream.tests]\n"tests" = "{git(origin, "rev-parse", "v1:tests").strip()}"\n')
    texts = {"0001-util-guard.patch": patch_text("Return None from first() on an empty list", "bugfix",
                                                 diff_for(VERSIONS["v1"], [UTIL_EDIT]), upstream_tests="tests/test_util.py"),
             "0002-io-encoding.patch": patch_text("Read text files as UTF-8", "compat", diff_for(VERSIONS["v1"], [IO_EDIT]),
                                                  upstream_tests="none: fakeup has no test of io")}
    lane.write_series(list(texts), texts)
    git(lane.root, "init", "--quiet")
    git(lane.root, "add", "--all")
    git(lane.root, "commit", "--quiet", "-m", "the checkout")
    return lane


def _sdist_v2(tmp_path: Path) -> Path:
    staging = tmp_path / "sdist2"
    write_files(staging / "fakeup-2.0", VERSIONS["v2"])
    sdist = tmp_path / "fakeup-2.0.tar.gz"
    subprocess.run(["tar", "czf", str(sdist), "-C", str(staging), "fakeup-2.0"], check=True)
    return sdist


def _bump(lane: Lane, tmp_path: Path, *extra: str):
    return Lane.main(["--root", str(lane.root), "--cache", str(lane.cache), "--python", sys.executable, "bump", "-u", "fakeup",
                      "--to", "2.0", "--tag", "v2", "--commit", lane.fake.commits["v2"], "--artifact", str(_sdist_v2(tmp_path)),
                      "--tests-from", str(lane.fake.path), *extra])


def test_every_gate_passes_and_the_lock_then_pins_the_new_release(lane: Lane, tmp_path: Path) -> None:
    result = _bump(lane, tmp_path, "--suite", f"{sys.executable} -c pass")

    assert result.code == 0, result.text
    for gate in ("series", "tests", "check", "upstream", "suite"):
        assert any(line.startswith(gate) and "passed" in line for line in result.out.splitlines()), (gate, result.out)
    assert "fakeup: 1 passed" in result.out  # the upstream gate ran the declared test on both sides
    pinned = load_lock(lane.root).get("fakeup")
    assert (pinned.tag, pinned.commit, pinned.version) == ("v2", lane.fake.commits["v2"], "2.0")
    assert pinned.artifact().filename == "fakeup-2.0.tar.gz"
    assert pinned.tests == {"tests": git(lane.fake.path, "rev-parse", "v2:tests").strip()}


@pytest.mark.parametrize("case", ["suite fails", "no suite", "a patch moved"])
def test_a_failing_or_missing_gate_leaves_the_lock_as_it_was(lane: Lane, tmp_path: Path, case: str) -> None:
    lock = lane.root / "third_party" / "upstreams.toml"
    before = lock.read_text()
    if case == "a patch moved":  # 0001 applies to v2 only with an offset: refresh it first
        lane.write_series(["0001-core-scale.patch"], {"0001-core-scale.patch": patch_text(
            "Round", "perf", diff_for(VERSIONS["v1"], [CORE_EDIT]), upstream_tests="none: no test of it")})
        git(lane.root, "add", "--all")
        git(lane.root, "commit", "--quiet", "-m", "another series")
    extra = {"suite fails": ["--suite", f"{sys.executable} -c 'raise SystemExit(3)'"], "no suite": ["--no-suite"],
             "a patch moved": ["--no-suite"]}[case]

    result = _bump(lane, tmp_path, *extra)

    assert result.code == 1
    assert lock.read_text() == before
    if case == "suite fails":
        assert any(line.startswith("suite") and "FAILED" in line and "exit 3" in line for line in result.out.splitlines())
    elif case == "no suite":
        assert "--no-suite" in result.out and "not rewritten" in result.out
    else:
        assert "0001-core-scale.patch: applies with offset" in result.out


def test_uncommitted_changes_are_refused(lane: Lane, tmp_path: Path) -> None:
    (lane.root / "third_party" / "upstreams.toml").write_text((lane.root / "third_party" / "upstreams.toml").read_text() + "\n")

    result = _bump(lane, tmp_path, "--no-suite")

    assert result.code != 0 and "uncommitted changes" in result.err
