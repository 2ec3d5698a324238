"""The `tooling` suite (CPU): how long the patch lane takes to give a fresh checkout its four patched trees.

Measured on a fresh clone of this checkout's HEAD, with the artifact cache filled first (a warm cache, as
on a cluster that pre-filled it with `apply_patches.py cache`): materialize + apply all four series with
`--offline` (no index reached), then the same build again, which must be a no-op.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nam56r_patchlane.artifacts import default_cache_dir

from nam56r_bench.harness import ROOT, BenchError, Context, Row

TOOL = ROOT / "tools" / "apply_patches.py"


def _timed(command: list[str], what: str) -> float:
    print(f"[tooling] {what}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise BenchError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    print(f"[tooling] {what}: {seconds:.1f} s", flush=True)
    return seconds


def run(ctx: Context) -> list[Row]:
    cache = ctx.cache or default_cache_dir()
    rows = []
    fill = _timed([sys.executable, str(TOOL), "cache", "fill", str(cache), "--artifacts-only"], "fill the artifact cache (no-op when warm)")
    rows.append(Row("cache fill", "warm cache", time_ms=fill * 1e3))
    with tempfile.TemporaryDirectory(prefix="nam56r-bench-tooling-") as tmp:
        clone = Path(tmp) / "repo"
        _timed(["git", "clone", "--quiet", "--no-recurse-submodules", str(ROOT), str(clone)], "clone this checkout")
        build = [sys.executable, str(TOOL), "--root", str(clone), "--cache", str(cache), "--offline", "build", "--no-install"]
        first = _timed(build, "materialize + apply all four series (warm cache, offline)")
        rows.append(Row("materialize + apply 4 series", "warm cache", time_ms=first * 1e3))
        repeats = 1 if ctx.quick else 3
        noop = [_timed(build, f"no-op rebuild {i + 1}/{repeats}") for i in range(repeats)]
        rows.append(Row("no-op rebuild", "warm cache", time_ms=sorted(noop)[len(noop) // 2] * 1e3, extra={"runs_s": noop}))
    return rows
