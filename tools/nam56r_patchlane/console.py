"""What the long-running commands print: numbered steps with the elapsed time, and plain-text tables."""

from __future__ import annotations

import time


class StepProgress:
    """`[  12.3s] (2/5) text` for each step of a known number of steps, and indented notes between them."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.step = 0
        self.start = time.monotonic()

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.start:6.1f}s"

    def next(self, text: str) -> None:
        self.step += 1
        print(f"[{self.elapsed()}] ({self.step}/{self.total}) {text}", flush=True)

    def log(self, text: str) -> None:
        print(f"[{self.elapsed()}] {text}", flush=True)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns under a header and a dashed rule."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])
