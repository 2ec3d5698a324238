"""How a kernels-suite case measures one variant: time, peak extra memory, and error against a reference."""

from __future__ import annotations

from collections.abc import Callable

from nam56r_bench.harness import Context, Row, cuda_peak_extra_bytes, cuda_time_ms


def measure(case: str, variant: str, fn: Callable[[], object], ctx: Context, reference=None, timed: bool = True,
            **extra) -> tuple[Row, object]:
    """(`fn`'s row: its median time unless `timed` is off, peak extra memory and error against `reference`; its result,
    None when it ran out of memory)."""
    import torch

    print(f"[kernels] {case} · {variant}", flush=True)
    try:
        peak, result = cuda_peak_extra_bytes(fn)
        error = None if reference is None else relative_error(result, reference)
        ms = cuda_time_ms(fn, warmup=1 if ctx.quick else 3, iters=3 if ctx.quick else 10) if timed else None
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return Row(case, variant, extra={"error": f"out of memory: {str(exc).splitlines()[0]}", **extra}), None
    return Row(case, variant, time_ms=ms, peak_extra_bytes=peak, max_error=error, extra=extra), result


def relative_error(got, want) -> float:
    import torch

    pairs = zip(got, want, strict=True) if isinstance(got, (tuple, list)) else [(got, want)]
    worst = 0.0
    for a, b in pairs:
        a, b = a.float(), b.float()
        finite = torch.isfinite(b)
        if not torch.equal(finite, torch.isfinite(a)):
            return float("inf")
        scale = b[finite].abs().max().clamp_min(1e-30)
        worst = max(worst, ((a[finite] - b[finite]).abs().max() / scale).item())
    return worst
