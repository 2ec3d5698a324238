"""Two or more runs side by side, from their summary.json files (`nam56r.training.runlog`): LM loss over
steps on the left, the indexer's top-k recall against dense attention's on the right
(`nam56r.training.recall_probe`), one line per run; a dotted line marks where a run's DSA dense warm-up
ended, read from the recipe.json beside its summary (`nam56r.training.train` writes both).

    python -m nam56r.training.compare_runs runs/warmup/summary.json runs/no-warmup/summary.json \\
        --labels "dense warm-up 50" "no warm-up" --out warmup_vs_none.png
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from nam56r.training.run_dir import RunDir


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
        raise ValueError(f"{summary_path} has no per-step series: rewrite it with `python -m nam56r.training.runlog RUN_DIR`")
    if not series["lm_loss"]:
        raise ValueError(f"{summary_path}: its run logged no 'lm loss'")
    recipe_file = RunDir(summary_path.parent).recipe
    warmup = json.loads(recipe_file.read_text())["dsa_phases"]["dense_warmup_steps"] if recipe_file.is_file() else None
    return RunCurves(
        label=label,
        lm_loss=[(int(s), float(v)) for s, v in series["lm_loss"] if v is not None],
        indexer_recall=[(int(s), float(v)) for s, v in series.get("indexer_recall", [])],
        dense_warmup_steps=warmup,
    )


def plot_runs(runs: list[RunCurves], path: Path) -> None:
    """LM loss (left) and indexer recall (right) over steps, one colour per run, into the PNG `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(13, 4.8), layout="constrained")
    FigureCanvasAgg(figure)
    loss_axes, recall_axes = figure.subplots(1, 2)
    for index, run in enumerate(runs):
        color = f"C{index}"
        loss_axes.plot(*zip(*run.lm_loss, strict=True), color=color, linewidth=1.2, label=run.label)
        if run.indexer_recall:
            recall_axes.plot(*zip(*run.indexer_recall, strict=True), color=color, marker="o", markersize=3, label=run.label)
        if run.dense_warmup_steps:
            for axes in (loss_axes, recall_axes):
                axes.axvline(run.dense_warmup_steps + 0.5, color=color, linestyle=":", linewidth=1,
                             label=f"{run.label}: end of the dense warm-up")
    loss_axes.set(xlabel="step", ylabel="lm loss", title="LM loss")
    recall_axes.set(xlabel="step", ylabel="recall@k", ylim=(0, 1.02), title="indexer top-k recall of dense attention's top-k")
    for axes in (loss_axes, recall_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nam56r.training.compare_runs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("summaries", type=Path, nargs="+", help="summary.json of each run (nam56r.training.runlog writes it)")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: each run's folder name)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
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
    plot_runs(runs, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
