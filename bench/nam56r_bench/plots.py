"""A suite's PNG, drawn from its JSON (`write_suite` writes both; `--replot FILE.json` redraws one).

- A suite with ratios (the kernels suite): one horizontal bar per candidate against the fastest baseline of
  its case, the speedup and the memory ratio (baseline / candidate, so > 1 is better in both) on log axes
  around 1x; a win is green, a loss red, and each bar is labelled with its value.
- Otherwise (the training suites): grouped bars per case, one per variant, time and peak extra memory.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

WIN, LOSS = "#2e7d32", "#c62828"
LABEL_WIDTH = 60  # characters per y-label line: longer case names wrap instead of running off the figure's left edge


def wrap_label(*parts: str, width: int = LABEL_WIDTH) -> str:
    """`parts` one under the other, each wrapped at `width` characters."""
    return "\n".join(textwrap.fill(part, width) for part in parts)


def render(result: dict[str, Any], path: Path) -> None:
    """Draw `result` (a suite's JSON: suite, host, rows, ratios) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    title = f"{result['suite']} · {result['host']['gpu']} · {result['host']['commit'][:10]}"
    if result.get("ratios"):
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
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # a long label widens the image rather than being cut
    plt.close(fig)


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
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
