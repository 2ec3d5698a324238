"""What a profiled training step spent its GPU time on, read from the PyTorch-profiler traces Megatron writes
with ``--profile --use-pytorch-profiler``: ``rank-<r>.json.gz`` chrome traces in ``RunDir.torch_profile``; or,
for a bench case, from a trace of a few calls of its step function profiled here (`profile_step`).

- Top kernels: CUDA kernels by total time over the profiled steps, each with its share of those steps' wall
  time (ProfilerStep# annotations) and of all kernel time.
- GPU idle share: the fraction of the profiled steps' wall time in which no kernel, memcpy or memset ran
  (host gaps, launch latency, synchronisation).
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

from nam56r_bench.harness import BenchError

TRACE_GLOB = "rank-*.json.gz"
GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def read_trace(path: Path) -> list[dict]:
    """The trace events of one chrome trace (gzipped or plain JSON)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def profile_breakdown(trace_dir: Path, count: int = 10) -> dict:
    """{"steps", "step_ms", "gpu_busy_share", "gpu_idle_share", "kernel_share", "top_kernels"} of rank 0's trace
    in `trace_dir`; BenchError when there is none, or it holds no profiled step or no CUDA kernel."""
    traces = sorted(trace_dir.glob(TRACE_GLOB)) if trace_dir.is_dir() else []
    if not traces:
        raise BenchError(f"no PyTorch profiler trace ({TRACE_GLOB}) in {trace_dir}: Megatron writes it there with "
                         "--profile --use-pytorch-profiler once --profile-step-end is reached")
    events = read_trace(traces[0])
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e]
    if not steps:
        raise BenchError(f"{traces[0]} holds no ProfilerStep# annotation: no step was profiled")
    window = (min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps))
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e and window[0] <= e["ts"] < window[1]]
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    if not kernels:
        raise BenchError(f"{traces[0]} holds no CUDA kernel in its profiled steps (a CPU-only trace?)")
    wall_us = window[1] - window[0]
    # A CUDA trace annotates each step more than once under the same name (the host's user_annotation and its
    # GPU-timeline copies), so steps are counted by step number, not by event.
    step_count = len({e["name"] for e in steps})
    busy_us = _union_length((e["ts"], min(e["ts"] + e["dur"], window[1])) for e in gpu)
    totals: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for event in kernels:
        totals[event["name"]] += event["dur"]
        calls[event["name"]] += 1
    kernel_us = sum(totals.values())
    return {
        "trace": traces[0].name,
        "steps": step_count,
        "step_ms": wall_us / step_count / 1e3,
        "gpu_busy_share": busy_us / wall_us,
        "gpu_idle_share": 1 - busy_us / wall_us,
        "kernel_share": kernel_us / wall_us,
        "top_kernels": [
            {"kernel": name[:160], "total_ms": us / 1e3, "share_of_step": us / wall_us, "share_of_kernels": us / kernel_us,
             "calls": calls[name]}
            for name, us in totals.most_common(count)
        ],
    }


def profile_step(step, steps: int = 2, count: int = 15) -> dict:
    """`profile_breakdown` of `steps` calls of `step` (after one unprofiled warm-up call), profiled with the
    PyTorch profiler in this process (CPU and CUDA activities)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with tempfile.TemporaryDirectory(prefix="nam56r-bench-profile-") as tmp:
        with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
            for _ in range(steps + 1):
                step()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                prof.step()
        prof.export_chrome_trace(str(Path(tmp) / "rank-0.json.gz"))
        return profile_breakdown(Path(tmp), count=count)


def _union_length(intervals) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once (kernels on several streams)."""
    covered, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        covered += end - max(start, end_so_far)
        end_so_far = end
    return covered
