"""The filing checklist's upstream-tests item: upstream's own tests covering each of the pack's patches passed, on both
the release and the series, recently, on a named host, for the patch as it is now (the manifest's
`upstream-tests:` records, written by `apply_patches.py upstream-tests`)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from ..manifest import patch_checksum, read_records
from ..patchfile import read_patch
from ..upstream_tests import record_what

NAME = "upstream tests of the patches passed recently (manifest)"


def upstream_tests_problems(patch_paths: list[Path], root: Path, upstream: str, today: dt.date,
                            max_age_days: int) -> tuple[list[str], str]:
    """(problems, why the item does not apply: "" when it does)."""
    problems, declared = [], 0
    records = read_records(root)
    for path in patch_paths:
        if not read_patch(path).declared_tests():
            continue
        declared += 1
        what, checksum = record_what(root, path), patch_checksum(path, with_tests=True)
        mine = [r for r in records if r.get("what") == what and r.get("patch_sha256") == checksum]
        if not mine:
            older = any(r.get("what") == what for r in records)
            problems.append(f"{path.name}: no upstream-tests record for its current checksum"
                            f"{' (only for an older one)' if older else ''}; run"
                            f" `python tools/apply_patches.py upstream-tests -u {upstream}`")
            continue
        latest = max(mine, key=lambda r: r["date"])
        host = latest.get("host", {}).get("gpu", "?")
        if latest["exit_code"] != 0:
            problems.append(f"{path.name}: upstream tests regressed on {host} ({latest['date']}): {latest.get('figures', '')}")
            continue
        age = (today - dt.date.fromisoformat(latest["date"][:10])).days
        if age > max_age_days:
            problems.append(f"{path.name}: the last passing upstream-tests run is {age} days old ({latest['date']}, {host});"
                            f" the limit is {max_age_days}: run it again")
    if not declared:
        return [], "no patch of the pack declares upstream tests (Upstream-Tests: none: ...)"
    return problems, ""
