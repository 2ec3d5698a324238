"""The plot of a run (RunDir.plot, loss_throughput.png): loss vs step on the left; tokens/s/GPU and
TFLOP/s/GPU vs step on the right, the steady-state window of the summary shaded."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

_PLOTTED_LOSS = re.compile(r"^(lm|mtp_\d+) loss( validation.*)?$")


def format_tflops(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"  # a tiny CPU/test run still shows digits


def plot_run(
    rows: Sequence[Mapping[str, float | int | None]], scalars: Mapping[str, Mapping[int, float]], path: Path, *,
    preset: str, median_tflops: float, window: tuple[int, int],
) -> None:
    """Loss vs step (left panel); tokens/s/GPU and TFLOP/s/GPU vs step (right), the steady-state `window`
    (first and last step) shaded; `median_tflops` is the summary's median over it."""
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
    loss_axes.set(xlabel="step", ylabel="loss", title=f"{preset}: loss")
    loss_axes.grid(alpha=0.3)
    loss_axes.legend(fontsize=8)

    timed = [r for r in rows if "tokens_per_s_per_gpu" in r]
    steps = [r["step"] for r in timed]
    speed_axes.plot(steps, [r["tokens_per_s_per_gpu"] for r in timed], color="tab:blue", marker=".", label="tokens/s/GPU")
    title = f"throughput (median {format_tflops(median_tflops)} TFLOP/s/GPU over the window)"
    speed_axes.set(xlabel="step", ylabel="tokens/s/GPU", title=title)
    speed_axes.axvspan(*window, color="tab:green", alpha=0.12, label="steady-state window")
    speed_axes.grid(alpha=0.3)
    tflops_axes = speed_axes.twinx()
    tflops_axes.plot(steps, [r["tflops_per_s_per_gpu"] for r in timed], color="tab:red", linestyle="--",
                     label="TFLOP/s/GPU (nam56r.model.flops)")
    tflops_axes.set_ylabel("TFLOP/s/GPU")
    handles = speed_axes.get_legend_handles_labels()[0] + tflops_axes.get_legend_handles_labels()[0]
    speed_axes.legend(handles=handles, fontsize=8, loc="lower right")
    figure.savefig(path, dpi=110)
