"""The check's summary: its stamp (host, commit, kernel cache), its atomic write to summary.json and its report, a
few lines per part."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict
from pathlib import Path

from nam56r.training.gpu_check.options import Options
from nam56r.training.launcher.kernel_cache import CacheUse, read_manifest

SCHEMA = "nam56r.gpu_check/1"


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def stamp(opts: Options) -> dict:
    """The host (as the manifest stamps it) and the commit of the code that runs the check."""
    from nam56r_patchlane.checkout_state import checkout_state
    from nam56r_patchlane.manifest import host_stamp

    state = checkout_state(opts.root)
    commit = state.commit if state.commit is not None else f"unknown: {state.reason}"
    return {"host": asdict(host_stamp(opts.python)), "commit": commit, "dirty": state.dirty}


def kernel_cache_summary(use: CacheUse | None) -> dict | None:
    if use is None:
        return None
    manifest = read_manifest(use.directory)
    return {"directory": str(use.directory), "state": use.state, "message": use.message,
            "before": {**manifest.weight(), "key": asdict(manifest.key)} if manifest else None}


def write_summary(summary: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(path)  # never a half-written summary


def report(summary: dict) -> str:
    """A few lines per part: status, time, key figures, problems."""
    lines = [f"gpu-check {summary['status'].upper()} in {summary['seconds']:.0f} s on {summary['host']['gpu']}"
             f" (commit {summary['commit'][:12]}{', dirty' if summary['dirty'] else ''})"]
    for name, part in summary["parts"].items():
        head = f"  {name:6s} {part['status']}" + (f" in {part['seconds']:.0f} s" if "seconds" in part else f" ({part.get('reason', '')})")
        if name in ("tests", "packs") and part.get("counts"):
            head += ": " + ", ".join(f"{n} {k}" for k, n in sorted(part["counts"].items()))
        lines.append(head)
        for run_name, run in part.get("runs", {}).items():
            lines.append(f"    {run_name}: loss {_fmt(run['loss_first'])} -> {_fmt(run['loss_last'])}"
                         f" (steps {run['first_step']}..{run['last_step']}), {_fmt(run['tokens_per_s_per_gpu'], ',.0f')} tokens/s/GPU,"
                         f" {_fmt(run['tflops_per_s_per_gpu'], '.3g')} TFLOP/s/GPU, peak {_fmt(run['peak_memory_gib'], '.2f')} GiB,"
                         f" first step after {_fmt(run['time_to_first_step_s'], '.0f')} s")
        resume = part.get("resume", {})
        for run_name, run in resume.get("runs", {}).items():
            if run["max_abs_loss_diff"] is not None:
                options = " ".join(run["launcher_args"]) or "the saving run's options"
                lines.append(f"    {run_name} ({options}): steps {'-'.join(map(str, resume['compared_steps']))} within"
                             f" {run['max_abs_loss_diff']:.5f} of the uninterrupted run (tolerance {resume['tolerance']})")
        lines += [f"    problem: {p}" for p in part.get("problems", [])]
    return "\n".join(lines)


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)
