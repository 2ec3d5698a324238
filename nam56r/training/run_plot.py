"""The plot of a run (RunDir.plot, loss_throughput.png): loss vs step on the left; tokens/s/GPU and
TFLOP/s/GPU vs step on the right, the steady-state window of the summary shaded."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nam56r.training.runlog import RunSummary

_PLOTTED_LOSS = re.compile(r"^(lm|mtp_\d+) loss( validation.*)?$")


def format_tflops(value: float) -> str:
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
    title = f"throughput (median {format_tflops(summary.tflops_per_s_per_gpu)} TFLOP/s/GPU over the window)"
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
