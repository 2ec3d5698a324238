"""The microbatch suite's search for the largest micro-batch that trains: micro-batches 1 and 2, then the size their
peak memory predicts for the GPU, then bisection; each try is one `train` run the caller makes."""

from __future__ import annotations

from collections.abc import Callable

from nam56r.training.runs.summary import headline


def describe_attempt(attempt: dict) -> str:
    """One line for a micro-batch try: what it reached, or the line that stopped it."""
    if "error" in attempt:
        return f"exit {attempt['exit']}: {attempt['error'].splitlines()[-1][:200]}"
    return (f"trains, peak {attempt['peak_memory_gib']:.1f} GiB, {attempt['tflops_per_s_per_gpu']:.1f} TFLOP/s/GPU, "
            f"first step after {attempt['first_step_s'] or float('nan'):.0f} s")


def largest_micro_batch(try_mbs: Callable[[int], dict], *, quick: bool = False, limit: int = 64,
                        capacity_gib: float | None = None) -> tuple[int, dict[int, dict]]:
    """(the largest micro-batch whose `try_mbs` run exits 0, what each try showed). Micro-batches 1 and 2 first;
    then, with the GPU's `capacity_gib`, the largest micro-batch a straight line through the two largest fitting
    tries' peak memory predicts (`predicted_largest`), else doubling; once a try fails, bisection between the
    last fit and the first failure. The answer is always bounded by a try that fits and the next size failing
    (or `limit`); the prediction only picks which sizes to try. 0 when micro-batch 1 fails."""
    fits, fails, tried = 0, None, {}
    mbs = 1
    while fails is None or fails - fits > 1:
        result = try_mbs(mbs)
        tried[mbs] = try_outcome(result)
        if result["exit"] == 0:
            fits = mbs
        else:
            fails = mbs
            if fits == 0:
                break
        if quick and fits >= 2:
            break
        if fails is not None:
            mbs = (fits + fails) // 2
        else:
            guess = predicted_largest(tried, capacity_gib) if fits >= 2 else None
            mbs = fits * 2 if guess is None else max(min(guess, limit), fits + 1)
        if mbs > limit:
            break
    return fits, tried


# The share of the GPU's memory a predicted micro-batch may fill: the peak counts allocated tensors, not the
# allocator's fragmentation or the CUDA context.
PREDICTION_HEADROOM = 0.95


def predicted_largest(tried: dict[int, dict], capacity_gib: float | None) -> int | None:
    """The largest micro-batch whose peak memory, on the line through the two largest fitting tries' peaks, stays
    within PREDICTION_HEADROOM of `capacity_gib`; None without a capacity, two fitting tries with peaks, or a
    peak that grows with the micro-batch."""
    points = sorted((mbs, t["peak_memory_gib"]) for mbs, t in tried.items() if t["exit"] == 0 and t.get("peak_memory_gib"))
    if capacity_gib is None or len(points) < 2:
        return None
    (m0, p0), (m1, p1) = points[-2], points[-1]
    per_sample = (p1 - p0) / (m1 - m0)
    if per_sample <= 0:
        return None
    return int(m1 + (capacity_gib * PREDICTION_HEADROOM - p1) // per_sample)


def failure_reason(result: dict) -> str:
    """Why a `train` run stopped: the first exception a rank printed, else an out-of-memory line in the log's tail,
    else the ranks' last lines, else the tail's last lines."""
    if result.get("cause"):
        return result["cause"][-400:]
    reason = next((line for line in reversed(result["tail"]) if "OutOfMemoryError" in line or "out of memory" in line), None)
    return (reason or "\n".join(result.get("rank_tail") or result["tail"][-5:]))[-400:]


def try_outcome(result: dict) -> dict:
    """What one micro-batch try shows: its exit code, peak memory and speed when it trained, or why it stopped."""
    summary = result["summary"]
    if summary is None:
        return {"exit": result["exit"], "error": failure_reason(result)}
    figures = headline(summary)
    return {"exit": result["exit"], "peak_memory_gib": figures.peak_memory_gib, "tflops_per_s_per_gpu": figures.tflops_per_s_per_gpu,
            "first_step_s": result["first_step_s"]}
