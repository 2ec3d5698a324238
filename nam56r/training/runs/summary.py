"""A run's per-step metrics and steady-state summary, from the TensorBoard events Megatron writes
(`training_log` in megatron/training/training.py); `python -m nam56r.training.runs.summarize` is its command.

`summarize_run` writes, into the run directory: `metrics.jsonl` (one line per logged step with every scalar
Megatron wrote there, plus tokens/s/GPU and TFLOP/s/GPU), `summary.json` (medians over a stated steady-state
window, peak memory, first/last losses, the time to the first step, the FLOP formula) and `loss_throughput.png`
(`nam56r.training.runs.plot`). summary.json's `series` holds the per-step curves a comparison of runs plots
(`nam56r.training.runs.compare`): 'lm_loss' at every logged step and 'indexer_recall' at the steps the
recall probe measured (`nam56r.training.recall_probe`; empty without it). `headline` reads its figures back.

Megatron's tags (core_v0.19.0): 'lm loss' and the other loss keys ('mtp_1 loss', 'indexer loss', 'indexer
recall') at every --tensorboard-log-interval step; 'iteration-time' (seconds per iteration, averaged over
the log interval; only with --log-timers-to-tensorboard, and never at the first iteration) and
Megatron's own 'throughput' at --log-interval steps; 'mem-max-allocated-bytes' with
--log-memory-to-tensorboard; 'batch-size'; 'world-size' with --log-world-size-to-tensorboard;
'<key> validation' after evaluations. '... vs samples' tags are keyed by consumed samples, not
iterations, so they are left out. Throughput uses our FLOP formula (`nam56r.model.flops`), not
Megatron's 'throughput', whose formula knows neither Mamba-3, DSA nor the n-gram embedding.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nam56r.model.config import ModelConfig
from nam56r.model.flops import FORMULA, flops_per_token
from nam56r.model.reference import FORMULA as REFERENCE_FORMULA
from nam56r.model.reference import ReferenceConfig
from nam56r.training.runs.events import (
    BATCH_SIZE_TAG,
    ITERATION_TIME_TAG,
    LOSS_TAG,
    MEGATRON_THROUGHPUT_TAG,
    PEAK_MEMORY_TAG,
    REQUIRED_TAGS,
    WORLD_SIZE_TAG,
    MissingTagError,
    RunLogError,
    read_scalars,
    run_series,
    time_to_first_step,
)
from nam56r.training.runs.layout import RunDir
from nam56r.training.runs.plot import plot_run

# Iterations 3..25 of the run: the first two carry kernel compilation/autotuning and allocator warm-up.
DEFAULT_WINDOW = (3, 25)
SHORT_RUN_SHARE = 0.8  # a run that has not reached the window's end: its last 80% of timed steps
_LOSS = re.compile(r"loss( validation.*)?$")  # 'lm loss', 'mtp_1 loss', 'indexer loss', 'lm loss validation'; not 'loss-scale'

Row = dict[str, float | int | None]  # one line of metrics.jsonl


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
    series: Mapping[str, Sequence[tuple[int, float | None]]] | None = None  # see run_series()

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
            "series": {name: [list(point) for point in points] for name, points in (self.series or {}).items()},
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
    config: ModelConfig | ReferenceConfig,
    seq_length: int,
    world_size: int,
    out_dir: Path | str,
    *,
    window: tuple[int, int] = DEFAULT_WINDOW,
) -> RunSummary:
    """Read the run's events, write metrics.jsonl, summary.json and loss_throughput.png to
    `out_dir`, and return the summary. tokens/s/GPU = batch-size x seq_length / iteration-time /
    world_size; TFLOP/s/GPU = nam56r.model.flops step FLOPs (the reference GPT's own formula for a `--reference` run,
    `ReferenceConfig.flops_per_token`) / iteration-time / world_size / 1e12."""
    directory = Path(tensorboard_dir)
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    scalars = read_run_scalars(directory, world_size)
    per_token, formula = _flops_per_token(config, seq_length)
    rows = step_rows(directory, scalars, seq_length, world_size, per_token)
    timed = [row for row in rows if "tokens_per_s_per_gpu" in row]
    chosen = choose_window([int(row["step"]) for row in timed], first_step=int(rows[0]["step"]), window=window)
    out = RunDir(Path(out_dir))
    out.path.mkdir(parents=True, exist_ok=True)
    memory = scalars.get(PEAK_MEMORY_TAG)
    summary = RunSummary(
        tensorboard_dir=str(directory),
        preset=config.name,
        seq_length=seq_length,
        world_size=world_size,
        formula=formula,
        flops_per_token=per_token,
        window=chosen,
        **window_medians([row for row in timed if chosen.first_step <= int(row["step"]) <= chosen.last_step], scalars),
        peak_memory_bytes=max(memory.values()) if memory else None,
        losses=loss_ends(scalars),
        first_step=int(rows[0]["step"]),
        last_step=int(rows[-1]["step"]),
        files={"metrics": str(out.metrics), "summary": str(out.summary), "plot": str(out.plot)},
        time_to_first_step_s=time_to_first_step(directory),
        series=run_series(scalars),
    )
    write_run_files(out, rows, scalars, summary)
    return summary


def _flops_per_token(config: ModelConfig | ReferenceConfig, seq_length: int) -> tuple[float, str]:
    """Training FLOPs per token of the model the run trained, and the formula's name."""
    if isinstance(config, ReferenceConfig):
        return config.flops_per_token(seq_length), REFERENCE_FORMULA
    return flops_per_token(config, seq_length).total, FORMULA


def read_run_scalars(directory: Path, world_size: int) -> dict[str, dict[int, float]]:
    """The run's scalars (`read_scalars`), holding every tag a summary needs and the world size it was given."""
    scalars = read_scalars(directory)
    for tag in REQUIRED_TAGS:
        if not scalars.get(tag):
            raise MissingTagError(directory, tag, scalars)
    if logged := scalars.get(WORLD_SIZE_TAG):
        sizes = {int(v) for v in logged.values()}
        if sizes != {world_size}:
            raise RunLogError(f"{directory}: the run logged world-size {sorted(sizes)}, but world_size={world_size} was given")
    return scalars


def step_rows(
    directory: Path, scalars: Mapping[str, Mapping[int, float]], seq_length: int, world_size: int, flops_per_token: float
) -> list[Row]:
    """One row per logged step, by step: every scalar logged there, and at a timed step (one with an
    iteration-time) its global batch size, tokens/s/GPU and TFLOP/s/GPU."""
    rows: list[Row] = []
    for step in sorted({step for values in scalars.values() for step in values}):
        row: Row = {"step": step}
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
            row["tflops_per_s_per_gpu"] = flops_per_token * seq_length * sequences / seconds / world_size / 1e12
        rows.append(row)
    return rows


def window_medians(in_window: Sequence[Row], scalars: Mapping[str, Mapping[int, float]]) -> dict[str, float | int | None]:
    """The RunSummary fields that are medians over the timed rows of the steady-state window."""

    def median(key: str) -> float:
        return statistics.median(float(row[key]) for row in in_window)

    megatron_throughput = scalars.get(MEGATRON_THROUGHPUT_TAG, {})
    megatron = [megatron_throughput[int(r["step"])] for r in in_window if int(r["step"]) in megatron_throughput]
    return {
        "global_batch_size": int(median("global_batch_size")),
        "iteration_time_s": median(ITERATION_TIME_TAG),
        "tokens_per_s_per_gpu": median("tokens_per_s_per_gpu"),
        "tflops_per_s_per_gpu": median("tflops_per_s_per_gpu"),
        "megatron_throughput_tflops": statistics.median(megatron) if megatron else None,
    }


def loss_ends(scalars: Mapping[str, Mapping[int, float]]) -> dict[str, dict[str, float | int | None]]:
    """Per loss tag (training and validation; not perplexities): its first and last step and value."""
    return {
        tag: {
            "first_step": min(values),
            "first": _json_value(values[min(values)]),
            "last_step": max(values),
            "last": _json_value(values[max(values)]),
        }
        for tag, values in sorted(scalars.items())
        if _LOSS.search(tag) and not tag.endswith("ppl") and values
    }


def write_run_files(out: RunDir, rows: Sequence[Row], scalars: Mapping[str, Mapping[int, float]], summary: RunSummary) -> None:
    """metrics.jsonl, summary.json and loss_throughput.png into the run directory `out`."""
    with open(out.metrics, "w") as f:
        for row in rows:
            f.write(json.dumps(row, allow_nan=False) + "\n")
    out.summary.write_text(json.dumps(summary.to_json(), indent=2, allow_nan=False) + "\n")
    window = (summary.window.first_step, summary.window.last_step)
    plot_run(rows, scalars, out.plot, preset=summary.preset, median_tflops=summary.tflops_per_s_per_gpu, window=window)


def resolve_tensorboard_dir(run_dir: Path) -> Path:
    """A run folder's `tensorboard/` (where nam56r.training.launcher.flags points Megatron), or the folder itself."""
    nested = RunDir(run_dir).tensorboard
    return nested if nested.is_dir() else run_dir
