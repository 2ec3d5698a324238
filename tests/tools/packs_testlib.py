"""The fake filing pack of the pack tests, on the fake upstream of patchlane_testlib: a pack for
0002-util-guard.patch whose reproducer runs in several modes (honest, liar, gpu, exit3,
release-is-base), so tests can make a side behave as they need."""

from __future__ import annotations

import json
import re

from patchlane_testlib import Lane

PACK = "02-util-guard"
PATCH = "0002-util-guard.patch"

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
if args.mode == "release-is-base":  # counts only the release's own commit as the base, as pack 01's reproducer does
    has_fix = git("rev-parse", "HEAD") != git("rev-parse", "upstream")
try:
    value = fakeup.first([])
except IndexError as exc:
    print(f"BUG_REPRODUCED: first([]) raised IndexError: {exc}")
    sys.exit(3 if args.mode == "exit3" else 1 if has_fix else 0)
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


def pack_toml(args: list[str] | None = None, wave: str = "crash-fix", state: str = "new", fixed_in: str = "",
              base_exit: int | None = None, pack_id: str = PACK, upstream: str = "fakeup") -> str:
    documented = "" if base_exit is None else f"base_exit = {base_exit}\n"
    return f'''\
id = "{pack_id}"
title = "first() raises IndexError on an empty list"
target = "example/fakeup"
upstream = "{upstream}"
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
{documented}patched = ["FIX_VALIDATED"]

[scope]
proves = ["first([]) returns None on the patched tree"]
does_not_prove = ["anything about other functions"]

[filing]
approved_by = ""
approved_on = ""
filed_url = ""
filed_on = ""
'''


def set_header(lane: Lane, name: str, field: str, value: str) -> None:
    path = lane.patches / name
    path.write_text(re.sub(rf"^{field}: .*$", f"{field}: {value}", path.read_text(), count=1, flags=re.M))


def add_pack(lane: Lane, toml: str | None = None) -> Lane:
    """The pack for 0002 (0001 and 0003 stay not-for-upstream) in `lane`, rebuilt to match."""
    folder = lane.root / "patches" / "packs" / PACK
    folder.mkdir(parents=True)
    (folder / "pack.toml").write_text(toml or pack_toml())
    (folder / "body.md").write_text(BODY)
    (folder / "repro.py").write_text(REPRO)
    set_header(lane, PATCH, "Pack", PACK)
    set_header(lane, PATCH, "Reproducer", f"patches/packs/{PACK}/repro.py")
    set_header(lane, PATCH, "Upstream-Status", "not-filed")
    result = lane.build()
    assert result.code == 0, result.text
    return lane
