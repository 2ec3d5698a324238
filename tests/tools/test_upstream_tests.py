"""`upstream-tests` end to end on a real git upstream that has its own tests: the tests stored from git against the
lock's tree id, the release and the series run side by side by real pytest processes, a planted regression found and
bisected to its patch, recorded, and refused by the filing checklist; then the patch updates the test as an upstream
PR would, and everything passes (with `check` and `export` keeping the test section)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
from pathlib import Path

import pytest
from nam56r_patchlane.cachemanifest import CacheManifest, CacheTarget
from nam56r_patchlane.errors import PatchlaneError
from nam56r_patchlane.lock import load_lock
from nam56r_patchlane.manifest import read_records
from nam56r_patchlane.packs.upstream_tests_item import upstream_tests_problems
from nam56r_patchlane.upstream_tests_source import fill_tests
from patchlane_testlib import CORE_EDIT, UTIL_EDIT, V1_FILES, FakeUpstream, Lane, diff_for, git, make_lane, patch_text, write_files

TEST_CORE = '''\
from fakeup.core import double, scale


def test_double():
    assert double(2) == 4


def test_scale_keeps_full_precision():
    assert scale(0.1, 3) == 0.1 * 3


def test_needs_transformer_engine():
    import transformer_engine  # noqa: F401


import pytest


@pytest.mark.parametrize("holder", [1, 2])
def test_rendezvous_on_master_port(holder):
    # as upstream's distributed tests do; the two sides, and a side's xdist workers, run at once
    import os, socket, time
    with socket.socket() as server:
        server.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
        server.listen()
        time.sleep(1.5)
'''
UPDATED_ASSERT = ("tests/test_core.py", "    assert scale(0.1, 3) == 0.1 * 3\n", "    assert scale(0.1, 3) == round(0.1 * 3, 6)\n")
REGRESSED = "tests/test_core.py::test_scale_keeps_full_precision"


@pytest.fixture
def lane(tmp_path: Path, cache: Path, fake_upstream: FakeUpstream) -> Lane:
    """fakeup whose tag v1 holds tests/ (its sdist, as the shared fixture's, does not), pinned with their tree id;
    0001 (rounding in scale) declares tests/test_core.py, 0002 declares none."""
    origin = tmp_path / "origin"
    write_files(origin, {**V1_FILES, "tests/test_core.py": TEST_CORE})
    git(origin, "init", "--quiet")
    git(origin, "add", "--all")
    git(origin, "commit", "--quiet", "-m", "fakeup v1 with its tests")
    git(origin, "tag", "v1")
    commit = git(origin, "rev-parse", "HEAD").strip()
    tests_tree = git(origin, "rev-parse", "HEAD:tests").strip()
    fake = dataclasses.replace(fake_upstream, path=origin, commits={"v1": commit})
    lane = make_lane(tmp_path / "repo", cache, fake)
    lock = lane.root / "third_party" / "upstreams.toml"
    lock.write_text(lock.read_text() + f'\n[upstream.tests]\n"tests" = "{tests_tree}"\n')
    lane.write_series(["0001-core-scale.patch", "0002-util-guard.patch"], {
        "0001-core-scale.patch": patch_text("Round scaled values to six decimals", "perf", diff_for(V1_FILES, [CORE_EDIT]),
                                          upstream_tests="tests/test_core.py"),
        "0002-util-guard.patch": patch_text("Return None from first() on an empty list", "bugfix",
                                           diff_for(V1_FILES, [UTIL_EDIT]), upstream_tests="none: fakeup has no test of util"),
    })
    assert lane.build().code == 0
    return lane


def _store_tests(lane: Lane, tests_cache: Path, source: str) -> None:
    upstream = load_lock(lane.root).get("fakeup")
    tests_cache.mkdir(exist_ok=True)
    entry = fill_tests(upstream, tests_cache, source, log=lambda _: None)
    CacheManifest(CacheTarget("3.11", (), "cpu", ()), {}, (entry,)).write(tests_cache)


def _upstream_tests(lane: Lane, tests_cache: Path, out: Path, *extra: str):
    return Lane.main(["--root", str(lane.root), "--cache", str(tests_cache), "--python", sys.executable, "upstream-tests",
                      "-u", "fakeup", "--out", str(out), *extra])


def test_a_planted_regression_is_found_bisected_recorded_and_refused_until_the_patch_updates_the_test(
        lane: Lane, tmp_path: Path) -> None:
    tests_cache = tmp_path / "tests-cache"
    _store_tests(lane, tests_cache, str(lane.fake.path))
    assert (tests_cache / "upstream-tests").is_dir()

    result = _upstream_tests(lane, tests_cache, tmp_path / "out")

    assert result.code == 1, result.text
    report = json.loads((tmp_path / "out" / "fakeup" / "report.json").read_text())
    verdicts = {t["test"]: t for t in report["tests"]}
    assert verdicts[REGRESSED]["kind"] == "regression" and verdicts[REGRESSED]["patch"] == "0001-core-scale.patch"
    assert verdicts["tests/test_core.py::test_double"]["kind"] == "passed"
    te = verdicts["tests/test_core.py::test_needs_transformer_engine"]
    assert te["kind"] == "both fail" and te["cause"] == "needs TransformerEngine"
    assert {verdicts[f"tests/test_core.py::test_rendezvous_on_master_port[{n}]"]["kind"] for n in (1, 2)} == {"passed"}
    assert report["counts"] == {"regression": 1, "passed": 3, "both fail": 1}
    assert "REGRESSION: " + REGRESSED in result.out
    records = {r["what"]: r for r in read_records(lane.root)}
    first = records["upstream-tests:patches/fakeup/0001-core-scale.patch"]
    assert first["exit_code"] == 1 and first["sentinels"] == ["UPSTREAM_TESTS_REGRESSED"] and REGRESSED in first["figures"]
    assert records["upstream-tests:patches/fakeup/0002-util-guard.patch"]["exit_code"] == 0
    today = dt.date.today()
    problems, skipped = upstream_tests_problems([lane.patches / "0001-core-scale.patch"], lane.root, "fakeup", today, 30)
    assert not skipped and len(problems) == 1 and "regressed" in problems[0] and REGRESSED in problems[0]
    assert upstream_tests_problems([lane.patches / "0002-util-guard.patch"], lane.root, "fakeup", today, 30)[1]

    # The patch updates the test as its upstream PR would: the materialized tree (no tests/) takes the code only.
    patch_path = lane.patches / "0001-core-scale.patch"
    with_test = patch_text("Round scaled values to six decimals", "perf",
                           diff_for({**V1_FILES, "tests/test_core.py": TEST_CORE}, [CORE_EDIT, UPDATED_ASSERT]),
                           upstream_tests="tests/test_core.py")
    patch_path.write_text(with_test)
    assert lane.build().code == 0
    assert not (lane.tree / "tests" / "test_core.py").exists()
    assert lane.run("export", "-u", "fakeup").code == 0 and patch_path.read_text() == with_test
    assert lane.run("check").code == 0

    result = _upstream_tests(lane, tests_cache, tmp_path / "out2")

    assert result.code == 0, result.text
    report = json.loads((tmp_path / "out2" / "fakeup" / "report.json").read_text())
    assert report["counts"] == {"passed": 4, "both fail": 1}
    assert report["patches"][0]["updates_tests"] == ["tests/test_core.py"]
    assert upstream_tests_problems([patch_path], lane.root, "fakeup", today, 30) == ([], "")


def test_jobs_run_each_side_in_xdist_workers_each_with_its_own_rendezvous_port(lane: Lane, tmp_path: Path) -> None:
    tests_cache = tmp_path / "tests-cache"
    _store_tests(lane, tests_cache, str(lane.fake.path))

    result = _upstream_tests(lane, tests_cache, tmp_path / "out", "--jobs", "2", "--no-bisect", "--no-record")

    report = json.loads((tmp_path / "out" / "fakeup" / "report.json").read_text())
    verdicts = {t["test"]: t["kind"] for t in report["tests"]}
    assert {verdicts[f"tests/test_core.py::test_rendezvous_on_master_port[{n}]"] for n in (1, 2)} == {"passed"}, result.text
    assert report["counts"] == {"regression": 1, "passed": 3, "both fail": 1}
    log = (tmp_path / "out" / "fakeup" / "patched.log").read_text()
    assert " -n 2 " in log.splitlines()[0] and "[gw" in log  # a failure report names its xdist worker


def test_tests_are_refused_when_the_source_does_not_hold_the_pinned_tree(lane: Lane, tmp_path: Path) -> None:
    upstream = load_lock(lane.root).get("fakeup")
    wrong = dataclasses.replace(upstream, tests={"tests": "0" * 40})
    with pytest.raises(PatchlaneError, match="tests at .* is tree .*, the lock pins 0000"):
        fill_tests(wrong, tmp_path, str(lane.fake.path), log=lambda _: None)
    with pytest.raises(PatchlaneError, match="(?s)cannot fetch tag v1 .*fatal: .*--tests-from fakeup="):
        fill_tests(upstream, tmp_path, str(tmp_path / "no-such-clone"), log=lambda _: None)


def test_upstream_tests_refuse_a_cache_without_the_tests(lane: Lane, tmp_path: Path) -> None:
    result = _upstream_tests(lane, lane.cache, tmp_path / "out")

    assert result.code != 0
    assert "holds no upstream tests" in result.err and "--tests-from fakeup=PATH" in result.err


def test_check_refuses_a_declared_test_the_pinned_tests_lack(lane: Lane, tmp_path: Path) -> None:
    tests_cache = tmp_path / "tests-cache"
    _store_tests(lane, tests_cache, str(lane.fake.path))
    patch = lane.patches / "0001-core-scale.patch"
    patch.write_text(patch.read_text().replace("Upstream-Tests: tests/test_core.py", "Upstream-Tests: tests/test_kore.py"))
    argv = ["--root", str(lane.root), "--python", sys.executable, "check"]

    refused = Lane.main(["--cache", str(tests_cache), *argv])
    unchecked = Lane.main(["--cache", str(lane.cache), *argv])

    assert refused.code == 1 and "Upstream-Tests 'tests/test_kore.py' is not in fakeup's tests at v1" in refused.out
    assert unchecked.code == 0 and "Upstream-Tests paths not checked against the tests" in unchecked.out


def test_both_fail_causes_name_the_runs_device_and_keep_each_tests_message() -> None:
    from nam56r_patchlane.junit import Case
    from nam56r_patchlane.upstream_tests_verdict import classify

    nccl = "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1234, unhandled system error\ntraceback..."
    ranks = "RuntimeError: world_size (1) is not divisible by 8\ntraceback..."
    sides = {"t.py::nccl": Case("t.py::nccl", "failed", 0.1, nccl), "t.py::ranks": Case("t.py::ranks", "error", 0.1, ranks)}

    on_cpu = {v.test: v for v in classify(sides, sides, {}, {})}
    on_gpu = {v.test: v for v in classify(sides, sides, {}, {}, gpu=True)}

    assert on_cpu["t.py::nccl"].cause == "needs a CUDA GPU"
    assert on_gpu["t.py::nccl"].cause == "a CUDA or NCCL error on the GPU"
    assert on_gpu["t.py::nccl"].message == nccl.splitlines()[0]
    assert on_cpu["t.py::ranks"].cause == on_gpu["t.py::ranks"].cause
    assert on_gpu["t.py::ranks"].cause.startswith("needs more ranks than one pytest process")
    assert on_gpu["t.py::ranks"].kind == "both fail"
