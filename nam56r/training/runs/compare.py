"""Two or more runs side by side, from their summary.json files (`nam56r.training.runs.summary`): LM loss over
steps on the left; in the middle, each later run's LM loss minus the first run's at the same step with its
moving mean (runs of one recipe and seed read the same batches in the same order, so the step-to-step noise of
a small batch cancels); the indexer's top-k recall against dense attention's on the right
(`nam56r.training.recall_probe`), one line per run; a dotted line marks where a run's DSA dense warm-up
ended, read from the recipe.json beside its summary (`nam56r.training.launcher` writes both). It prints each
later run's mean difference over the second half of the common steps, with its standard error.

    python -m nam56r.training.runs.compare runs/warmup/summary.json runs/no-warmup/summary.json \\
        --labels "dense warm-up 50" "no warm-up" --out warmup_vs_none.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from nam56r.training.arg_types import positive_int
from nam56r.training.recipe import settings_of
from nam56r.training.runs.layout import RunDir


@dataclass(frozen=True)
class RunCurves:
    label: str
    lm_loss: list[tuple[int, float]]
    indexer_recall: list[tuple[int, float]]
    dense_warmup_steps: int | None  # None: no recipe.json beside the summary


def read_run(summary_path: Path, label: str) -> RunCurves:
    """The curves of one run; raises ValueError naming the file when its summary has no per-step series."""
    summary = json.loads(summary_path.read_text())
    series = summary.get("series")
    if not series or "lm_loss" not in series:
        raise ValueError(f"{summary_path} has no per-step series: rewrite it with `python -m nam56r.training.runs.summarize RUN_DIR`")
    if not series["lm_loss"]:
        raise ValueError(f"{summary_path}: its run logged no 'lm loss'")
    recipe_file = RunDir(summary_path.parent).recipe
    warmup = None  # no recipe.json beside the summary
    if recipe_file.is_file():
        warmup = settings_of(json.loads(recipe_file.read_text()), ("dense_warmup_steps",))["dense_warmup_steps"]
    return RunCurves(
        label=label,
        lm_loss=[(int(s), float(v)) for s, v in series["lm_loss"] if v is not None],
        indexer_recall=[(int(s), float(v)) for s, v in series.get("indexer_recall", [])],
        dense_warmup_steps=warmup,
    )


def loss_difference(base: RunCurves, other: RunCurves) -> list[tuple[int, float]]:
    """`other`'s LM loss minus `base`'s at each step both logged, in step order."""
    base_loss = dict(base.lm_loss)
    return [(step, loss - base_loss[step]) for step, loss in other.lm_loss if step in base_loss]


def moving_mean(points: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """The mean of each `window` consecutive points, at the last point's step."""
    values = [value for _, value in points]
    return [(points[end - 1][0], sum(values[end - window:end]) / window) for end in range(window, len(points) + 1)]


@dataclass(frozen=True)
class DifferenceSummary:
    first_step: int
    last_step: int
    mean: float
    standard_error: float

    def describe(self) -> str:
        return (f"mean {self.mean:+.4f} ± {self.standard_error:.4f} (standard error) over steps "
                f"{self.first_step}-{self.last_step}")


def summarize_difference(difference: list[tuple[int, float]]) -> DifferenceSummary | None:
    """The mean of the second half of `difference` and its standard error; None when that half has fewer than 2 points."""
    half = difference[len(difference) // 2:]
    if len(half) < 2:
        return None
    values = [value for _, value in half]
    return DifferenceSummary(half[0][0], half[-1][0], statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5)


def plot_runs(runs: list[RunCurves], path: Path, window: int = 25) -> None:
    """LM loss (left), each later run's LM loss minus the first's with its `window`-step moving mean (middle), and
    indexer recall (right) over steps, one colour per run, into the PNG `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(19, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, difference_axes, recall_axes = figure.subplots(1, 3)
    for index, run in enumerate(runs):
        color = f"C{index}"
        loss_axes.plot(*zip(*run.lm_loss, strict=True), color=color, linewidth=1.2, label=run.label)
        if index and (difference := loss_difference(runs[0], run)):
            difference_axes.plot(*zip(*difference, strict=True), color=color, linewidth=0.6, alpha=0.35, label=f"{run.label}: per step")
            if smooth := moving_mean(difference, window):
                difference_axes.plot(*zip(*smooth, strict=True), color=color, linewidth=2, label=f"{run.label}: {window}-step mean")
        if run.indexer_recall:
            recall_axes.plot(*zip(*run.indexer_recall, strict=True), color=color, marker="o", markersize=3, label=run.label)
        if run.dense_warmup_steps:
            for axes in (loss_axes, difference_axes, recall_axes):
                axes.axvline(run.dense_warmup_steps + 0.5, color=color, linestyle=":", linewidth=1,
                             label=f"{run.label}: end of the dense warm-up")
    difference_axes.axhline(0.0, color="black", linewidth=0.8)
    loss_axes.set(xlabel="step", ylabel="lm loss", title="LM loss")
    difference_axes.set(xlabel="step", ylabel="lm loss difference",
                        title="LM loss minus the first run's at the same step (same batches)")
    recall_axes.set(xlabel="step", ylabel="recall@k", ylim=(0, 1.02), title="indexer top-k recall of dense attention's top-k")
    for axes in (loss_axes, difference_axes, recall_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nam56r.training.runs.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("summaries", type=Path, nargs="+", help="summary.json of each run (nam56r.training.runs.summary writes it)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: each run's folder name)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--window", type=positive_int, default=25, help="steps in the difference's moving mean (default: 25)")
    args = parser.parse_args(argv)
    labels = args.labels or [path.parent.name for path in args.summaries]
    if len(labels) != len(args.summaries):
        print(f"error: {len(labels)} labels for {len(args.summaries)} runs", file=sys.stderr)
        return 1
    try:
        runs = [read_run(path, label) for path, label in zip(args.summaries, labels, strict=True)]
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for run in runs:
        if not run.indexer_recall:
            print(f"note: {run.label} logged no 'indexer recall' (trained without --indexer-recall-interval)", file=sys.stderr)
    for run in runs[1:]:
        if (summary := summarize_difference(loss_difference(runs[0], run))) is not None:
            print(f"lm loss of {run.label} minus {runs[0].label}: {summary.describe()}")
    plot_runs(runs, args.out, args.window)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
