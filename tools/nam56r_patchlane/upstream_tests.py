"""`upstream-tests`: an upstream's own tests on the pinned release and on the patched series, side by side, with a
verdict per test and per patch, a JSON report, and one manifest record per patch.

Which tests: the files and directories the patches declare (`Upstream-Tests:`), or every test root (`--all`), or the
paths given (`--tests`). Without `--gpu` the CUDA devices are hidden, so the verdicts are the CPU's on any host;
`--gpu` requires a CUDA GPU and runs them on it. Each regression is bisected to the first patch at which it fails.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .console import format_table
from .errors import PatchlaneError
from .gittree import UpstreamTree, is_git_tree
from .lock import Lock, Upstream
from .manifest import Record, append_record, host_stamp, now_utc, patch_checksum
from .series import read_series
from .upstream_tests_run import Sides, build_sides, finish, missing_paths, run_pytest
from .upstream_tests_source import cached_archive
from .upstream_tests_verdict import (
    BOTH_FAIL,
    EXPLAINED,
    FIXED,
    REGRESSION,
    Verdict,
    both_fail_causes,
    classify,
    covered,
    read_explanations,
    tally,
)

PASSED_SENTINEL, REGRESSED_SENTINEL = "UPSTREAM_TESTS_PASSED", "UPSTREAM_TESTS_REGRESSED"
RECORD_PREFIX = "upstream-tests:"


@dataclass(frozen=True)
class UpstreamTestsOptions:
    root: Path
    cache_dir: Path
    python: str
    out_dir: Path
    selection: str  # "declared" | "all" | "paths"
    paths: tuple[str, ...] = ()
    gpu: bool = False
    timeout_s: float = 3600.0
    bisect: bool = True
    record: bool = True
    keep: bool = False
    command: str = ""
    base_includes: tuple[str, ...] = ()  # series patches applied to the base side too (named in the report and records)
    jobs: int = 1  # pytest-xdist workers per side (1: no xdist)


def record_what(root: Path, patch_path: Path) -> str:
    """A patch's upstream-tests record name in the manifest."""
    return RECORD_PREFIX + str(patch_path.resolve().relative_to(root.resolve()))


def run_upstream_tests(lock: Lock, names: list[str] | None, options: UpstreamTestsOptions, log=print) -> int:
    upstreams = [u for u in lock.select(names) if names or (u.tests and read_series(options.root / "patches", u.name).entries)]
    if not upstreams:
        raise PatchlaneError("no upstream has both a patch series and pinned upstream tests", "name one with -u")
    if options.gpu:
        _require_gpu(options.python)
    if options.jobs > 1:
        _require_xdist(options.python)
    results = [_run_one(u, options, log) for u in upstreams]
    return 0 if all(results) else 1


def _require_gpu(python: str) -> None:
    probe = subprocess.run([python, "-c", "import torch; raise SystemExit(0 if torch.cuda.is_available() else 1)"],
                           capture_output=True)
    if probe.returncode != 0:
        raise PatchlaneError("--gpu: no CUDA GPU visible to " + python, "run it on a GPU node, or leave out --gpu for the CPU verdicts")


def _require_xdist(python: str) -> None:
    if subprocess.run([python, "-c", "import xdist"], capture_output=True).returncode != 0:
        raise PatchlaneError(f"--jobs: pytest-xdist is not importable by {python}",
                             "it is among the lock's test requirements: `nox -s build` installs them (or pass --jobs 1)")


def _source_tree(root: Path, upstream: Upstream) -> UpstreamTree:
    path = root / upstream.path
    if not is_git_tree(path):
        raise PatchlaneError(f"{path} is not materialized", "run `python tools/apply_patches.py build` (or `nox -s build`) first")
    return UpstreamTree(path)


def _run_one(upstream: Upstream, options: UpstreamTestsOptions, log) -> bool:
    archive = cached_archive(upstream, options.cache_dir)
    scratch = Path(tempfile.mkdtemp(prefix=f"upstream-tests-{upstream.name}-"))
    try:
        log(f"{upstream.name}: release {upstream.tag} and the series, with upstream's tests, in {scratch}")
        sides = build_sides(options.root, upstream, _source_tree(options.root, upstream), archive, scratch,
                            options.base_includes)
        paths = _selected_paths(upstream, sides, options)
        log(f"  {len(paths)} test path(s), {'on the GPU' if options.gpu else 'CUDA hidden'}; both sides at once")
        out = options.out_dir / upstream.name
        base, patched = _run_sides(upstream, sides, paths, out, options)
        updates = {path: tuple(p.name for p in sides.patches if path in p.updated_tests)
                   for p in sides.patches for path in p.updated_tests}
        verdicts = classify(base, patched, updates, read_explanations(options.root / "patches" / upstream.name),
                            gpu=options.gpu)
        if options.bisect:
            verdicts = _bisect(upstream, sides, verdicts, out, options, log)
        report = _report(upstream, sides, paths, verdicts, options)
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        _print(upstream, report, verdicts, log)
        log(f"  report: {out / 'report.json'}; pytest logs beside it")
        if options.record:
            _record(upstream, sides, verdicts, report, options, log)
        return not any(v.counts_against for v in verdicts)
    finally:
        if options.keep:
            log(f"  kept the trees: {scratch}/base and {scratch}/patched (remove them when done)")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _selected_paths(upstream: Upstream, sides: Sides, options: UpstreamTestsOptions) -> list[str]:
    if options.selection == "all":
        return list(upstream.tests)
    if options.selection == "paths":
        paths = list(options.paths)
    else:
        paths = sorted({d for p in sides.patches for d in p.patch.declared_tests()})
        if not paths:
            raise PatchlaneError(f"{upstream.name}: no patch declares an upstream test", "use --all, or --tests PATH")
    missing = missing_paths(sides.patched, paths)
    if missing:
        owners = [f"{m} (declared by {', '.join(p.name for p in sides.patches if m in p.patch.declared_tests()) or '--tests'})"
                  for m in missing]
        raise PatchlaneError(f"{upstream.name}: not in upstream's tests at {upstream.tag}: {'; '.join(owners)}",
                             "fix the Upstream-Tests header (paths relative to the upstream's root)")
    return paths


def _env_for(options: UpstreamTestsOptions) -> dict[str, str]:
    return {} if options.gpu else {"CUDA_VISIBLE_DEVICES": ""}


def _run_sides(upstream: Upstream, sides: Sides, paths: list[str], out: Path, options: UpstreamTestsOptions):
    out.mkdir(parents=True, exist_ok=True)
    running = {side: run_pytest(upstream, tree, paths, out / f"{side}.xml", out / f"{side}.log", options.python,
                                options.timeout_s, extra_env=_env_for(options), jobs=options.jobs)
               for side, tree in (("base", sides.base), ("patched", sides.patched))}
    return tuple(finish(running[side], out / f"{side}.xml", out / f"{side}.log", side) for side in ("base", "patched"))


def _bisect(upstream: Upstream, sides: Sides, verdicts: list[Verdict], out: Path, options: UpstreamTestsOptions,
            log) -> list[Verdict]:
    """Each regression with the first patch at which it fails: the patched tree walked one patch at a time."""
    pending = [v.test for v in verdicts if v.kind in (REGRESSION, EXPLAINED)]
    if not pending:
        return verdicts
    log(f"  bisecting {len(pending)} regression(s) over {len(sides.patches)} patch(es)")
    first: dict[str, str] = {}
    walker = sides.patched
    try:
        for applied in sides.patches:
            walker.git("checkout", "--quiet", "--force", applied.commit)
            junit, log_path = out / "bisect" / f"{applied.name}.xml", out / "bisect" / f"{applied.name}.log"
            outcomes = finish(run_pytest(upstream, walker, [], junit, log_path, options.python, options.timeout_s,
                                         test_ids=pending, extra_env=_env_for(options), jobs=options.jobs), junit, log_path,
                              f"bisect at {applied.name}")
            for test in [t for t in pending if outcomes.get(t) and outcomes[t].outcome in ("failed", "error")]:
                first[test] = applied.name
                pending.remove(test)
            if not pending:
                break
    finally:
        walker.git("checkout", "--quiet", "--force", sides.patches[-1].commit)
    return [replace(v, patch=first[v.test]) if v.test in first else v for v in verdicts]


def _patch_rows(sides: Sides, verdicts: list[Verdict]) -> list[dict]:
    rows = []
    for applied in sides.patches:
        declared = applied.patch.declared_tests()
        mine = [v for v in verdicts if covered(v.test, declared)]
        regressions = [v.test for v in verdicts if v.kind == REGRESSION and (v.patch == applied.name or
                                                                            (not v.patch and covered(v.test, declared)))]
        rows.append({"patch": applied.name, "declared": list(declared), "none_reason": (applied.patch.get("Upstream-Tests") or "")
                     if not declared else "", "counts": tally(mine), "regressions": regressions,
                     "explained": [v.test for v in verdicts if v.kind == EXPLAINED and v.patch == applied.name],
                     "updates_tests": list(applied.updated_tests), "commit": applied.commit})
    return rows


def _report(upstream: Upstream, sides: Sides, paths: list[str], verdicts: list[Verdict], options) -> dict:
    return {"schema": "nam56r.upstream_tests/1", "upstream": upstream.name, "tag": upstream.tag, "commit": upstream.commit,
            "device": "gpu" if options.gpu else "cpu (CUDA hidden)", "selection": options.selection, "paths": paths,
            "base_includes": list(options.base_includes),
            "command": options.command, "date": now_utc(), "counts": tally(verdicts),
            "both_fail_causes": dict(both_fail_causes(verdicts)), "patches": _patch_rows(sides, verdicts),
            "tests": [asdict(v) for v in verdicts]}


def _print(upstream: Upstream, report: dict, verdicts: list[Verdict], log) -> None:
    rows = [[r["patch"], str(len(r["declared"])) if r["declared"] else "none", str(r["counts"].get("passed", 0)),
             str(r["counts"].get(BOTH_FAIL, 0)), str(r["counts"].get(FIXED, 0)), str(len(r["regressions"])),
             ", ".join(Path(t).name for t in r["updates_tests"]) or "-"] for r in report["patches"]]
    log(format_table(["patch", "declared", "pass both", "fail both", "fixed", "regressions", "updates tests"], rows))
    for kind in (REGRESSION, EXPLAINED, FIXED):
        for v in (v for v in verdicts if v.kind == kind):
            note = f" [first fails at {v.patch}]" if v.patch else ""
            log(f"  {kind.upper()}: {v.test}{note}: {v.why or v.cause}")
    for cause, count in report["both_fail_causes"].items():
        log(f"  fail on both sides (not ours), {count}: {cause}")
    counts = report["counts"]
    log(f"{upstream.name}: " + ", ".join(f"{counts[k]} {k}" for k in sorted(counts)) +
        ("" if not counts.get(REGRESSION) else f"  -> {counts[REGRESSION]} unexplained regression(s)"))


def _record(upstream: Upstream, sides: Sides, verdicts: list[Verdict], report: dict, options, log) -> None:
    host = host_stamp(options.python)
    for row, applied in zip(report["patches"], sides.patches, strict=True):
        regressed = bool(row["regressions"])
        counts = ", ".join(f"{n} {k}" for k, n in sorted(row["counts"].items())) or "no test of it ran"
        on_base = f"; base side includes {' '.join(options.base_includes)}" if options.base_includes else ""
        figures = (f"{report['device']}{on_base}; declared {' '.join(row['declared']) or row['none_reason']}: {counts}"
                   + (f"; regressions: {' '.join(row['regressions'])}" if regressed else "")
                   + (f"; updates {' '.join(row['updates_tests'])}" if row["updates_tests"] else ""))
        append_record(options.root, Record(
            what=record_what(options.root, applied.path), upstream=upstream.name, upstream_commit=upstream.commit,
            patch_sha256=patch_checksum(applied.path, with_tests=True), host=host, command=options.command,
            exit_code=int(regressed),
            sentinels=(REGRESSED_SENTINEL if regressed else PASSED_SENTINEL,), date=report["date"], figures=figures,
            side="gpu" if options.gpu else "cpu", tree_commit=applied.commit))
    log(f"  recorded {len(sides.patches)} patch record(s) in patches/manifest.toml ({host.line()})")
