"""A run's TensorBoard events as Megatron writes them (`training_log` in megatron/training/training.py):
every scalar by tag and step, loss curves (from the events, or from the log of a run killed before they
were flushed) and their comparison, and the time to the first step.

The tags below are Megatron's (core_v0.19.0); which flags make Megatron write each of them is listed in
`python -m nam56r.training.runs.summarize --help`. '... vs samples' tags are keyed by consumed samples, not
iterations, so `read_scalars` leaves them out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

LOSS_TAG = "lm loss"
VALID_LOSS_TAG = "lm loss validation"
RECALL_TAG = "indexer recall"  # nam56r.training.recall_probe's loss report: NaN at the steps it did not measure
ITERATION_TIME_TAG = "iteration-time"
BATCH_SIZE_TAG = "batch-size"
WORLD_SIZE_TAG = "world-size"
PEAK_MEMORY_TAG = "mem-max-allocated-bytes"
MEGATRON_THROUGHPUT_TAG = "throughput"
REQUIRED_TAGS = (LOSS_TAG, ITERATION_TIME_TAG, BATCH_SIZE_TAG)
_TAG_HINTS = {
    ITERATION_TIME_TAG: "Megatron writes it with --log-timers-to-tensorboard, at --log-interval steps after the first iteration",
    PEAK_MEMORY_TAG: "Megatron writes it with --log-memory-to-tensorboard",
    WORLD_SIZE_TAG: "Megatron writes it with --log-world-size-to-tensorboard",
}
EVENT_GLOB = "events.out.tfevents.*"
_ITERATION_LINE = r" iteration\s+(\d+)/\s*\d+ \|[^\n]*?\| {key}: (\S+) \|"


class RunLogError(ValueError):
    """The events of a run cannot be summarized; the message names the directory and the cause."""


class MissingTagError(RunLogError):
    def __init__(self, directory: Path, tag: str, present: Iterable[str]) -> None:
        self.directory, self.tag = directory, tag
        hint = f" ({_TAG_HINTS[tag]})" if tag in _TAG_HINTS else ""
        tags = ", ".join(sorted(present)) or "none"
        super().__init__(f"{directory}: the TensorBoard events have no {tag!r} scalar{hint}; tags present: {tags}")


def event_files(tensorboard_dir: Path | str) -> list[Path]:
    """The event files in `tensorboard_dir` (not its subfolders); raise FileNotFoundError if none."""
    directory = Path(tensorboard_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"TensorBoard directory {directory} does not exist (Megatron's --tensorboard-dir)")
    files = sorted(directory.glob(EVENT_GLOB))
    if not files:
        raise FileNotFoundError(
            f"no TensorBoard event files ({EVENT_GLOB}) in {directory}; Megatron writes them to --tensorboard-dir on the last rank"
        )
    return files


def read_scalars(tensorboard_dir: Path | str) -> dict[str, dict[int, float]]:
    """Every scalar of the events in `tensorboard_dir`: tag -> step -> value.

    All event files of the folder are read in order (a resumed run adds one); where a restarted run
    logs a step again, TensorBoard's orphan purge and the later value win. '... vs samples' tags
    are dropped: their "step" is consumed samples."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    directory = Path(tensorboard_dir)
    event_files(directory)
    # size_guidance 0: keep every event (the default samples 10,000 per tag, silently dropping steps).
    accumulator = event_accumulator.EventAccumulator(
        str(directory), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    tags = accumulator.Tags()
    scalars: dict[str, dict[int, float]] = {}
    for tag in tags.get(event_accumulator.SCALARS, []):
        scalars[tag] = {event.step: float(event.value) for event in accumulator.Scalars(tag)}
    for tag in tags.get(event_accumulator.TENSORS, []):  # SummaryWriter.add_scalar(new_style=True)
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "scalars":
            scalars[tag] = {event.step: float(tensor_util.make_ndarray(event.tensor_proto).item()) for event in accumulator.Tensors(tag)}
    return {tag: values for tag, values in scalars.items() if not tag.endswith(" vs samples")}


def loss_curve(tensorboard_dir: Path | str, tag: str = LOSS_TAG) -> list[tuple[int, float]]:
    """(step, value) of one loss tag, by step: the input of `compare_loss_curves`."""
    scalars = read_scalars(tensorboard_dir)
    if tag not in scalars:
        raise MissingTagError(Path(tensorboard_dir), tag, scalars)
    return sorted(scalars[tag].items())


def run_series(scalars: Mapping[str, Mapping[int, float]]) -> dict[str, list[tuple[int, float | None]]]:
    """summary.json's per-step curves, [step, value] by step: 'lm_loss' at every step it was logged and
    'lm_loss_validation' at every evaluation (a non-finite loss as None: strict JSON has no NaN), 'indexer_recall' at
    the steps the recall probe measured (Megatron logs 0/0 = NaN at the others)."""
    loss, recall = scalars.get(LOSS_TAG, {}), scalars.get(RECALL_TAG, {})
    return {
        "lm_loss": [(step, value if math.isfinite(value) else None) for step, value in sorted(loss.items())],
        "lm_loss_validation": [(step, value if math.isfinite(value) else None)
                               for step, value in sorted(scalars.get(VALID_LOSS_TAG, {}).items())],
        "indexer_recall": [(step, value) for step, value in sorted(recall.items()) if math.isfinite(value)],
    }


def time_to_first_step(tensorboard_dir: Path | str) -> float | None:
    """Seconds from the creation of the run's TensorBoard writer (Megatron makes it in
    initialize_megatron, before the model is built) to its first logged 'lm loss': the model build,
    a checkpoint load, the data loaders and the first step with its kernel compilation. Read from the
    earliest event file (a run resumed into the same folder adds later ones); None if it logs no loss."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    started = None
    for event in EventFileLoader(str(event_files(tensorboard_dir)[0])).Load():
        started = event.wall_time if started is None else started  # the first event: the writer's file_version
        if any(value.tag == LOSS_TAG for value in event.summary.value):
            return event.wall_time - started
    return None


def logged_loss_curve(log_text: str, key: str = LOSS_TAG) -> list[tuple[int, float]]:
    """(step, value of `key`) from Megatron's per-iteration log lines ('iteration 7/ 20 | ... | lm loss:
    5.43E+00 |'): the curve of a run killed before its TensorBoard writer flushed. Megatron prints at
    the second logged step of a run (or of a resumed run) the mean of the first two steps' losses;
    from the third on each line is that step's loss (its TensorBoard events are per step throughout).
    A line without the key (Megatron prints none below 0 or NaN: RECALL_TAG between probes) adds no point."""
    pattern = re.compile(_ITERATION_LINE.format(key=re.escape(key)))
    return [(int(m.group(1)), float(m.group(2))) for m in pattern.finditer(log_text)]


def compare_loss_curves(a: Sequence[tuple[int, float]], b: Sequence[tuple[int, float]], steps: Iterable[int]) -> float:
    """Largest |a - b| over `steps`, e.g. steps N+1.. of a run resumed from step N against an
    uninterrupted run. A step missing from either curve or a non-finite loss raises: a resume test
    must not pass by comparing nothing or NaNs."""
    curves = {"a": dict(a), "b": dict(b)}
    wanted = list(steps)
    if not wanted:
        raise ValueError("compare_loss_curves got no steps to compare")
    worst = 0.0
    for step in wanted:
        values = []
        for name, curve in curves.items():
            if step not in curve:
                have = f"{min(curve)}..{max(curve)}" if curve else "none"
                raise ValueError(f"step {step} is missing from curve {name} (its steps: {have}, {len(curve)} points)")
            if not math.isfinite(curve[step]):
                raise ValueError(f"curve {name} has a non-finite loss {curve[step]} at step {step}")
            values.append(curve[step])
        worst = max(worst, abs(values[0] - values[1]))
    return worst
