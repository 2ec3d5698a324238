"""Per-step metrics, a steady-state summary and the loss/throughput plot of a run, from the
TensorBoard events Megatron writes (`training_log` in megatron/training/training.py).

    python -m nam56r.training.runlog RUN_DIR                  # a run of nam56r.training.train: its model_config.json and recipe.json
    python -m nam56r.training.runlog RUN_DIR --preset nam56r --seq 4096 --world-size 8

Works on a run in progress (it reads what has been flushed). Writes, next to the events unless
`--out` says otherwise: `metrics.jsonl` (one line per logged step with every scalar Megatron wrote
there, plus tokens/s/GPU and TFLOP/s/GPU), `summary.json` (medians over a stated steady-state
window, peak memory, first/last losses, the time to the first step, the FLOP formula) and
`loss_throughput.png`. `--record` then appends the run's train record to patches/manifest.toml
(`nam56r.training.train_record`).

Megatron's tags (core_v0.19.0): 'lm loss' and the other loss keys ('mtp_1 loss', 'indexer loss')
at every --tensorboard-log-interval step; 'iteration-time' (seconds per iteration, averaged over
the log interval; only with --log-timers-to-tensorboard, and never at the first iteration) and
Megatron's own 'throughput' at --log-interval steps; 'mem-max-allocated-bytes' with
--log-memory-to-tensorboard; 'batch-size'; 'world-size' with --log-world-size-to-tensorboard;
'<key> validation' after evaluations. '... vs samples' tags are keyed by consumed samples, not
iterations, so they are left out. Throughput uses our FLOP formula (`nam56r.model.flops`), not
Megatron's 'throughput', whose formula knows neither Mamba-3, DSA nor the n-gram embedding.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nam56r.model.config import ModelConfig
from nam56r.model.flops import FORMULA, flops_per_token
from nam56r.training.run_dir import RunDir

LOSS_TAG = "lm loss"
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
# Iterations 3..25 of the run: the first two carry kernel compilation/autotuning and allocator warm-up.
DEFAULT_WINDOW = (3, 25)
SHORT_RUN_SHARE = 0.8  # a run that has not reached the window's end: its last 80% of timed steps
_PLOTTED_LOSS = re.compile(r"^(lm|mtp_\d+) loss( validation.*)?$")
_LOSS = re.compile(r"loss( validation.*)?$")  # 'lm loss', 'mtp_1 loss', 'indexer loss', 'lm loss validation'; not 'loss-scale'

EVENT_GLOB = "events.out.tfevents.*"



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


_ITERATION_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")


def logged_loss_curve(log_text: str) -> list[tuple[int, float]]:
    """(step, lm loss) from Megatron's per-iteration log lines ('iteration 7/ 20 | ... | lm loss:
    5.43E+00 |'): the curve of a run killed before its TensorBoard writer flushed. Megatron prints at
    the second logged step of a run (or of a resumed run) the mean of the first two steps' losses;
    from the third on each line is that step's loss (its TensorBoard events are per step throughout)."""
    return [(int(m.group(1)), float(m.group(2))) for m in _ITERATION_LINE.finditer(log_text)]


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


@dataclass(frozen=True)
class SteadyWindow:
    """The steps the medians are taken over, and the rule that chose them."""

    first_step: int
    last_step: int
    steps: int  # timed steps inside the window
    rule: str


@dataclass(frozen=True)
class RunSummary:
    tensorboard_dir: str
    preset: str
    seq_length: int
    world_size: int
    formula: str
    flops_per_token: float
    window: SteadyWindow
    global_batch_size: int  # median over the window
    iteration_time_s: float  # medians over the window from here
    tokens_per_s_per_gpu: float
    tflops_per_s_per_gpu: float
    megatron_throughput_tflops: float | None  # Megatron's own 'throughput' (its formula), for comparison
    peak_memory_bytes: float | None  # max of 'mem-max-allocated-bytes' over the run
    losses: Mapping[str, Mapping[str, float]]  # loss tag -> first_step, first, last_step, last
    first_step: int
    last_step: int
    files: Mapping[str, str]
    time_to_first_step_s: float | None = None  # see time_to_first_step()

    def to_json(self) -> dict:
        return {
            "preset": self.preset,
            "seq_length": self.seq_length,
            "world_size": self.world_size,
            "tensorboard_dir": self.tensorboard_dir,
            "flop_formula": self.formula,
            "flops_per_token": self.flops_per_token,
            "steps": {"first": self.first_step, "last": self.last_step},
            "time_to_first_step_s": self.time_to_first_step_s,
            "window": {
                "first_step": self.window.first_step,
                "last_step": self.window.last_step,
                "timed_steps": self.window.steps,
                "rule": self.window.rule,
            },
            "median_over_window": {
                "global_batch_size": self.global_batch_size,
                "iteration_time_s": self.iteration_time_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tflops_per_s_per_gpu": self.tflops_per_s_per_gpu,
                "megatron_throughput_tflops_per_s_per_gpu": self.megatron_throughput_tflops,
            },
            "peak_memory": {
                "bytes": self.peak_memory_bytes,
                "gib": self.peak_memory_bytes / 2**30 if self.peak_memory_bytes is not None else None,
                "source": f"max of {PEAK_MEMORY_TAG!r} (allocated_bytes.all.peak of the last rank)",
            },
            "losses": {tag: dict(values) for tag, values in self.losses.items()},
            "files": dict(self.files),
        }


def _value_at_or_before(series: Mapping[int, float], step: int) -> float | None:
    earlier = [s for s in series if s <= step]
    return series[max(earlier)] if earlier else None


def choose_window(timed_steps: Sequence[int], first_step: int, window: tuple[int, int] = DEFAULT_WINDOW) -> SteadyWindow:
    """Iterations window[0]..window[1] of the run (counted from its first logged step as 1), or,
    when the run has not reached the window's end or logs no timed step inside it, the last 80% of
    its timed steps."""
    lo, hi = window
    if not 1 <= lo <= hi:
        raise ValueError(f"window must be 1 <= first <= last iteration, got {window}")
    if not timed_steps:
        raise ValueError("no timed steps to choose a window from")
    steps = sorted(timed_steps)
    first, last = first_step + lo - 1, first_step + hi - 1
    inside = [s for s in steps if first <= s <= last]
    if steps[-1] >= last and inside:
        return SteadyWindow(first, last, len(inside), f"iterations {lo}..{hi} of the run (steps {first}..{last}); earlier ones are warm-up")
    keep = max(1, math.ceil(SHORT_RUN_SHARE * len(steps)))
    why = f"the run has not reached step {last}" if steps[-1] < last else f"no timed step within steps {first}..{last}"
    chosen = steps[-keep:]
    return SteadyWindow(chosen[0], chosen[-1], keep, f"last {SHORT_RUN_SHARE:.0%} of the {len(steps)} timed steps ({keep} steps): {why}")


def _json_value(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON has no NaN/inf: written as null


@dataclass(frozen=True)
class Headline:
    """A run's headline figures as its summary.json states them; None where it states none (a run that
    logged nothing, a non-finite loss, a memory or startup figure not logged)."""

    first_step: int | None
    last_step: int | None
    loss_first: float | None  # LOSS_TAG at first_step
    loss_last: float | None  # LOSS_TAG at last_step
    tokens_per_s_per_gpu: float | None  # medians over the summary's steady-state window
    tflops_per_s_per_gpu: float | None
    peak_memory_gib: float | None
    time_to_first_step_s: float | None


def headline(summary: dict) -> Headline:
    """The one reader of a summary's headline figures (gpu-check's run figures, the manifest's train records)."""
    loss = summary.get("losses", {}).get(LOSS_TAG, {})
    medians, steps = summary.get("median_over_window", {}), summary.get("steps", {})
    return Headline(first_step=steps.get("first"), last_step=steps.get("last"), loss_first=loss.get("first"),
                    loss_last=loss.get("last"), tokens_per_s_per_gpu=medians.get("tokens_per_s_per_gpu"),
                    tflops_per_s_per_gpu=medians.get("tflops_per_s_per_gpu"),
                    peak_memory_gib=summary.get("peak_memory", {}).get("gib"),
                    time_to_first_step_s=summary.get("time_to_first_step_s"))


def summarize_run(
    tensorboard_dir: Path | str,
    config: ModelConfig,
    seq_length: int,
    world_size: int,
    out_dir: Path | str,
    *,
    window: tuple[int, int] = DEFAULT_WINDOW,
) -> RunSummary:
    """Read the run's events, write metrics.jsonl, summary.json and loss_throughput.png to
    `out_dir`, and return the summary. tokens/s/GPU = batch-size x seq_length / iteration-time /
    world_size; TFLOP/s/GPU = nam56r.model.flops step FLOPs / iteration-time / world_size / 1e12."""
    directory = Path(tensorboard_dir)
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    scalars = read_scalars(directory)
    for tag in REQUIRED_TAGS:
        if not scalars.get(tag):
            raise MissingTagError(directory, tag, scalars)
    if logged := scalars.get(WORLD_SIZE_TAG):
        sizes = {int(v) for v in logged.values()}
        if sizes != {world_size}:
            raise RunLogError(f"{directory}: the run logged world-size {sorted(sizes)}, but world_size={world_size} was given")
    per_token = flops_per_token(config, seq_length).total

    steps = sorted({step for values in scalars.values() for step in values})
    rows: list[dict[str, float | int | None]] = []
    for step in steps:
        row: dict[str, float | int | None] = {"step": step}
        row.update({tag: _json_value(values[step]) for tag, values in sorted(scalars.items()) if step in values})
        seconds = scalars[ITERATION_TIME_TAG].get(step)
        if seconds is not None:
            batch = _value_at_or_before(scalars[BATCH_SIZE_TAG], step)
            if batch is None:
                raise RunLogError(f"{directory}: step {step} has an iteration time but no {BATCH_SIZE_TAG!r} at or before it")
            if not seconds > 0:
                raise RunLogError(f"{directory}: step {step} has iteration-time {seconds}, not a positive number of seconds")
            sequences = int(round(batch))
            row["global_batch_size"] = sequences
            row["tokens_per_s_per_gpu"] = sequences * seq_length / seconds / world_size
            row["tflops_per_s_per_gpu"] = per_token * seq_length * sequences / seconds / world_size / 1e12
        rows.append(row)

    timed = [row for row in rows if "tokens_per_s_per_gpu" in row]
    chosen = choose_window([int(row["step"]) for row in timed], first_step=steps[0], window=window)
    in_window = [row for row in timed if chosen.first_step <= int(row["step"]) <= chosen.last_step]

    def median(key: str) -> float:
        return statistics.median(float(row[key]) for row in in_window)

    megatron_throughput = scalars.get(MEGATRON_THROUGHPUT_TAG, {})
    megatron = [megatron_throughput[int(r["step"])] for r in in_window if int(r["step"]) in megatron_throughput]
    memory = scalars.get(PEAK_MEMORY_TAG)
    losses = {
        tag: {
            "first_step": min(values),
            "first": _json_value(values[min(values)]),
            "last_step": max(values),
            "last": _json_value(values[max(values)]),
        }
        for tag, values in sorted(scalars.items())
        if _LOSS.search(tag) and not tag.endswith("ppl") and values
    }
    out = RunDir(Path(out_dir))
    out.path.mkdir(parents=True, exist_ok=True)
    files = {"metrics": str(out.metrics), "summary": str(out.summary), "plot": str(out.plot)}
    summary = RunSummary(
        tensorboard_dir=str(directory),
        preset=config.name,
        seq_length=seq_length,
        world_size=world_size,
        formula=FORMULA,
        flops_per_token=per_token,
        window=chosen,
        global_batch_size=int(median("global_batch_size")),
        iteration_time_s=median(ITERATION_TIME_TAG),
        tokens_per_s_per_gpu=median("tokens_per_s_per_gpu"),
        tflops_per_s_per_gpu=median("tflops_per_s_per_gpu"),
        megatron_throughput_tflops=statistics.median(megatron) if megatron else None,
        peak_memory_bytes=max(memory.values()) if memory else None,
        losses=losses,
        first_step=steps[0],
        last_step=steps[-1],
        files=files,
        time_to_first_step_s=time_to_first_step(directory),
    )
    with open(files["metrics"], "w") as f:
        for row in rows:
            f.write(json.dumps(row, allow_nan=False) + "\n")
    Path(files["summary"]).write_text(json.dumps(summary.to_json(), indent=2, allow_nan=False) + "\n")
    plot_run(rows, scalars, summary, Path(files["plot"]))
    return summary


def _tflops(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"  # a tiny CPU/test run still shows digits


def plot_run(
    rows: Sequence[Mapping[str, float | int | None]], scalars: Mapping[str, Mapping[int, float]], summary: RunSummary, path: Path
) -> None:
    """Loss vs step (left panel); tokens/s/GPU and TFLOP/s/GPU vs step (right), window shaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A Figure on the Agg canvas directly: no pyplot state, no display needed.
    figure = Figure(figsize=(13, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, speed_axes = figure.subplots(1, 2)
    for tag in sorted(t for t in scalars if _PLOTTED_LOSS.match(t) and not t.endswith("ppl")):
        points = sorted((s, v) for s, v in scalars[tag].items() if math.isfinite(v))
        if points:
            style = {"marker": "o", "linestyle": "--"} if "validation" in tag else {"linewidth": 1.2}
            loss_axes.plot([s for s, _ in points], [v for _, v in points], label=tag, **style)
    loss_axes.set(xlabel="step", ylabel="loss", title=f"{summary.preset}: loss")
    loss_axes.grid(alpha=0.3)
    loss_axes.legend(fontsize=8)

    timed = [r for r in rows if "tokens_per_s_per_gpu" in r]
    steps = [r["step"] for r in timed]
    speed_axes.plot(steps, [r["tokens_per_s_per_gpu"] for r in timed], color="tab:blue", marker=".", label="tokens/s/GPU")
    title = f"throughput (median {_tflops(summary.tflops_per_s_per_gpu)} TFLOP/s/GPU over the window)"
    speed_axes.set(xlabel="step", ylabel="tokens/s/GPU", title=title)
    speed_axes.axvspan(summary.window.first_step, summary.window.last_step, color="tab:green", alpha=0.12, label="steady-state window")
    speed_axes.grid(alpha=0.3)
    tflops_axes = speed_axes.twinx()
    tflops_axes.plot(steps, [r["tflops_per_s_per_gpu"] for r in timed], color="tab:red", linestyle="--",
                     label="TFLOP/s/GPU (nam56r.model.flops)")
    tflops_axes.set_ylabel("TFLOP/s/GPU")
    handles = speed_axes.get_legend_handles_labels()[0] + tflops_axes.get_legend_handles_labels()[0]
    speed_axes.legend(handles=handles, fontsize=8, loc="lower right")
    figure.savefig(path, dpi=110)


def resolve_tensorboard_dir(run_dir: Path) -> Path:
    """A run folder's `tensorboard/` (where nam56r.training.megatron_args points Megatron), or the folder itself."""
    nested = RunDir(run_dir).tensorboard
    return nested if nested.is_dir() else run_dir


def _run_model_and_world(run_dir: Path, preset: str | None, world_size: int | None) -> tuple[ModelConfig, int]:
    """The model a run trained and its GPU count. A run started by nam56r.training.train records both
    (model_config.json: the exact config, IndexCache and sequence length included; recipe.json);
    a preset stands in only where the run has no model_config.json."""
    from nam56r.model.presets import get_preset

    layout = RunDir(run_dir)
    model_file, recipe_file = layout.model_config, layout.recipe
    if model_file.is_file():
        config = ModelConfig.from_dict(json.loads(model_file.read_text()))
        if preset is not None and preset != config.name:
            raise ValueError(f"--preset {preset} disagrees with {model_file}, which trained {config.name}")
    elif preset is not None:
        config = get_preset(preset)
    else:
        raise ValueError(f"{run_dir} has no model_config.json: pass --preset")
    if world_size is None:
        if not recipe_file.is_file():
            raise ValueError(f"{run_dir} has no recipe.json: pass --world-size")
        recipe = json.loads(recipe_file.read_text())
        world_size = recipe["nodes"] * recipe["gpus_per_node"]
    return config, world_size


def main(argv: list[str] | None = None) -> int:
    from nam56r.model.presets import PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m nam56r.training.runlog", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="the run folder (its tensorboard/ is read) or a TensorBoard folder")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="the model preset the run trains (default: the run's model_config.json, written by nam56r.training.train)",
    )
    parser.add_argument("--seq", type=int, help="sequence length (default: the model config's)")
    parser.add_argument("--world-size", type=int, help="GPUs of the run (default: from the run's recipe.json)")
    parser.add_argument("--out", type=Path, help="where to write metrics.jsonl, summary.json and the plot (default: RUN_DIR)")
    parser.add_argument("--record", action="store_true", help="then append the run's train record to patches/manifest.toml")
    parser.add_argument("--root", type=Path, help="with --record: the checkout whose patches/manifest.toml gets it (default: this one)")
    parser.add_argument(
        "--window",
        type=int,
        nargs=2,
        metavar=("FIRST", "LAST"),
        default=DEFAULT_WINDOW,
        help="steady-state iterations of the run (default: 3 25)",
    )
    args = parser.parse_args(argv)
    try:
        config, world_size = _run_model_and_world(args.run_dir, args.preset, args.world_size)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    seq = args.seq if args.seq is not None else config.seq_length
    tensorboard_dir = resolve_tensorboard_dir(args.run_dir)
    try:
        summary = summarize_run(tensorboard_dir, config, seq, world_size, args.out or args.run_dir, window=tuple(args.window))
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    lm = summary.losses.get(LOSS_TAG, {})
    memory = f"{summary.peak_memory_bytes / 2**30:.2f} GiB" if summary.peak_memory_bytes is not None else f"not logged ({PEAK_MEMORY_TAG})"
    print(f"run {tensorboard_dir}: steps {summary.first_step}..{summary.last_step}, {summary.preset}, seq {seq}, {summary.world_size} GPUs")
    print(f"window: {summary.window.rule}")
    print(f"median iteration time {summary.iteration_time_s:.3f} s, global batch {summary.global_batch_size}")
    tflops = _tflops(summary.tflops_per_s_per_gpu)
    print(f"median tokens/s/GPU {summary.tokens_per_s_per_gpu:,.0f}, TFLOP/s/GPU {tflops} ({summary.formula})")
    print(f"peak memory {memory}")
    print(f"lm loss {lm.get('first')} (step {lm.get('first_step')}) -> {lm.get('last')} (step {lm.get('last_step')})")
    print("wrote " + ", ".join(summary.files.values()))
    if args.record:
        from nam56r.training.train_record import ROOT, append_train_record

        try:
            record, path = append_train_record(args.run_dir, args.root or ROOT, Path(summary.files["summary"]))
        except (FileNotFoundError, ValueError) as error:
            print(f"error: not recorded: {error}", file=sys.stderr)
            return 1
        print(f"appended to {path}: {record.what} ({record.figures})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
