"""The acceptance check of a GPU node, after `nox -s build`: every GPU test, every GPU pack, and a
tiny training run with a checkpoint and a resume, summarized in one JSON file.

    python -m nam56r.training.gpu_check [--out-dir DIR] [--skip-tests] [--skip-packs] [--skip-train]
    nox -s gpu-check -- [the same options]

Parts, in order, each with a status (passed | failed | skipped), its wall time and key figures:
  tests  `pytest -m gpu tests/`: every GPU test's outcome, read from pytest's JUnit XML, and one
         `gpu-tests` record in patches/manifest.toml with the outcomes and the passing tests' sentinel lines. With the
         train part on, the 40-step resume test (tests/nam56r/test_gpu_train.py) is deselected: the
         train part runs the same check at 20 steps.
  packs  `tools/packs.py run --all --needs gpu --jobs 3`: each pack's verdict, per side its exit code and
         sentinels, and the records it appended to patches/manifest.toml.
  train  the tiny recipe for 20 steps with a checkpoint at step 10, then a run resumed from that
         checkpoint for steps 11-20 (nam56r.training.resume_check; --recipe, --train-args and --resume-args
         change the runs, e.g. 4 ranks at EP=4 resumed at EP=4 and at EP=2): per run the first and last loss,
         tokens/s/GPU, TFLOP/s/GPU, peak memory and time to the first step, and the largest |loss
         difference| of the resumed steps against the uninterrupted run; both runs' train records
         appended to patches/manifest.toml (nam56r.training.train_record).
The parts run at the same time by default: each is a few processes that compile TileLang kernels on
the host and share the GPU (the largest, the proxy model's forward and backward, takes under 50 GiB).
`--sequential` runs them one after another, for a GPU too small to hold them together. The summary
(default runs/gpu-check-<time>/summary.json) is rewritten as each part ends, so a check cut short still
leaves what it found; each part's full output is in a log beside it.
`--kernel-cache DIR` points every part's Triton, TileLang and Inductor caches into a portable kernel cache
(nam56r.training.kernel_cache): a cache filled on a node of the same stack serves the check without compiling, an empty
DIR is filled by it, and one of another stack is refused (exit 2) naming the difference.
Exit codes: 0 every part that ran passed; 1 a part failed; 2 no CUDA GPU on this host (nothing runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import shlex
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nam56r_patchlane.errors import PatchlaneError

from nam56r import CHECKOUT_ROOT
from nam56r.training.kernel_cache import ON_MISMATCH, CacheUse, KernelCacheError, host_key, open_cache, record_fill, weight_line
from nam56r.training.logged_run import run_logged
from nam56r.training.recipe import Recipe, RecipeError
from nam56r.training.resume_check import ResumeCheck, ResumeResult, build_tiny_data, run_resume_check

ROOT = CHECKOUT_ROOT
SCHEMA = "nam56r.gpu_check/1"
EXIT_FAILED, EXIT_NO_GPU, EXIT_USAGE = 1, 2, 2
PARTS = ("tests", "packs", "train")
# The train part runs this test's check (train, save, resume, compare) at 20 steps; the test runs 40.
COVERED_BY_TRAIN = "tests/nam56r/test_gpu_train.py::test_tiny_run_loss_falls_and_resume_repeats_the_curve"


@dataclass(frozen=True)
class Options:
    out_dir: Path
    root: Path = ROOT
    python: str = sys.executable
    skip: frozenset[str] = frozenset()  # part names
    test_paths: tuple[str, ...] = ("tests",)
    packs_needs: str = "gpu"
    record: bool = True  # append the packs' and the train runs' records to <root>/patches/manifest.toml
    check: ResumeCheck = field(default_factory=ResumeCheck)
    data: Path | None = None  # default: a small corpus built into OUT/train/data
    megatron_flags: tuple[str, ...] = ()
    echo: bool = True
    concurrent: bool = True  # the parts run at the same time on one GPU
    pack_jobs: int = 3  # packs run side by side within the packs part
    kernel_cache: CacheUse | None = None  # every part's processes compile into and load from it


def cuda_gpu_problem() -> str | None:
    """Why this host cannot run the check, or None when torch sees a CUDA GPU."""
    try:
        import torch
    except ImportError as exc:
        return f"torch does not import here ({exc}): build the environment first (`nox -s build`)"
    if torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"no CUDA GPU visible to torch {torch.__version__} (built for CUDA {torch.version.cuda or 'none: a CPU-only build'};"
            f" CUDA_VISIBLE_DEVICES={'unset' if visible is None else repr(visible)}). Run it on a GPU node, after `nox -s build`.")


def read_junit(path: Path) -> list[dict]:
    """Each test case of a pytest JUnit XML file (junit_family=xunit1): id, outcome, seconds, message."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        file, name, classname = case.get("file", ""), case.get("name", ""), case.get("classname", "")
        module = file.removesuffix(".py").replace("/", ".")
        owner = classname[len(module) + 1:] if module and classname.startswith(module + ".") else ""
        test_id = "::".join(p for p in (file or classname, owner, name) if p)
        outcome, message = "passed", ""
        for tag, label in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                outcome, message = label, found.get("message", "")
                break
        cases.append({"id": test_id, "outcome": outcome, "seconds": round(float(case.get("time", 0) or 0), 3), "message": message[:500]})
    return cases


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


def append_tests_record(opts: Options, command: list[str], exit_code: int, tests: list[dict], log: Path):
    """The tests' outcomes and their sentinel lines (from pytest's -rA report in `log`) as one
    `gpu-tests` record appended to <root>/patches/manifest.toml."""
    from nam56r_patchlane.manifest import GpuTestsRecord, append_record, host_stamp, now_utc

    from nam56r.training.train_record import checkout_commit

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


def launcher_recipe(check: ResumeCheck, options: tuple[str, ...] = ()) -> Recipe:
    """The recipe the launcher makes of the check's recipe, its `train_args` and `options` (refused as the launcher
    refuses them)."""
    from nam56r.training.train import recipe_from
    from nam56r.training.train_args import parse_args

    args, _ = parse_args(["--recipe", check.recipe, *check.train_args, *options], "")
    return recipe_from(args, kernels=False)


def train_part(opts: Options) -> dict:
    check, out = opts.check, opts.out_dir / "train"
    data = opts.data or build_tiny_data(out / "data", launcher_recipe(check).model_config().vocab_size)
    return train_summary(opts, run_resume_check(check, out, data, opts.python, opts.megatron_flags, opts.echo), data)


def train_summary(opts: Options, result: ResumeResult, data: Path) -> dict:
    """The train part from the runs' own directories; appends each run that trained to the manifest."""
    from nam56r.training.train_record import append_train_record

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
    "packs-alone": lambda opts: packs_part(opts, "only"),
}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stamp(opts: Options) -> dict:
    """The host (as the manifest stamps it) and the commit of the code that runs the check."""
    from nam56r_patchlane.checkout_state import checkout_state
    from nam56r_patchlane.manifest import host_stamp

    state = checkout_state(opts.root)
    commit = state.commit if state.commit is not None else f"unknown: {state.reason}"
    return {"host": asdict(host_stamp(opts.python)), "commit": commit, "dirty": state.dirty}


def _kernel_cache_summary(use: CacheUse | None) -> dict | None:
    if use is None:
        return None
    from nam56r.training.kernel_cache import read_manifest

    manifest = read_manifest(use.directory)
    return {"directory": str(use.directory), "state": use.state, "message": use.message,
            "before": {"weight": weight_line(manifest), "total_bytes": manifest.to_json()["total_bytes"],
                       "key": manifest.to_json()["key"]} if manifest else None}


def write_summary(summary: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(path)  # never a half-written summary


def _run_part(name: str, opts: Options) -> dict:
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


def run_check(opts: Options, command: str = "python -m nam56r.training.gpu_check") -> dict:
    """Run every part not in opts.skip (at the same time unless opts.concurrent is off); the summary
    (also written to OUT/summary.json after each part ends)."""
    path = opts.out_dir / "summary.json"
    started = time.monotonic()
    summary = {"schema": SCHEMA, "status": "running", "exit_code": None, "command": command, "out_dir": str(opts.out_dir),
               "started_utc": _now(), "finished_utc": None, "seconds": None, "concurrent": opts.concurrent, **_stamp(opts),
               "kernel_cache": _kernel_cache_summary(opts.kernel_cache),
               "parts": {name: ({"status": "skipped", "reason": f"--skip-{name}"} if name in opts.skip else {"status": "pending"})
                         for name in PARTS}}
    write_summary(summary, path)
    written = threading.Lock()

    def run_and_write(name: str) -> None:
        part = _run_part(name, opts)
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
                summary["parts"]["packs"] = merge_packs_parts(summary["parts"]["packs"], _run_part("packs-alone", opts))
                write_summary(summary, path)
    else:
        for name in to_run:
            run_and_write(name)
    if opts.kernel_cache is not None and opts.kernel_cache.state != "ignored":
        manifest = record_fill(opts.kernel_cache.directory, "gpu-check")
        summary["kernel_cache"]["after"] = {"weight": weight_line(manifest), "total_bytes": manifest.to_json()["total_bytes"]}
    failed = [n for n, p in summary["parts"].items() if p["status"] == "failed"]
    summary.update(status="failed" if failed else "passed", exit_code=EXIT_FAILED if failed else 0, finished_utc=_now(),
                   seconds=round(time.monotonic() - started, 1))
    write_summary(summary, path)
    return summary


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nam56r.training.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, help="where the summary and the logs go (default runs/gpu-check-<time>)")
    for name in PARTS:
        parser.add_argument(f"--skip-{name}", action="store_true", help=f"do not run the {name} part")
    parser.add_argument("--tests", nargs="+", default=["tests"], metavar="PATH", help="what pytest -m gpu collects (default: tests)")
    parser.add_argument("--recipe", default="tiny-1gpu", help="the train part's recipe (default: tiny-1gpu)")
    parser.add_argument("--steps", type=int, default=20, help="the train part's steps (default: 20)")
    parser.add_argument("--resume-at", type=int, default=10, help="the checkpoint step the second run resumes from (default: 10)")
    parser.add_argument("--train-args", default="", metavar="'OPTIONS'",
                        help="launcher options for every train-part run, one quoted string, e.g. "
                             "'--gpus-per-node 4 --mbs 4 --ep 4 --moe-dispatch megatron --reshardable-ckpt on' (default: none)")
    parser.add_argument("--resume-args", action="append", metavar="'OPTIONS'",
                        help="one resumed run from the same checkpoint per use, with these launcher options beside "
                             "--train-args; e.g. --resume-args '' --resume-args '--ep 2' resumes at the saving run's EP "
                             "and at EP=2 (default: one resumed run, '')")
    parser.add_argument("--data", type=Path, help="the train part's data directory (default: a small corpus built into OUT/train/data)")
    parser.add_argument("--no-record", action="store_true", help="append nothing to patches/manifest.toml")
    parser.add_argument("--pack-jobs", type=int, default=3, metavar="N", help="packs run side by side in the packs part (default: 3)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the parts one after another (default: at the same time, sharing the GPU; about 50 GiB at peak)")
    parser.add_argument("--kernel-cache", type=Path, metavar="DIR",
                        help="a portable compiled-kernel cache (`nox -s prewarm`) every part loads kernels from and compiles new "
                             "ones into; an empty or new DIR is filled by this check; one of another stack is refused, naming "
                             "the difference")
    parser.add_argument("--kernel-cache-mismatch", choices=ON_MISMATCH, default="refuse",
                        help="a --kernel-cache of another stack: refuse (default, exit 2) or ignore it, saying so")
    parser.add_argument("megatron_flags", nargs="*", help="extra Megatron flags for both training runs, after `--`")
    return parser.parse_args(argv)


def resume_check_from(args: argparse.Namespace) -> ResumeCheck:
    """The train part's check; its launcher options are refused here, as the launcher would refuse them, before any
    GPU work."""
    check = ResumeCheck(recipe=args.recipe, steps=args.steps, resume_at=args.resume_at,
                        train_args=tuple(_split(args.train_args, "--train-args")),
                        resumes=tuple(tuple(_split(text, "--resume-args")) for text in (args.resume_args or [""])))
    for options in check.resumes:
        try:
            launcher_recipe(check, options)
        except (KeyError, RecipeError) as exc:
            raise ValueError(f"the train part's launcher options {[*check.train_args, *options]}: {exc}") from exc
        except SystemExit as exc:  # argparse has printed why
            raise ValueError(f"the train part's launcher options {[*check.train_args, *options]} are not the launcher's") from exc
    return check


def _split(text: str, option: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{option} {text!r}: {exc}") from exc


def options_from(args: argparse.Namespace) -> Options:
    out_dir = args.out_dir or ROOT / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    return Options(out_dir=out_dir.resolve(), skip=frozenset(n for n in PARTS if getattr(args, f"skip_{n}")),
                   test_paths=tuple(args.tests), record=not args.no_record,
                   check=resume_check_from(args),
                   data=args.data.resolve() if args.data else None, megatron_flags=tuple(args.megatron_flags),
                   concurrent=not args.sequential, pack_jobs=args.pack_jobs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        opts = options_from(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if problem := cuda_gpu_problem():
        print(f"error: gpu-check needs a CUDA GPU: {problem}", file=sys.stderr)
        return EXIT_NO_GPU
    if args.kernel_cache is not None:
        try:
            use = open_cache(args.kernel_cache, host_key(opts.python), args.kernel_cache_mismatch)
        except KernelCacheError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"gpu-check: {use.message}", flush=True)
        os.environ.update(use.env)  # every part's processes inherit it
        opts = dataclasses.replace(opts, kernel_cache=use)
    print(f"gpu-check: summary {opts.out_dir / 'summary.json'}", flush=True)
    summary = run_check(opts, " ".join(["python -m nam56r.training.gpu_check", *(sys.argv[1:] if argv is None else argv)]))
    print(report(summary))
    print(f"gpu-check: summary {opts.out_dir / 'summary.json'}")
    return summary["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
