"""A pack's validation records: the latest passing run per side, and the excerpt a bundle carries."""

from __future__ import annotations

from pathlib import Path

from ..manifest import read_records
from .pack import Pack, pack_checksum


def passing_records(pack: Pack, root: Path, checksum: str) -> dict[str, dict]:
    """The latest record per side that ran this pack's current checksum, printed the sentinels pack.toml
    expects and exited with the code it documents for that side."""
    latest: dict[str, dict] = {}
    for record in read_records(root):
        side = record.get("side", "")
        if record.get("pack") != pack.id or side not in ("base", "patched") or record.get("patch_sha256") != checksum:
            continue
        sentinels, exit_code = pack.reproducer.expected(side)
        if record.get("exit_code") == exit_code and all(s in record.get("sentinels", []) for s in sentinels):
            if side not in latest or record["date"] >= latest[side]["date"]:
                latest[side] = record
    return latest


def manifest_excerpt(pack: Pack, root: Path) -> str:
    """The records a maintainer can check the claims against: the latest passing run of each side."""
    latest = passing_records(pack, root, pack_checksum(pack, root))
    lines = [f"# Validation of {pack.id}: latest passing runs of its reproducer (from our validation manifest)", ""]
    lines += ["| side | date (UTC) | GPU | driver | python | torch | triton | CUDA | exit | sentinels |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for side in ("base", "patched"):
        r = latest.get(side)
        if r is None:
            lines.append(f"| {side} | - | not run | - | - | - | - | - | - | - |")
            continue
        h = r["host"]
        gpu = f"{h['gpu']} (sm {h['capability']})" if h.get("capability") else h["gpu"]
        lines.append(f"| {side} | {r['date']} | {gpu} | {h['driver'] or '-'} | {h['python']} | {h['torch'] or '-'} |"
                     f" {h['triton'] or '-'} | {h['cuda'] or '-'} | {r['exit_code']} | {' '.join(r['sentinels'])} |")
    figures = [f"- {side}: {latest[side]['figures']}" for side in ("base", "patched") if side in latest and latest[side].get("figures")]
    if figures:
        lines += ["", "Figures printed by the reproducer:", *figures]
    return "\n".join(lines) + "\n"
