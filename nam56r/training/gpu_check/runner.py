"""Runs the parts not skipped, at the same time on one GPU unless told otherwise, and rewrites the summary as each
part ends, so a check cut short still leaves what it found."""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from nam56r.training.gpu_check.options import EXIT_FAILED, PARTS, PROG, Options
from nam56r.training.gpu_check.parts import PART_RUNNERS, merge_packs_parts
from nam56r.training.gpu_check.summary import SCHEMA, kernel_cache_summary, now_utc, stamp, write_summary
from nam56r.training.launcher.kernel_cache import record_fill


def run_part(name: str, opts: Options) -> dict:
    """One part, timed; a crashed part is a failed part (the other parts still run)."""
    print(f"gpu-check: {name} ...", flush=True)
    started = time.monotonic()
    try:
        part = PART_RUNNERS[name](opts)
    except Exception as exc:
        part = {"status": "failed", "problems": [f"{type(exc).__name__}: {exc}"], "traceback": traceback.format_exc()}
    seconds = round(time.monotonic() - started, 1)
    print(f"gpu-check: {name} {part['status']} in {seconds:.0f} s", flush=True)
    return {"status": part.pop("status"), "seconds": seconds, **part}


def run_check(opts: Options, command: str = PROG) -> dict:
    """Run every part not in opts.skip (at the same time unless opts.concurrent is off); the summary
    (also written to OUT/summary.json after each part ends)."""
    path = opts.out_dir / "summary.json"
    started = time.monotonic()
    summary = {"schema": SCHEMA, "status": "running", "exit_code": None, "command": command, "out_dir": str(opts.out_dir),
               "started_utc": now_utc(), "finished_utc": None, "seconds": None, "concurrent": opts.concurrent, **stamp(opts),
               "kernel_cache": kernel_cache_summary(opts.kernel_cache),
               "parts": {name: ({"status": "skipped", "reason": f"--skip-{name}"} if name in opts.skip else {"status": "pending"})
                         for name in PARTS}}
    write_summary(summary, path)
    written = threading.Lock()

    def run_and_write(name: str) -> None:
        part = run_part(name, opts)
        with written:
            summary["parts"][name] = part
            write_summary(summary, path)

    to_run = [name for name in PARTS if name not in opts.skip]
    opts = dataclasses.replace(opts, concurrent=opts.concurrent and len(to_run) > 1)  # what the packs part reads
    summary["concurrent"] = opts.concurrent
    if opts.concurrent:
        with ThreadPoolExecutor(max_workers=len(to_run)) as pool:
            for future in [pool.submit(run_and_write, name) for name in to_run]:
                future.result()
        if "packs" in to_run:  # the packs that time host against GPU work, now that nothing else runs
            with written:
                summary["parts"]["packs"] = merge_packs_parts(summary["parts"]["packs"], run_part("packs-alone", opts))
                write_summary(summary, path)
    else:
        for name in to_run:
            run_and_write(name)
    if opts.kernel_cache is not None and opts.kernel_cache.state != "ignored":
        manifest = record_fill(opts.kernel_cache.directory, "gpu-check")
        summary["kernel_cache"]["after"] = manifest.weight()
    failed = [n for n, p in summary["parts"].items() if p["status"] == "failed"]
    summary.update(status="failed" if failed else "passed", exit_code=EXIT_FAILED if failed else 0, finished_utc=now_utc(),
                   seconds=round(time.monotonic() - started, 1))
    write_summary(summary, path)
    return summary
