"""A training run's record for the validation manifest (patches/manifest.toml), read from its run directory.

    python -m nam56r.training.runs.summarize RUN_DIR --record

Every figure comes from the run's own files: `summary.json` (nam56r.training.runs.summary: steps, first and final
'lm loss', median tokens/s/GPU and TFLOP/s/GPU over its steady-state window, peak memory, time to
the first step), `recipe.json` and `command.sh` (nam56r.training.launcher). The record adds this checkout's
commit and the host stamp of the machine recording it, so record a run where it trained. The
record's shape is the patch lane's (`nam56r_patchlane.manifest.TrainRecord`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from nam56r_patchlane.checkout_state import checkout_state
from nam56r_patchlane.errors import PatchlaneError
from nam56r_patchlane.manifest import TrainRecord, append_record, host_stamp, now_utc

from nam56r import CHECKOUT_ROOT
from nam56r.training.recipe import settings_of
from nam56r.training.runs.events import LOSS_TAG
from nam56r.training.runs.layout import RunDir
from nam56r.training.runs.summary import headline

ROOT = CHECKOUT_ROOT


def checkout_commit(root: Path = ROOT) -> tuple[str, bool]:
    """(HEAD of the checkout at `root`, whether its tracked files other than the manifest differ from it)
    (`nam56r_patchlane.checkout_state`); a train record needs the commit that trained, so no commit raises."""
    state = checkout_state(root)
    if state.commit is None:
        raise ValueError(f"{state.reason}: a train record needs the commit that trained")
    return state.commit, bool(state.dirty)


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {what}")
    return json.loads(path.read_text())


def _loss(value: float | None) -> float:
    return math.nan if value is None else float(value)  # summary.json writes a non-finite loss as null


def train_record(run_dir: Path, summary_file: Path | None = None, python: str = sys.executable) -> TrainRecord:
    """The record of the nam56r.training.launcher run in `run_dir`, from its summary (default RUN_DIR/summary.json)."""
    layout = RunDir(run_dir)
    summary = _read_json(summary_file or layout.summary, f"summarize the run first (python -m nam56r.training.runs.summarize {run_dir})")
    recipe = _read_json(layout.recipe, "not a run directory of nam56r.training.launcher, which writes it at launch")
    command_path = layout.command
    if not command_path.is_file():
        raise FileNotFoundError(f"{command_path} not found: not a run directory of nam56r.training.launcher, which writes it at launch")
    if LOSS_TAG not in summary["losses"]:
        raise ValueError(f"{run_dir}: the summary has no {LOSS_TAG!r} (losses: {', '.join(summary['losses']) or 'none'})")
    figures = headline(summary)
    commit, dirty = checkout_commit()
    peak_gib, startup = figures.peak_memory_gib, figures.time_to_first_step_s
    text = (f"{LOSS_TAG} {_loss(figures.loss_first):.4f} (step {figures.first_step}) -> {_loss(figures.loss_last):.4f}"
            f" (step {figures.last_step}); {figures.tokens_per_s_per_gpu:,.0f} tokens/s/GPU,"
            f" {figures.tflops_per_s_per_gpu:.3g} TFLOP/s/GPU ({summary['window']['rule']});"
            f" peak {'not logged' if peak_gib is None else f'{peak_gib:.2f} GiB'};"
            f" first step after {'-' if startup is None else f'{startup:.0f} s'}")
    return TrainRecord(
        what=f"train:{recipe['name']}", host=host_stamp(python), commit=commit, dirty=dirty,
        command=command_path.read_text().strip(), exit_code=0 if figures.last_step >= settings_of(recipe, ("steps",))["steps"] else 1,
        sentinels=(), date=now_utc(), run_dir=str(run_dir), recipe=recipe["name"], preset=summary["preset"],
        world_size=summary["world_size"], seq_length=summary["seq_length"],
        global_batch_size=summary["median_over_window"]["global_batch_size"], first_step=figures.first_step,
        last_step=figures.last_step, loss_first=_loss(figures.loss_first), loss_final=_loss(figures.loss_last),
        tokens_per_s_per_gpu=figures.tokens_per_s_per_gpu, tflops_per_s_per_gpu=figures.tflops_per_s_per_gpu,
        peak_memory_gib=peak_gib, time_to_first_step_s=startup, figures=text,
    )


def append_train_record(run_dir: Path, root: Path = ROOT, summary_file: Path | None = None) -> tuple[TrainRecord, Path]:
    """Append the run's record to `root`/patches/manifest.toml; (the record, the manifest's path)."""
    record = train_record(run_dir, summary_file)
    try:
        return record, append_record(root, record)
    except PatchlaneError as exc:
        raise ValueError(str(exc)) from exc
