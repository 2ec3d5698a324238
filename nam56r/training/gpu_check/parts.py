"""The check's parts, each a dict for the summary with its status and problems: `tests` (pytest -m gpu, read from its
JUnit XML, recorded as one `gpu-tests` manifest record), `packs` (tools/packs.py run, with each pack's verdict and
records), `train` (nam56r.training.runs.resume_check's train, checkpoint and resume, each run recorded) and `upstream`
(upstream_part.py)."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from nam56r_patchlane.errors import PatchlaneError
from nam56r_patchlane.junit import read_cases

from nam56r.training.gpu_check.options import COVERED_BY_TRAIN, ROOT, Options, launcher_recipe
from nam56r.training.gpu_check.upstream_part import upstream_part
from nam56r.training.runs.logged_run import run_logged
from nam56r.training.runs.resume_check import ResumeResult, build_tiny_data, run_resume_check

if TYPE_CHECKING:
    from nam56r_patchlane.manifest import GpuTestsRecord


def read_junit(path: Path) -> list[dict]:
    """Each test case of a pytest JUnit XML file (junit_family=xunit1): id, outcome, seconds, message."""
    return [asdict(case) for case in read_cases(path, message_chars=500)]


def pytest_part(opts: Options) -> dict:
    junit, log = opts.out_dir / "tests-junit.xml", opts.out_dir / "tests.log"
    deselected = [] if "train" in opts.skip else [COVERED_BY_TRAIN]
    command = [opts.python, "-m", "pytest", "-m", "gpu", *opts.test_paths, "-v", "-rA", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-o", "junit_family=xunit1", *(f"--deselect={d}" for d in deselected)]
    run = run_logged(command, log, "tests", opts.root, echo=opts.echo)
    tests = read_junit(junit) if junit.is_file() else []
    counts = Counter(t["outcome"] for t in tests)
    problems = []
    if run.exit_code == 5:
        problems.append(f"pytest collected no GPU test under {' '.join(opts.test_paths)} (exit 5)")
    elif run.exit_code != 0:
        bad = [t["id"] for t in tests if t["outcome"] in ("failed", "error")]
        problems.append(f"pytest exited {run.exit_code}: {counts['failed']} failed, {counts['error']} error(s)"
                        + (f": {', '.join(bad)}" if bad else f"; its log ends:\n{run.tail()}"))
    if not junit.is_file():
        problems.append(f"pytest wrote no {junit}")
    records = []
    if opts.record and tests:
        try:  # outcomes are history: a failing run is recorded too
            records.append(asdict(append_tests_record(opts, command, run.exit_code, tests, log)))
        except (OSError, ValueError, PatchlaneError) as exc:
            problems.append(f"the GPU tests were not recorded: {exc}")
    return {"status": "failed" if problems else "passed", "command": command, "exit_code": run.exit_code, "log": str(log),
            "junit": str(junit), "counts": dict(counts), "tests": tests, "records": records,
            "deselected": [{"id": d, "reason": "the train part runs this check at 20 steps"} for d in deselected],
            "problems": problems}


SENTINEL_LINE = re.compile(r"^[A-Z0-9]+(?:_[A-Z0-9]+)*_OK\b.*$", re.M)  # what a passing GPU test prints with its figures


def append_tests_record(opts: Options, command: list[str], exit_code: int, tests: list[dict], log: Path) -> GpuTestsRecord:
    """The tests' outcomes and their sentinel lines (from pytest's -rA report in `log`) as one
    `gpu-tests` record appended to <root>/patches/manifest.toml."""
    from nam56r_patchlane.manifest import GpuTestsRecord, append_record, host_stamp, now_utc

    from nam56r.training.runs.record import checkout_commit

    commit, dirty = checkout_commit(opts.root)
    by = {outcome: tuple(t["id"] for t in tests if t["outcome"] in kinds)
          for outcome, kinds in (("passed", ("passed",)), ("failed", ("failed", "error")), ("skipped", ("skipped",)))}
    sentinels = tuple(dict.fromkeys(line[:400] for line in SENTINEL_LINE.findall(log.read_text(errors="replace"))))
    record = GpuTestsRecord(what="gpu-tests", host=host_stamp(opts.python), commit=commit, dirty=dirty,
                            command=" ".join(command), exit_code=exit_code, sentinels=sentinels, date=now_utc(),
                            passed=by["passed"], failed=by["failed"], skipped=by["skipped"],
                            figures=f"{len(by['passed'])} passed, {len(by['failed'])} failed, {len(by['skipped'])} skipped")
    append_record(opts.root, record)
    return record


def packs_part(opts: Options, alone: str = "with-others") -> dict:
    """The GPU packs; `alone` is tools/packs.py run's --alone (`skip` while other parts share the GPU)."""
    name = "packs" if alone != "only" else "packs-alone"
    report, log = opts.out_dir / f"{name}.json", opts.out_dir / f"{name}.log"
    command = [opts.python, str(ROOT / "tools" / "packs.py"), "--root", str(opts.root), "--python", opts.python,
               "run", "--all", "--needs", opts.packs_needs, "--jobs", str(opts.pack_jobs), "--alone", alone, "--json", str(report),
               *([] if opts.record else ["--no-record"])]
    run = run_logged(command, log, name, opts.root, echo=opts.echo)
    part = {"command": command, "exit_code": run.exit_code, "log": str(log), "report": str(report)}
    if not report.is_file():
        return {**part, "status": "failed", "packs": [], "records": [],
                "problems": [f"tools/packs.py exited {run.exit_code} without writing {report}; its log ends:\n{run.tail()}"]}
    packs = json.loads(report.read_text())["packs"]
    verdicts = [{"pack": p["pack"], "verdict": p["verdict"], "seconds": p["seconds"], "problems": p["problems"],
                 "sides": [{k: s[k] for k in ("side", "exit_code", "sentinels")} for s in p["sides"]]} for p in packs]
    problems = [f"{p['pack']}: {p['verdict']}" + (f": {p['problems'][0]}" if p["problems"] else "")
                for p in packs if p["verdict"] not in ("passed", "PARKED")]
    if run.exit_code != 0 and not problems:
        problems.append(f"tools/packs.py exited {run.exit_code}; its log ends:\n{run.tail()}")
    return {**part, "status": "failed" if problems else "passed", "counts": dict(Counter(p["verdict"] for p in packs)),
            "packs": verdicts, "records": [r for p in packs for r in p["records"]], "problems": problems}


def train_part(opts: Options) -> dict:
    check, out = opts.check, opts.out_dir / "train"
    data = opts.data or build_tiny_data(out / "data", launcher_recipe(check).model_config().vocab_size)
    return train_summary(opts, run_resume_check(check, out, data, opts.python, opts.megatron_flags, opts.echo), data)


def train_summary(opts: Options, result: ResumeResult, data: Path) -> dict:
    """The train part from the runs' own directories; appends each run that trained to the manifest."""
    from nam56r.training.runs.record import append_train_record

    check = result.check
    problems, records = list(result.problems), []
    for run in result.runs if opts.record else ():
        if run.summary() is None:
            continue
        try:  # records are history: a run that trained is recorded even when the resume check fails
            record, _ = append_train_record(run.run_dir, opts.root)
            records.append(asdict(record))
        except (FileNotFoundError, ValueError) as exc:
            problems.append(f"the {run.name} run was not recorded: {exc}")
    return {"status": "failed" if problems else "passed", "recipe": check.recipe, "train_args": list(check.train_args),
            "steps": check.steps, "resume_at": check.resume_at, "data": str(data),
            "runs": {run.name: run.figures() for run in result.runs},
            "resume": {"compared_steps": [check.resume_at + 1, check.steps], "max_abs_loss_diff": result.max_abs_loss_diff,
                       "tolerance": check.tolerance,
                       "runs": {name: {"launcher_args": list(options), "max_abs_loss_diff": result.loss_diffs.get(name)}
                                for name, options in zip(check.resumed_names, check.resumes, strict=True)}},
            "records": records, "problems": problems}


def merge_packs_parts(together: dict, alone: dict) -> dict:
    """The packs part of a concurrent check: the packs run beside the other parts, then the `alone` packs."""
    if alone["status"] == "failed" and "packs" not in alone:  # the runner crashed
        return {**together, "status": "failed", "problems": together.get("problems", []) + alone["problems"]}
    packs = together.get("packs", []) + alone["packs"]
    problems = together.get("problems", []) + alone["problems"]
    return {**together, "status": "failed" if problems or "failed" in (together["status"], alone["status"]) else "passed",
            "seconds": together["seconds"] + alone["seconds"], "alone": {k: alone[k] for k in ("command", "exit_code", "log", "report")},
            "counts": dict(Counter(p["verdict"] for p in packs)), "packs": packs,
            "records": together.get("records", []) + alone["records"], "problems": problems}


PART_RUNNERS: dict[str, Callable[[Options], dict]] = {
    "tests": pytest_part, "packs": lambda opts: packs_part(opts, "skip" if opts.concurrent else "with-others"), "train": train_part,
    "packs-alone": lambda opts: packs_part(opts, "only"), "upstream": upstream_part,
}
