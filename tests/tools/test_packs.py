"""Filing packs on the fake upstream: run (both sides, recorded), preflight, approve/filed, export, waves, check coverage."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from nam56r_patchlane.packs_cli import main as packs_main
from patchlane_testlib import Lane, Result

PACK = "02-util-guard"
PATCH = "0002-util-guard.patch"
TODAY = "2026-11-23"

REPRO = '''\
"""Reproducer of the fake util guard: first([]) raises on the release, returns None patched."""
import argparse
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--tree", required=True)
parser.add_argument("--mode", default="honest")
args = parser.parse_args()


def git(*a):
    return subprocess.run(["git", "-C", args.tree, *a], capture_output=True, text=True, check=True).stdout.strip()


print(f"host: gpu=cpu driver=- python=3.11.0 torch=- triton=- cuda=- upstream=fakeup base={git('rev-parse', 'upstream')[:12]}"
      f" tree={git('rev-parse', 'HEAD')[:12]}")
if args.mode == "gpu":
    print("NEEDS_GPU: this reproducer needs a CUDA GPU")
    sys.exit(3)
sys.path.insert(0, args.tree)
import fakeup  # noqa: E402

has_fix = "Return None from first()" in git("log", "--format=%s", "upstream..HEAD")
try:
    value = fakeup.first([])
except IndexError as exc:
    print(f"BUG_REPRODUCED: first([]) raised IndexError: {exc}")
    sys.exit(1 if has_fix else 0)
if args.mode == "liar":
    print("BUG_REPRODUCED: (a reproducer that lies)")
    sys.exit(0)
print(f"FIX_VALIDATED: first([]) returned {value!r}")
sys.exit(0 if has_fix else 1)
'''

BODY = '''\
# fakeup: `first()` raises IndexError on an empty list

## Summary
`fakeup.util.first([])` raises instead of returning `None`.

## How to reproduce
The reproducer is attached as `repro.py`:

```
python repro.py --tree /path/to/fakeup
```

| tree | prints |
| --- | --- |
| v1 | BUG_REPRODUCED |
| patched | FIX_VALIDATED |
'''


def pack_toml(args: list[str] | None = None, wave: str = "crash-fix", state: str = "new", fixed_in: str = "") -> str:
    return f'''\
id = "{PACK}"
title = "first() raises IndexError on an empty list"
target = "example/fakeup"
upstream = "fakeup"
patches = ["{PATCH}"]
kind = "pr"
wave = "{wave}"

[upstream_state]
state = "{state}"
url = ""
fixed_in = "{fixed_in}"
searched = "2026-11-20"
notes = "searched the tracker for 'first empty list': nothing relevant"

[reproducer]
script = "repro.py"
needs = "cpu"
args = {json.dumps(args or [])}
base = "BUG_REPRODUCED"
patched = ["FIX_VALIDATED"]

[scope]
proves = ["first([]) returns None on the patched tree"]
does_not_prove = ["anything about other functions"]

[filing]
approved_by = ""
approved_on = ""
filed_url = ""
filed_on = ""
'''


def packs(lane: Lane, *args: str) -> Result:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    argv = ["--root", str(lane.root), "--python", sys.executable, "--today", TODAY, *args]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = packs_main(argv)
    return Result(code, out.getvalue(), err.getvalue())


def set_header(lane: Lane, name: str, field: str, value: str) -> None:
    path = lane.patches / name
    path.write_text(re.sub(rf"^{field}: .*$", f"{field}: {value}", path.read_text(), count=1, flags=re.M))


@pytest.fixture
def packed(built: Lane) -> Lane:
    """The built lane with a pack for 0002 (0001 and 0003 stay not-for-upstream), rebuilt to match."""
    folder = built.root / "patches" / "packs" / PACK
    folder.mkdir(parents=True)
    (folder / "pack.toml").write_text(pack_toml())
    (folder / "body.md").write_text(BODY)
    (folder / "repro.py").write_text(REPRO)
    set_header(built, PATCH, "Pack", PACK)
    set_header(built, PATCH, "Reproducer", f"patches/packs/{PACK}/repro.py")
    set_header(built, PATCH, "Upstream-Status", "not-filed")
    result = built.build()
    assert result.code == 0, result.text
    return built


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


def test_preflight_passes_on_a_clean_approved_pack(packed: Lane) -> None:
    assert packs(packed, "run", PACK).code == 0
    approved = packs(packed, "approve", PACK, "--by", "Jane Maintainer")
    assert approved.code == 0, approved.text

    result = packs(packed, "preflight", PACK)

    assert result.code == 0, result.text
    assert "preflight 02-util-guard: passed" in result.out
    assert "[skip] upstream formatter" in result.out  # not a Megatron-LM target


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
