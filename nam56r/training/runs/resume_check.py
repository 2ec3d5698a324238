"""Train, checkpoint, resume: a run resumed from its step-K checkpoint must repeat the uninterrupted
run's steps K+1..N.

The DSA dense warm-up ends between the checkpoint and the last step (`ResumeCheck.dense_warmup_steps`), so
the resumed run starts inside the warm-up and switches to sparse attention itself, at Megatron's step
number (`nam56r.training.phases`); its steps must still repeat the uninterrupted run's.

Every run goes through `python -m nam56r.training.launcher` (the real launcher, Megatron's `pretrain`) on a small
corpus built from this machine's PyTorch headers. `ResumeCheck.train_args` are launcher options for every run
(e.g. `--gpus-per-node 4 --mbs 4 --ep 4 --moe-dispatch megatron` spreads the tiny recipe over 4 ranks); each
entry of `ResumeCheck.resumes` is one resumed run from the same checkpoint with its own extra options (e.g.
`--ep 2`: a checkpoint saved at EP=4 read at EP=2, which needs `--reshardable-ckpt on` in `train_args`).
`python -m nam56r.training.gpu_check` runs it at 20 steps resumed from 10; tests/nam56r/test_gpu_train.py at 40
resumed from 20. The first run of a recipe on a fresh node compiles the TileLang kernels (a minute or more);
later runs find them in TileLang's cache.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nam56r import CHECKOUT_ROOT
from nam56r.training.runs.events import LOSS_TAG, compare_loss_curves, loss_curve
from nam56r.training.runs.faults import iteration_checkpoint
from nam56r.training.runs.layout import RunDir
from nam56r.training.runs.logged_run import LoggedRun, run_logged
from nam56r.training.runs.summary import headline, resolve_tensorboard_dir

ROOT = CHECKOUT_ROOT


@dataclass(frozen=True)
class ResumeCheck:
    recipe: str = "tiny-1gpu"
    steps: int = 20
    resume_at: int = 10  # the uninterrupted run saves here; the second run resumes from it
    warmup: int = 4
    # DSA dense warm-up steps; None: halfway between resume_at and steps, so the resumed run crosses the switch
    dense_warmup: int | None = None
    tolerance: float = 0.02  # largest |lm loss difference| allowed on the resumed steps
    timeout_s: float = 1800.0  # per run; the first compiles the TileLang kernels
    train_args: tuple[str, ...] = ()  # launcher options for every run
    # One resumed run per entry, each from the step-resume_at checkpoint, with these launcher options beside train_args
    resumes: tuple[tuple[str, ...], ...] = ((),)

    def __post_init__(self) -> None:
        if not self.resumes:
            raise ValueError("resumes needs at least one entry (() resumes with the saving run's own options)")
        for options in (self.train_args, *self.resumes):
            if "--" in options:
                raise ValueError(f"launcher options {list(options)} hold '--': Megatron's flags go in megatron_flags")
        if not 0 < self.resume_at < self.steps:
            raise ValueError(f"resume_at {self.resume_at} must lie strictly between 0 and steps {self.steps}")
        if self.warmup >= self.steps:
            raise ValueError(f"warmup {self.warmup} must be below steps {self.steps}")
        if not 0 <= self.dense_warmup_steps < self.steps:
            raise ValueError(f"dense_warmup {self.dense_warmup_steps} must lie in [0, steps {self.steps})")

    @property
    def dense_warmup_steps(self) -> int:
        return (self.resume_at + self.steps) // 2 if self.dense_warmup is None else self.dense_warmup

    @property
    def resumed_names(self) -> tuple[str, ...]:
        """The resumed runs' names (and directories): resumed, resumed-2, resumed-3, ..."""
        return tuple("resumed" if i == 0 else f"resumed-{i + 1}" for i in range(len(self.resumes)))


@dataclass(frozen=True)
class TrainRun:
    """One `python -m nam56r.training.launcher` run in `run_dir`, as launched."""

    name: str
    run_dir: Path
    launch: LoggedRun

    @property
    def exit_code(self) -> int:
        return self.launch.exit_code

    def summary(self) -> dict | None:
        path = RunDir(self.run_dir).summary
        return json.loads(path.read_text()) if path.is_file() else None

    def figures(self) -> dict:
        """How it ran, and its headline figures from its summary.json (None where the run wrote none)."""
        return {"run_dir": str(self.run_dir), "command": self.launch.command, "exit_code": self.exit_code,
                "seconds": round(self.launch.seconds, 1), "log": str(self.launch.log), **asdict(headline(self.summary() or {}))}


@dataclass(frozen=True)
class ResumeResult:
    check: ResumeCheck
    runs: tuple[TrainRun, ...]  # the uninterrupted run, then the resumed ones (absent if the first failed)
    # each resumed run's largest |lm loss difference| against the uninterrupted run (None: not compared)
    loss_diffs: dict[str, float | None]
    problems: tuple[str, ...] = field(default=())

    @property
    def max_abs_loss_diff(self) -> float | None:
        diffs = list(self.loss_diffs.values())
        return None if not diffs or None in diffs else max(diffs)

    @property
    def ok(self) -> bool:
        return not self.problems


def build_tiny_data(out: Path, vocab_size: int, max_docs: int = 600) -> Path:
    """A small corpus (the first `max_docs` PyTorch headers) in `out`, unless one is already there."""
    from nam56r.training.data.build import CorpusConfig, build, torch_include_dir
    from nam56r.training.data.layout import DataDir

    if not DataDir(out).manifest.is_file():
        build(out, vocab_size, CorpusConfig(sources=(torch_include_dir(),), max_docs=max_docs))
    return out


def train_run(name: str, run_dir: Path, args: list[str], python: str = sys.executable, timeout_s: float = 1800.0,
              echo: bool = True) -> LoggedRun:
    """`python -m nam56r.training.launcher ARGS --run-dir RUN_DIR`, its output in RUN_DIR.log (echoed as '[train NAME] ...')."""
    cut = args.index("--") if "--" in args else len(args)  # Megatron's extra flags stay last
    command = [python, "-m", "nam56r.training.launcher", *args[:cut], "--run-dir", str(run_dir), *args[cut:]]
    return run_logged(command, run_dir.with_name(run_dir.name + ".log"), f"train {name}", ROOT, timeout_s, echo)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)  # summary.json writes a non-finite loss as null


def assess(check: ResumeCheck, full: TrainRun, resumed: tuple[TrainRun, ...]) -> ResumeResult:
    """Judge the runs from their run directories: every run finished and summarized, the uninterrupted
    run's loss fell, and each resumed run starts at step resume_at+1 and repeats the uninterrupted run's
    losses within the tolerance. `resumed` is empty when the first run failed."""
    runs = (full, *resumed)
    problems = []
    for run in runs:
        if run.exit_code != 0:
            problems.append(f"the {run.name} run exited {run.exit_code}; its log ends:\n{run.launch.tail()}")
        elif run.summary() is None:
            problems.append(f"the {run.name} run wrote no {RunDir(run.run_dir).summary}")
    if not resumed and not problems:
        problems.append("the resumed run did not run")
    diffs: dict[str, float | None] = {run.name: None for run in resumed}
    if problems:
        return ResumeResult(check, runs, diffs, tuple(problems))
    figures = full.figures()
    if not (_finite(figures["loss_first"]) and _finite(figures["loss_last"])):
        problems.append(f"the full run's {LOSS_TAG} is not finite: {figures['loss_first']} -> {figures['loss_last']}")
    elif figures["loss_last"] >= figures["loss_first"]:
        problems.append(f"the full run's {LOSS_TAG} did not fall: {figures['loss_first']:.4f} -> {figures['loss_last']:.4f}")
    try:
        full_curve = loss_curve(resolve_tensorboard_dir(full.run_dir))
    except (FileNotFoundError, ValueError) as exc:
        problems.append(f"cannot read the uninterrupted run's loss curve to compare the resumed runs with: {exc}")
        return ResumeResult(check, runs, diffs, tuple(problems))
    for run in resumed:
        try:
            resumed_curve = loss_curve(resolve_tensorboard_dir(run.run_dir))
            if resumed_curve[0][0] != check.resume_at + 1:
                problems.append(f"the {run.name} run's first logged step is {resumed_curve[0][0]}, not {check.resume_at + 1}:"
                                " it did not continue from its checkpoint")
            diffs[run.name] = compare_loss_curves(full_curve, resumed_curve, range(check.resume_at + 1, check.steps + 1))
        except (FileNotFoundError, ValueError) as exc:
            problems.append(f"cannot compare the {run.name} run's steps with the uninterrupted run: {exc}")
        diff = diffs[run.name]
        if diff is not None and not diff < check.tolerance:
            problems.append(f"the {run.name} run's steps {check.resume_at + 1}-{check.steps} differ from the uninterrupted run"
                            f" by up to {diff:.5f} (tolerance {check.tolerance})")
    return ResumeResult(check, runs, diffs, tuple(problems))


def drop_checkpoint(checkpoints: Path, step: int) -> None:
    """Delete Megatron's checkpoint of `step` under `checkpoints`, if there is one. The uninterrupted run's last
    checkpoint is never read, and at the proxy's size (44 GiB a checkpoint) it and the resumed run's would not fit a
    node's disk beside the checkpoint the resume reads."""
    shutil.rmtree(iteration_checkpoint(checkpoints, step), ignore_errors=True)


def run_resume_check(check: ResumeCheck, out_dir: Path, data: Path, python: str = sys.executable,
                     megatron_flags: tuple[str, ...] = (), echo: bool = True) -> ResumeResult:
    """The uninterrupted run (checkpoints at resume_at and at the end; the last is dropped once it ends) in OUT/full,
    then each resumed run (`ResumeCheck.resumes`) from its step-resume_at checkpoint in OUT/<name>, one after another,
    judged by `assess`. `megatron_flags` go to every run after `--`."""
    common = ["--recipe", check.recipe, *check.train_args, "--warmup", str(check.warmup), "--steps", str(check.steps),
              "--dense-warmup-steps", str(check.dense_warmup_steps), "--data", str(data)]
    full_dir = out_dir / "full"
    extra = ["--", *megatron_flags] if megatron_flags else []
    launch = train_run("full", full_dir, [*common, "--save-interval", str(check.resume_at), *extra], python, check.timeout_s, echo)
    full = TrainRun("full", full_dir, launch)
    if full.exit_code != 0:
        return assess(check, full, ())
    drop_checkpoint(RunDir(full_dir).checkpoints, check.steps)
    resumed = []
    for name, options in zip(check.resumed_names, check.resumes, strict=True):
        run_dir = out_dir / name
        launch = train_run(
            name, run_dir,
            [*common, *options, "--save-interval", str(check.steps), "--load", str(RunDir(full_dir).checkpoints),
             "--save", str(RunDir(run_dir).checkpoints), "--", *megatron_flags, "--ckpt-step", str(check.resume_at)],
            python, check.timeout_s, echo,
        )
        resumed.append(TrainRun(name, run_dir, launch))
        drop_checkpoint(RunDir(run_dir).checkpoints, check.steps)  # never read; each would take a checkpoint's disk
    return assess(check, full, tuple(resumed))
