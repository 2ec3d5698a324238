"""Filing packs on the fake upstream: run (both sides, recorded), preflight, approve/filed, export, waves, check coverage."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from nam56r_patchlane.packs.cli import main as packs_main
from packs_testlib import BODY, PACK, PATCH, REPRO, add_pack, pack_toml, set_header
from patchlane_testlib import Lane, Result

TODAY = "2026-11-23"


def packs(lane: Lane, *args: str) -> Result:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    argv = ["--root", str(lane.root), "--python", sys.executable, "--today", TODAY, *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = packs_main(argv)
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture
def packed(built: Lane) -> Lane:
    """The built lane with a pack for 0002 (0001 and 0003 stay not-for-upstream), rebuilt to match."""
    return add_pack(built)


def records(lane: Lane) -> list[dict]:
    path = lane.root / "patches" / "manifest.toml"
    return tomllib.loads(path.read_text()).get("record", []) if path.exists() else []


def test_run_checks_both_sides_and_records_them(packed: Lane) -> None:
    result = packs(packed, "run", PACK)

    assert result.code == 0, result.text
    assert "[base] BUG_REPRODUCED: first([]) raised IndexError" in result.out
    assert "[patched] FIX_VALIDATED: first([]) returned None" in result.out
    recs = records(packed)
    assert [(r["pack"], r["side"], r["exit_code"], r["sentinels"]) for r in recs] == [
        (PACK, "base", 0, ["BUG_REPRODUCED"]), (PACK, "patched", 0, ["FIX_VALIDATED"])]
    assert all(r["host"]["gpu"] == "cpu" and r["host"]["python"] == "3.11.0" for r in recs)
    assert recs[0]["upstream_commit"] == packed.fake.pinned
    assert recs[0]["tree_commit"] == packed.git("rev-parse", "HEAD~2").strip()  # the parent of 0002's commit
    assert recs[1]["tree_commit"] == packed.head()
    assert recs[0]["patch_sha256"] == recs[1]["patch_sha256"] != ""
    assert packed.status_porcelain() == ""  # the built tree was not touched


def test_run_takes_a_relative_python_from_the_callers_directory(packed: Lane, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reproducers run in their pack's folder: `--python .venv/bin/python` is resolved where it was typed."""
    (packed.root / "bin").mkdir()
    (packed.root / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.chdir(packed.root)
    result = packs(packed, "--python", "bin/python", "run", PACK, "--no-record")

    assert result.code == 0, result.text
    assert "[patched] FIX_VALIDATED" in result.out
    missing = packs(packed, "--python", "no/such/python", "run", PACK, "--no-record")
    assert missing.code != 0 and "--python no/such/python: no such interpreter" in missing.text


def test_a_parked_pack_is_reported_with_its_reason_and_neither_run_nor_recorded(packed: Lane) -> None:
    toml = packed.root / "patches" / "packs" / PACK / "pack.toml"
    parked = 'patched = ["FIX_VALIDATED"]\nparked = "the pin cannot reach it"'
    toml.write_text(toml.read_text().replace('patched = ["FIX_VALIDATED"]', parked, 1))

    result = packs(packed, "run", "--all")

    assert result.code == 0, result.text
    assert f"{PACK}: PARKED: the pin cannot reach it (not run, nothing recorded)" in result.out
    assert "BUG_REPRODUCED" not in result.out and records(packed) == []


def test_run_fails_when_a_side_prints_the_wrong_sentinel(packed: Lane) -> None:
    (packed.root / "patches" / "packs" / PACK / "pack.toml").write_text(pack_toml(args=["--mode", "liar"]))

    result = packs(packed, "run", PACK, "--no-record")

    assert result.code == 1
    assert "patched: expected FIX_VALIDATED; missing FIX_VALIDATED (printed: BUG_REPRODUCED)" in result.out
    assert records(packed) == []


def test_a_gpu_reproducer_on_a_cpu_host_exits_3_and_records_nothing(packed: Lane) -> None:
    (packed.root / "patches" / "packs" / PACK / "pack.toml").write_text(pack_toml(args=["--mode", "gpu"]))

    result = packs(packed, "run", PACK)

    assert result.code == 3
    assert "NEEDS_GPU" in result.out
    assert records(packed) == []


def test_a_base_side_that_exits_as_documented_passes_and_counts_as_a_pass(packed: Lane) -> None:
    """A reproducer that prints BUG_REPRODUCED on the base and exits 1 there (it takes only the release's
    own commit for the base; the base side also holds 0001) passes when pack.toml documents base_exit = 1."""
    (packed.root / "patches" / "packs" / PACK / "pack.toml").write_text(pack_toml(args=["--mode", "release-is-base"], base_exit=1))

    result = packs(packed, "run", PACK)

    assert result.code == 0, result.text
    assert f"{PACK}: passed: base exit 1 BUG_REPRODUCED, patched exit 0 FIX_VALIDATED" in result.out
    assert [(r["side"], r["exit_code"], r["sentinels"]) for r in records(packed)] == [
        ("base", 1, ["BUG_REPRODUCED"]), ("patched", 0, ["FIX_VALIDATED"])]
    approved = packs(packed, "approve", PACK, "--by", "Jane Maintainer")  # its preflight reads the records as passes
    assert approved.code == 0, approved.text


@pytest.mark.parametrize(("mode", "base_exit", "expected"), [
    ("release-is-base", None, "base: exit code 1 (pack.toml documents exit 0 for the base side (reproducer.base_exit))"),
    ("honest", 1, "base: exit code 0 (pack.toml documents exit 1 for the base side (reproducer.base_exit))"),
    ("exit3", None, "base: exit code 3 (pack.toml documents exit 0 for the base side (reproducer.base_exit))"),
])
def test_a_base_exit_code_pack_toml_does_not_document_fails(packed: Lane, mode: str, base_exit: int | None, expected: str) -> None:
    (packed.root / "patches" / "packs" / PACK / "pack.toml").write_text(pack_toml(args=["--mode", mode], base_exit=base_exit))

    result = packs(packed, "run", PACK)

    assert result.code == 1, result.text
    assert expected in result.out
    assert f"{PACK}: FAILED: base exit" in result.out
    assert [r["side"] for r in records(packed)] == ["base", "patched"]  # recorded, never as a pass
    refused = packs(packed, "approve", PACK, "--by", "Jane Maintainer")
    assert refused.code == 1 and "no passing base run for the current checksum (never passed)" in refused.out


def test_a_base_exit_outside_the_contract_is_a_pack_problem(packed: Lane) -> None:
    (packed.root / "patches" / "packs" / PACK / "pack.toml").write_text(pack_toml(base_exit=3))

    result = packs(packed, "list")

    assert result.code == 1
    assert f"pack {PACK}: reproducer.base_exit 3 is not one of 0, 1 (3 means NEEDS_GPU, never a result)" in result.out


def test_run_all_runs_every_pack_past_one_that_cannot_run_and_reports_each(packed: Lane, tmp_path: Path) -> None:
    broken = packed.root / "patches" / "packs" / "01-broken"  # sorts first; its upstream is not in the lock
    broken.mkdir()
    (broken / "pack.toml").write_text(pack_toml(pack_id="01-broken", upstream="nope"))
    (broken / "body.md").write_text(BODY)
    (broken / "repro.py").write_text(REPRO)
    report_path = tmp_path / "report" / "packs.json"

    result = packs(packed, "run", "--all", "--json", str(report_path))

    assert result.code == 1, result.text
    assert "01-broken: ERROR: 01-broken: pack.toml has problems:" in result.out
    assert "upstream 'nope' is not in the lock" in result.out
    assert "[base] BUG_REPRODUCED: first([]) raised IndexError" in result.out  # 02 ran after 01 could not
    assert f"{PACK}: passed" in result.out
    assert "packs run: 2 pack(s): 1 passed, 1 ERROR" in result.out
    assert re.search(r"^  01-broken +ERROR$", result.out, re.M) and re.search(rf"^  {PACK} +passed$", result.out, re.M)
    report = json.loads(report_path.read_text())
    assert report["exit_code"] == 1
    assert [(p["pack"], p["verdict"], p["exit_code"]) for p in report["packs"]] == [("01-broken", "ERROR", 1), (PACK, "passed", 0)]
    assert "upstream 'nope' is not in the lock" in report["packs"][0]["problems"][0]
    sides = report["packs"][1]["sides"]
    assert [(s["side"], s["exit_code"], s["sentinels"], s["problems"]) for s in sides] == [
        ("base", 0, ["BUG_REPRODUCED"], []), ("patched", 0, ["FIX_VALIDATED"], [])]
    appended = report["packs"][1]["records"]
    assert [{k: v for k, v in r.items() if k != "sentinels"} for r in appended] == [
        {k: v for k, v in r.items() if k != "sentinels"} for r in records(packed)]
    assert [r["sentinels"] for r in appended] == [r["sentinels"] for r in records(packed)]


def _add_liar(packed: Lane) -> None:
    liar = packed.root / "patches" / "packs" / "03-liar"  # sorts after the passing pack
    liar.mkdir()
    (liar / "pack.toml").write_text(pack_toml(pack_id="03-liar", args=["--mode", "liar"]).replace(f'"{PATCH}"', '"0003-io-encoding.patch"'))
    (liar / "body.md").write_text(BODY)
    (liar / "repro.py").write_text(REPRO)
    set_header(packed, "0003-io-encoding.patch", "Pack", "03-liar")
    set_header(packed, "0003-io-encoding.patch", "Upstream-Status", "not-filed")
    assert packed.build().code == 0


def test_run_all_fails_when_any_pack_fails_even_after_a_pass(packed: Lane) -> None:
    _add_liar(packed)

    result = packs(packed, "run", "--all", "--no-record")

    assert result.code == 1, result.text
    assert f"{PACK}: passed" in result.out and "03-liar: FAILED" in result.out
    assert "packs run: 2 pack(s): 1 passed, 1 FAILED" in result.out


def test_run_all_with_jobs_runs_packs_side_by_side_and_records_every_side(packed: Lane) -> None:
    _add_liar(packed)

    result = packs(packed, "run", "--all", "--jobs", "2")

    assert result.code == 1, result.text
    assert f"[{PACK}] {PACK}: passed" in result.out and "[03-liar] 03-liar: FAILED" in result.out
    assert f"[{PACK}] [base] BUG_REPRODUCED" in result.out
    assert sorted((r["pack"], r["side"]) for r in records(packed)) == sorted([
        ("03-liar", "base"), ("03-liar", "patched"), (PACK, "base"), (PACK, "patched")])
    assert packs(packed, "run", "--all", "--jobs", "0").code != 0


def test_an_alone_pack_runs_after_the_others_one_at_a_time_or_by_itself(packed: Lane) -> None:
    """A pack whose verdict times host against GPU work (`alone = true`) never shares the machine with another pack."""
    _add_liar(packed)
    toml = packed.root / "patches" / "packs" / PACK / "pack.toml"  # sorts first, so without `alone` it would start first
    toml.write_text(toml.read_text().replace('patched = ["FIX_VALIDATED"]', 'patched = ["FIX_VALIDATED"]\nalone = true', 1))

    together = packs(packed, "run", "--all", "--jobs", "2", "--no-record")
    assert together.out.index("[03-liar] 03-liar: FAILED") < together.out.index(f"[{PACK}] [base] $"), together.text
    assert re.search(r"^  03-liar +FAILED\n  " + re.escape(PACK) + " +passed$", together.out, re.M), together.text

    only = packs(packed, "run", "--all", "--jobs", "2", "--alone", "only", "--no-record")
    assert only.code == 0 and f"{PACK}: passed" in only.out and "03-liar" not in only.out, only.text
    skipped = packs(packed, "run", "--all", "--alone", "skip", "--no-record")
    assert skipped.code == 1 and "03-liar: FAILED" in skipped.out and f"{PACK}: passed" not in skipped.out, skipped.text
    toml.write_text(toml.read_text().replace("alone = true", 'alone = "yes"'))
    assert "reproducer.alone must be true or false, not 'yes'" in packs(packed, "run", PACK).err


def test_preflight_passes_on_a_clean_approved_pack(packed: Lane) -> None:
    assert packs(packed, "run", PACK).code == 0
    approved = packs(packed, "approve", PACK, "--by", "Jane Maintainer")
    assert approved.code == 0, approved.text

    result = packs(packed, "preflight", PACK)

    assert result.code == 0, result.text
    assert "preflight 02-util-guard: passed" in result.out
    assert "[skip] upstream formatter" in result.out  # not a Megatron-LM target


@pytest.mark.parametrize("plant", ["Token " + "ghp_" + "Z9y8X7w6" * 5 + " was used.", "-----BEGIN " + "RSA PRIVATE KEY-----"])
def test_preflight_names_a_planted_secret_with_its_file_and_line(packed: Lane, plant: str) -> None:
    assert packs(packed, "run", PACK).code == 0
    assert packs(packed, "approve", PACK, "--by", "Jane Maintainer").code == 0
    body = packed.root / "patches" / "packs" / PACK / "body.md"
    line = len(body.read_text().splitlines()) + 2
    body.write_text(body.read_text() + "\n" + plant + "\n")

    result = packs(packed, "preflight", PACK)

    assert result.code == 1 and "[FAIL] no private infrastructure in the bundle" in result.out
    assert f"private: patches/packs/{PACK}/body.md:{line}: secret (" in result.out
    assert plant.split()[1] not in result.out  # masked


@pytest.mark.parametrize(("plant", "expected"), [
    ("Seen on gpu-node-17 first.", "host name: 'gpu-node-17'"),
    ("Seen on trainer.cluster.internal first.", "internal host name: 'trainer.cluster.internal'"),
    ("The head node is 10.20.30.40.", "IP address: '10.20.30.40'"),
    ("Logs in /lustre/team/nam56r/run7.", "private path: '/lustre/team/nam56r/run7.'"),
    ("Logs in /home/alice/runs.", "private path: '/home/alice/runs.'"),
    ("Checkpoints in s3://team-ckpt/nam56r.", "bucket URL: 's3://team-ckpt/nam56r.'"),
    ("Tested on branch internal/nam56r-hotfix.", "non-public branch name: 'internal/nam56r-hotfix.'"),
    ("Thanks @bob for the bisect.", "@-mention of someone not listed as an author: '@bob'"),
])
def test_preflight_names_a_planted_leak(packed: Lane, plant: str, expected: str) -> None:
    assert packs(packed, "run", PACK).code == 0
    assert packs(packed, "approve", PACK, "--by", "Jane Maintainer").code == 0
    body = packed.root / "patches" / "packs" / PACK / "body.md"
    body.write_text(body.read_text() + "\n" + plant + "\n")

    result = packs(packed, "preflight", PACK)

    assert result.code == 1
    assert "[FAIL] no private infrastructure in the bundle" in result.out
    assert f"private: patches/packs/{PACK}/body.md:" in result.out and expected in result.out


def test_preflight_fails_on_a_stale_or_outdated_manifest_and_a_missing_approval(packed: Lane) -> None:
    assert packs(packed, "run", PACK).code == 0

    stale = packs(packed, "--today", "2026-12-31", "preflight", PACK)

    assert stale.code == 1
    assert "days old" in stale.out and "the limit is 7: run it again" in stale.out
    assert "no approval recorded: a person runs `python tools/packs.py approve 02-util-guard --by NAME`" in stale.out
    (packed.root / "patches" / "packs" / PACK / "repro.py").write_text(REPRO + "\n# changed\n")
    changed = packs(packed, "preflight", PACK)
    assert "no passing base run for the current checksum (only for an older patch/reproducer checksum)" in changed.out


def test_preflight_fails_on_a_body_that_does_not_render_or_pastes_the_reproducer(packed: Lane) -> None:
    body = packed.root / "patches" / "packs" / PACK / "body.md"
    body.write_text(BODY + "\n| a | b |\n| --- | --- |\n| 1 | 2 | 3 |\n\n```python\n" + REPRO)

    result = packs(packed, "preflight", PACK)

    assert result.code == 1
    assert "table row has 3 cells, its header 2" in result.out
    assert "is never closed" in result.out
    assert "body.md pastes" in result.out and "attach the file instead" in result.out


def test_approval_is_refused_before_the_pack_is_ready_and_filing_needs_approval(packed: Lane) -> None:
    refused = packs(packed, "approve", PACK, "--by", "Jane Maintainer")
    assert refused.code == 1 and "is not ready" in refused.err
    unapproved = packs(packed, "filed", PACK, "--url", "https://github.com/example/fakeup/pull/7")
    assert unapproved.code == 1 and "nothing is marked filed without one" in unapproved.err

    assert packs(packed, "run", PACK).code == 0
    assert packs(packed, "approve", PACK, "--by", "Jane Maintainer").code == 0
    wrong_repo = packs(packed, "filed", PACK, "--url", "https://github.com/other/repo/pull/7")
    assert wrong_repo.code == 1
    filed = packs(packed, "filed", PACK, "--url", "https://github.com/example/fakeup/pull/7")
    assert filed.code == 0, filed.text
    raw = tomllib.loads((packed.root / "patches" / "packs" / PACK / "pack.toml").read_text())["filing"]
    assert raw == {"approved_by": "Jane Maintainer", "approved_on": TODAY,
                   "filed_url": "https://github.com/example/fakeup/pull/7", "filed_on": TODAY}


def test_export_writes_the_bundle_only_when_preflight_passes(packed: Lane, tmp_path: Path) -> None:
    assert packs(packed, "run", PACK).code == 0
    refused = packs(packed, "export", PACK, "--out", str(tmp_path / "out"))
    assert refused.code == 1 and "not exported" in refused.err

    assert packs(packed, "approve", PACK, "--by", "Jane Maintainer").code == 0
    result = packs(packed, "export", PACK, "--out", str(tmp_path / "out"))

    assert result.code == 0, result.text
    bundle = tmp_path / "out" / PACK
    assert sorted(p.name for p in bundle.iterdir()) == [PATCH, "body.md", "repro.py", "validation.md"]
    validation = (bundle / "validation.md").read_text()
    assert "| base |" in validation and "BUG_REPRODUCED" in validation and "| patched |" in validation
    again = packs(packed, "export", PACK, "--out", str(tmp_path / "out"))
    assert again.code == 1 and "refusing to overwrite" in again.err


def test_waves_propose_ready_packs_and_pause_after_a_filing(packed: Lane) -> None:
    before = packs(packed, "waves")
    assert f"not ready: {PACK} (crash-fix): fails reproducer passed recently (manifest)" in before.out

    assert packs(packed, "run", PACK).code == 0
    ready = packs(packed, "waves")
    assert "example/fakeup (last filing: never)" in ready.out
    assert re.search(rf"next wave \(only 1 ready: a short wave\):\n    {PACK} +crash-fix +pr +needs approval", ready.out)

    assert packs(packed, "approve", PACK, "--by", "Jane Maintainer").code == 0
    assert packs(packed, "filed", PACK, "--url", "https://github.com/example/fakeup/issues/9").code == 0
    after = packs(packed, "waves")
    assert "example/fakeup (last filing: 2026-11-23)" in after.out
    assert "paused until 2026-11-25: no wave proposed" in after.out


def test_check_requires_a_pack_or_a_not_for_upstream_reason(packed: Lane) -> None:
    assert packed.run("check").code == 0
    set_header(packed, "0003-io-encoding.patch", "Upstream-Status", "not-filed")

    result = packed.run("check")

    assert result.code == 1
    assert ("patches/fakeup/0003-io-encoding.patch: Pack: none, but Upstream-Status is not 'not-for-upstream: <reason>'"
            in result.out)


def test_a_fixed_upstream_state_must_be_a_guard(packed: Lane) -> None:
    (packed.root / "patches" / "packs" / PACK / "pack.toml").write_text(pack_toml(state="fixed", fixed_in="v2"))

    result = packs(packed, "list")

    assert result.code == 1
    assert "already fixed upstream, so it is a regression guard: wave must be 'never'" in result.out


def test_preflight_runs_the_megatron_formatter_on_the_changed_lines(packed: Lane) -> None:
    toml = packed.root / "patches" / "packs" / PACK / "pack.toml"
    toml.write_text(toml.read_text().replace('target = "example/fakeup"', 'target = "NVIDIA/Megatron-LM"'))
    clean = packs(packed, "preflight", PACK)
    assert "[  ok] upstream formatter clean on the changed lines (black, isort)" in clean.out, clean.out

    patch = packed.patches / PATCH
    patch.write_text(patch.read_text().replace("+        return None\n", "+        return (None)  ;\n"))
    assert packed.build().code == 0

    result = packs(packed, "preflight", PACK)

    assert result.code == 1
    assert "[FAIL] upstream formatter clean on the changed lines (black, isort)" in result.out
    assert f"black: {PATCH} leaves fakeup/util.py unformatted" in result.out
    assert "-        return (None)  ;" in result.out
