"""A suite's PNG, drawn from its JSON (`write_suite` writes both; `--replot FILE.json` redraws one).

- kernels (a suite with ratios): one horizontal bar per candidate against the fastest baseline of its case,
  the speedup and the memory ratio (baseline / candidate, so > 1 is better in both) on log axes around 1x; a
  win is green, a loss red, and each bar is labelled with its value. Long case labels wrap.
- train-step: per case, TFLOP/s/GPU with its value and MFU (against the run's own bf16 GEMM peak) beside
  the bar, read against a dashed line at the original stack's 289 TFLOP/s/GPU; beside it, peak memory in GiB.
  Under both, for the first profiled case, its top-10 kernels' share of the step and the GPU-idle share in
  another colour. A case that reached no figures shows "error (exit N)" in place of its bars.
- compile-tax: per variant (cold cache, warm cache), seconds from launch to the first step as one stacked
  bar: to initialize_megatron, model/optimizer/data loaders built, then the first step itself (where the
  compiles land), from Megatron's logged milestones; a dashed line marks the 60 s warm-cache target.
- microbatch: per case and variant, the largest micro-batch that trains, annotated with that try's peak
  memory and TFLOP/s/GPU and the smallest micro-batch tried that failed.
- Any other suite: grouped bars per case, one per variant, time and peak extra memory.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WIN, LOSS = "#2e7d32", "#c62828"
BAR, IDLE = "#1565c0", "#ef6c00"
LABEL_WIDTH = 60  # characters per y-label line: longer case names wrap instead of running off the figure's left edge

KERNEL_NAME_WIDTH = 50
# What the train-step throughput is read against: the original training stack's throughput.
ORIGINAL_TFLOPS = 289.0
ORIGINAL_LABEL = "original stack, 8xH200 BF16 (TE, EP=4, MBS 8)"
WARM_TARGET_S = 60.0  # compile-tax: seconds to the first step a run with warm caches should stay under


def wrap_label(*parts: str, width: int = LABEL_WIDTH) -> str:
    """`parts` one under the other, each wrapped at `width` characters."""
    return "\n".join(textwrap.fill(part, width) for part in parts)


def render(result: dict[str, Any], path: Path) -> None:
    """Draw `result` (a suite's JSON: suite, host, rows, ratios) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    title = f"{result['suite']} · {result['host']['gpu']} · {result['host']['commit'][:10]}"
    if plot := SUITE_PLOTS.get(result["suite"]):
        plot(result["rows"], title, path)
    elif result.get("ratios"):
        _plot_ratios(result["ratios"], title, path)
    else:
        _plot_rows(result["rows"], title, path)


def _plot_ratios(ratios: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    labels = [wrap_label(f"{r['case']}: {r['variant']}", f"vs {r['against']}") for r in ratios]
    lines = sum(label.count("\n") + 1 for label in labels)
    panels = [(key, name) for key, name in (("speedup", "speedup (baseline time / candidate time)"),
                                            ("memory_ratio", "memory ratio (baseline / candidate peak extra memory)"))
              if any(key in r for r in ratios)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3 + 6 * len(panels), 0.28 * lines + 1.5), squeeze=False, sharey=True)
    for ax, (key, name) in zip(axes[0], panels, strict=True):
        values = [r.get(key) for r in ratios]
        shown = [v for v in values if v]
        span = max(max(shown, default=1.0), 1 / min(shown, default=1.0), 2.0) * 2.5  # room for the label past the longest bar
        for y, value in enumerate(values):
            if not value:
                ax.text(1, y, " not measured", va="center", fontsize=7, color="grey")
                continue
            ax.barh(y, value - 1 if value >= 1 else 1 - value, left=1 if value >= 1 else value, color=WIN if value >= 1 else LOSS)
            ax.text(value, y, f" {value:.2f}x ", va="center", fontsize=7, ha="left" if value >= 1 else "right")
        ax.set_xscale("log")
        ax.set_xlim(1 / span, span)
        ax.axvline(1, color="black", linewidth=0.8)
        ax.set_xlabel(name, fontsize=8)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0][0].invert_yaxis()  # the axes share y: once puts the first case on top
    _save(fig, title, path)


def _plot_rows(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    panels = [(key, label) for key, label in (("time_ms", "time (ms)"), ("peak_extra_bytes", "peak extra memory (GiB)"))
              if any(r.get(key) is not None for r in rows)] or [("time_ms", "time (ms)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5, 1.6 * len(cases) + 2) * len(panels), 4.5), squeeze=False)
    axes = axes[0]
    for ax, (key, label) in zip(axes, panels, strict=True):
        width = 0.8 / max(1, len(variants))
        for v, variant in enumerate(variants):
            values = []
            for case in cases:
                match = next((r for r in rows if r["case"] == case and r["variant"] == variant), None)
                value = match.get(key) if match else None
                values.append(0.0 if value is None else (value / 2**30 if key == "peak_extra_bytes" else value))
            ax.bar([c + v * width for c in range(len(cases))], values, width, label=variant)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    _save(fig, title, path)


def _row_labels(rows: list[dict[str, Any]]) -> list[str]:
    """Each row's y label: its case, its variant, or both, whichever tell the rows apart."""
    cases_vary = len({r["case"] for r in rows}) > 1
    variants_vary = len({r["variant"] for r in rows}) > 1
    parts = [(r["case"],) if cases_vary and not variants_vary else (r["variant"],) if variants_vary and not cases_vary
             else (r["case"], r["variant"]) for r in rows]
    return [wrap_label(*p) for p in parts]


def _set_rows(ax: Any, labels: list[str], fontsize: int = 8) -> None:
    """One labelled y position per row, the first on top; explicit limits, as an error row draws only text."""
    ax.set_yticks(range(len(labels)), labels, fontsize=fontsize)
    ax.set_ylim(len(labels) - 0.5, -0.5)


def _error_text(ax: Any, y: float, exit_code: int | None) -> None:
    ax.text(0, y, f" error (exit {'?' if exit_code is None else exit_code})", va="center", fontsize=8, color=LOSS)


def _save(fig: Any, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # a long label widens the image rather than being cut
    plt.close(fig)


@dataclass(frozen=True)
class StepBar:
    """One train-step row as drawn: throughput, MFU against the run's own GEMM peak, peak memory, or an error."""

    label: str
    tflops: float | None
    mfu: float | None
    gemm_peak_tflops: float | None
    peak_gib: float | None
    exit: int | None

    def annotation(self) -> str:
        """The text beside the throughput bar: value, then MFU and what it is measured against."""
        if self.tflops is None:
            return f"error (exit {'?' if self.exit is None else self.exit})"
        text = f"{self.tflops:.1f} TFLOP/s/GPU"
        if self.mfu is not None:
            text += f" · MFU {self.mfu:.1%}" + (f" of {self.gemm_peak_tflops:.0f} (bf16 GEMM peak)" if self.gemm_peak_tflops else "")
        return text


def step_bars(rows: list[dict[str, Any]]) -> list[StepBar]:
    """The train-step rows as bars, in the JSON's order."""
    bars = []
    for row, label in zip(rows, _row_labels(rows), strict=True):
        extra = row.get("extra") or {}
        peak = row.get("peak_extra_bytes")
        bars.append(StepBar(label, extra.get("tflops_per_s_per_gpu"), extra.get("mfu"), extra.get("gemm_peak_tflops"),
                            None if peak is None else peak / 2**30, extra.get("exit")))
    return bars


def short_kernel_name(name: str, width: int = KERNEL_NAME_WIDTH) -> str:
    """A CUDA kernel's name without `void` and the ATen/std namespaces, cut to `width` characters."""
    name = re.sub(r"^void |at::native::|\(anonymous namespace\)::|c10::|std::", "", name)
    return name if len(name) <= width else name[: width - 1] + "…"


@dataclass(frozen=True)
class KernelShares:
    """Where one profiled row's step goes: its top kernels' shares of the step and the share the GPU sat idle."""

    case: str
    step_ms: float | None
    kernels: list[tuple[str, float]]
    idle: float | None


def kernel_shares(rows: list[dict[str, Any]], top: int = 10) -> KernelShares | None:
    """The top kernels (short names, share of step) of the profiled row with the highest TFLOP/s/GPU (the first
    profiled one when none has a figure), or None when no row was profiled."""
    profiled = [row for row in rows if ((row.get("extra") or {}).get("profile") or {}).get("top_kernels")]
    if not profiled:
        return None
    row = max(profiled, key=lambda r: r["extra"].get("tflops_per_s_per_gpu") or 0.0)
    profile = row["extra"]["profile"]
    kernels = [(short_kernel_name(k["kernel"]), k["share_of_step"]) for k in profile["top_kernels"][:top]]
    return KernelShares(row["case"], profile.get("step_ms"), kernels, profile.get("gpu_idle_share"))


def _draw_throughput(ax: Any, bars: list[StepBar]) -> None:
    top = max([b.tflops for b in bars if b.tflops is not None] + [ORIGINAL_TFLOPS])
    for y, bar in enumerate(bars):
        if bar.tflops is None:
            _error_text(ax, y, bar.exit)
            continue
        ax.barh(y, bar.tflops, color=BAR)
        ax.text(bar.tflops, y, " " + bar.annotation(), va="center", fontsize=8,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # legible across the reference line
    ax.axvline(ORIGINAL_TFLOPS, color="black", linestyle="--", linewidth=1,
               label=f"{ORIGINAL_LABEL}: {ORIGINAL_TFLOPS:.0f} TFLOP/s/GPU")
    ax.set_xlim(0, top * 2.1)  # room for the annotation right of the longest bar
    _set_rows(ax, [b.label for b in bars])
    ax.set_xlabel("TFLOP/s per GPU (steady-state window)", fontsize=8)
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1), frameon=False)  # above the axes, clear of the bars


def _draw_memory(ax: Any, bars: list[StepBar]) -> None:
    top = max([b.peak_gib for b in bars if b.peak_gib is not None], default=1.0)
    for y, bar in enumerate(bars):
        if bar.peak_gib is None:
            _error_text(ax, y, bar.exit)
            continue
        ax.barh(y, bar.peak_gib, color=BAR)
        ax.text(bar.peak_gib, y, f" {bar.peak_gib:.1f} GiB", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.3)
    ax.tick_params(labelleft=False)
    ax.set_xlabel("peak memory (GiB)", fontsize=8)


def _draw_kernels(ax: Any, shares: KernelShares) -> None:
    names = [name for name, _ in shares.kernels] + (["GPU idle"] if shares.idle is not None else [])
    values = [share for _, share in shares.kernels] + ([shares.idle] if shares.idle is not None else [])
    colors = [BAR] * len(shares.kernels) + [IDLE] * (shares.idle is not None)
    ax.barh(range(len(values)), [100 * v for v in values], color=colors)
    for y, value in enumerate(values):
        ax.text(100 * value, y, f" {value:.1%}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8, family="monospace")
    ax.invert_yaxis()
    ax.set_xlim(0, 100 * max(values) * 1.2)
    ax.set_xlabel("share of the step (%)", fontsize=8)
    step = f", step {shares.step_ms:.0f} ms" if shares.step_ms else ""
    ax.set_title(f"{shares.case}{step}: top {len(shares.kernels)} kernels by CUDA time, and GPU idle", fontsize=9)


def _plot_train_step(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    bars, shares = step_bars(rows), kernel_shares(rows)
    heights = [0.5 * len(bars) + 1.6] + ([0.3 * (len(shares.kernels) + 1) + 1.2] if shares else [])
    fig = plt.figure(figsize=(14, sum(heights)))
    grid = fig.add_gridspec(len(heights), 2, height_ratios=heights, width_ratios=(3, 1.4))
    throughput = fig.add_subplot(grid[0, 0])
    _draw_throughput(throughput, bars)
    _draw_memory(fig.add_subplot(grid[0, 1], sharey=throughput), bars)
    if shares:
        _draw_kernels(fig.add_subplot(grid[1, :]), shares)
    _save(fig, title, path)


# The marks that end each phase before the first step, in order: the launcher's and rank 0's startup marks
# (nam56r.training.launcher.startup_marks) and Megatron's milestones (the first one logged of each tuple counts).
PHASES = (
    ("launcher, torchrun start", ("rank 0 process started",)),
    ("rank 0 imports", ("rank 0 imported torch, Megatron and NAM56R's modules",)),
    ("launch gate wait", ("rank 0 passed the launch gate",)),
    ("initialize_megatron", ("after megatron is initialized",)),
    ("model, optimizer, data loaders built",
     ("after dataloaders are built", "after model, optimizer, and learning rate scheduler are built")),
    ("first forward (kernels compiled or loaded)", ("first micro-batch: forward returned (host; its kernels compiled or loaded)",)),
)
FIRST_STEP_PHASE = "first step (compiles, autotuning, step)"
REST_OF_STEP_PHASE = "rest of the first step"
WHOLE_PHASE = "launch to first step (no milestones logged)"
_PHASE_PALETTE = ("#b0bec5", "#78909c", "#cfd8dc", "#90a4ae", "#4db6ac", "#26a69a")
PHASE_COLORS = {phase: color for (phase, _), color in zip(PHASES, _PHASE_PALETTE, strict=True)} | {
    FIRST_STEP_PHASE: BAR, REST_OF_STEP_PHASE: BAR, WHOLE_PHASE: "#7e57c2"}


def first_step_segments(row: dict[str, Any]) -> list[tuple[str, float]]:
    """Where a compile-tax row's seconds to the first step go, as (phase, seconds) summing to its total: from the
    launch to each phase's end that was marked, then to the first step. A segment that spans phases whose ends
    were not marked is named by all of them ("a + b"). [] when the run reached no step."""
    if row.get("time_ms") is None:
        return []
    total = row["time_ms"] / 1e3
    extra = row.get("extra") or {}
    marks = {**(extra.get("milestones_s") or {}), **(extra.get("startup_s") or {})}
    segments, start, spanned = [], 0.0, []
    for phase, keys in PHASES:
        spanned.append(phase)
        at = next((marks[key] for key in keys if key in marks), None)
        if at is not None and start <= at <= total:
            segments.append((" + ".join(spanned), at - start))
            start, spanned = at, []
    if not segments:
        return [(WHOLE_PHASE, total)]
    return segments + [(REST_OF_STEP_PHASE if not spanned else FIRST_STEP_PHASE, total - start)]


def phase_color(segment: str) -> str:
    """A segment's colour: its last phase's."""
    return PHASE_COLORS[segment.rsplit(" + ", 1)[-1]]


def _plot_compile_tax(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    labels, all_segments = _row_labels(rows), [first_step_segments(r) for r in rows]
    totals = [sum(s for _, s in segments) for segments in all_segments]
    xmax = max(totals + [WARM_TARGET_S]) * 1.12
    fig, ax = plt.subplots(figsize=(13, 0.8 * len(rows) + 2))
    labelled: set[str] = set()
    for y, (row, segments, total) in enumerate(zip(rows, all_segments, totals, strict=True)):
        if not segments:
            _error_text(ax, y, (row.get("extra") or {}).get("exit"))
            continue
        left = 0.0
        for phase, seconds in segments:
            ax.barh(y, seconds, left=left, color=phase_color(phase), label=None if phase in labelled else phase)
            labelled.add(phase)
            if seconds > 0.04 * xmax:
                ax.text(left + seconds / 2, y, f"{seconds:.0f} s", va="center", ha="center", fontsize=8, color="white")
            left += seconds
        ax.text(total, y, f" {total:.0f} s", va="center", fontsize=9, fontweight="bold")
    ax.axvline(WARM_TARGET_S, color="black", linestyle="--", linewidth=1, label=f"warm-cache target: {WARM_TARGET_S:.0f} s")
    ax.set_xlim(0, xmax)
    _set_rows(ax, labels, fontsize=9)
    ax.set_title(", ".join(dict.fromkeys(r["case"] for r in rows)), fontsize=9)
    ax.set_xlabel("seconds from launch to the first logged step", fontsize=8)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes, clear of the bars
    _save(fig, title, path)


@dataclass(frozen=True)
class MicrobatchBar:
    """One microbatch row as drawn: the largest micro-batch that trained, and what that try and the next showed."""

    label: str
    largest: int
    peak_gib: float | None
    tflops: float | None
    first_failure: int | None

    def annotation(self) -> str:
        """The text beside the bar: the largest micro-batch, its peak memory and speed, the smallest that failed."""
        parts = [f"mbs {self.largest}" if self.largest else "nothing trains"]
        if self.peak_gib is not None and self.tflops is not None:
            parts.append(f"peak {self.peak_gib:.1f} GiB, {self.tflops:.1f} TFLOP/s/GPU")
        if self.first_failure is not None:
            parts.append(f"mbs {self.first_failure} fails")
        return " · ".join(parts)


def microbatch_bars(rows: list[dict[str, Any]]) -> list[MicrobatchBar]:
    """The microbatch rows as bars; `tried`'s keys may be strings (as JSON stores them) or ints."""
    bars = []
    for row in rows:
        extra = row.get("extra") or {}
        tried = {int(mbs): attempt for mbs, attempt in (extra.get("tried") or {}).items()}
        largest = extra.get("largest_micro_batch") or 0
        best = tried.get(largest) or {}
        failures = sorted(mbs for mbs, attempt in tried.items() if mbs > largest and attempt.get("exit") != 0)
        bars.append(MicrobatchBar(wrap_label(row["case"], row["variant"]), largest, best.get("peak_memory_gib"),
                                  best.get("tflops_per_s_per_gpu"), failures[0] if failures else None))
    return bars


def _plot_microbatch(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    bars = microbatch_bars(rows)
    top = max([b.largest for b in bars] + [1])
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(bars) + 1.8))
    for y, bar in enumerate(bars):
        ax.barh(y, bar.largest, color=BAR)
        ax.text(bar.largest, y, " " + bar.annotation(), va="center", fontsize=8, color="black" if bar.largest else LOSS)
    ax.set_xlim(0, top * 2.2)  # room for the annotation right of the longest bar
    ax.xaxis.get_major_locator().set_params(integer=True)
    _set_rows(ax, [b.label for b in bars])
    ax.set_xlabel("largest micro-batch that trains 3 steps (sequence 4096)", fontsize=8)
    _save(fig, title, path)


SUITE_PLOTS = {"train-step": _plot_train_step, "compile-tax": _plot_compile_tax, "microbatch": _plot_microbatch}
