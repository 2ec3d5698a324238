"""What every bench suite shares: the suite registry entry, the host/version stamp, timing on a GPU, and
writing a suite's JSON and PNG."""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nam56r import CHECKOUT_ROOT
from nam56r_bench.plots import render

ROOT = CHECKOUT_ROOT


class BenchError(RuntimeError):
    """A suite cannot run here or its measurement failed; the message says what is missing."""


@dataclass(frozen=True)
class Row:
    """One measurement: `variant` of `case` (e.g. case "dsa-scores mb8", variant "upstream" / "fused")."""

    case: str
    variant: str
    time_ms: float | None = None
    peak_extra_bytes: int | None = None
    max_error: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    out_dir: Path
    quick: bool  # fewer repetitions and smaller sweeps (a smoke run, not a result)
    models: tuple[str, ...] = ()  # the training suites' models (nam56r_bench.training_suites.RECIPES keys); () = the suite's default
    cache: Path | None = None  # the tooling suite's artifact cache; None = the patch lane's default
    micro_batches: tuple[int, ...] = ()  # the train-step suite's micro-batch sizes; () = each recipe's own
    recompute: tuple[str, ...] = ()  # the training suites' --recompute settings ("each": all of RECOMPUTE_SETTINGS); () = the recipe's
    linear_ce: tuple[str, ...] = ()  # the training suites' --linear-ce paths; () = microbatch: every one, train-step: the recipe's
    # train-step's runs of each model and size, one per entry: launcher options as one shell-quoted string ("" = none);
    # () = one run with none
    train_args: tuple[str, ...] = ()
    prewarm_mbs: tuple[int, ...] = ()  # micro-batch sizes microbatch compiles the Mamba-3 MIMO kernels for first; () = none
    kernel_cases: tuple[str, ...] = ()  # the kernels suite's case groups (kernel_suite.CASE_GROUPS keys); () = all


@dataclass(frozen=True)
class Suite:
    name: str
    summary: str
    needs_gpu: bool
    run: Callable[[Context], list[Row]]


def stamp() -> dict[str, Any]:
    """Host, versions, this checkout's commit and the pinned upstream commits: where a result came from. The
    versions are the validation manifest's host stamp of this interpreter."""
    from nam56r_patchlane.manifest import host_stamp

    info: dict[str, Any] = {"date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "host": platform.node(),
                            **asdict(host_stamp(sys.executable))}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        pass
    info["commit"], info["dirty"] = checkout_commit(ROOT)
    info["upstreams"] = _upstream_pins()
    return info


def checkout_commit(root: Path, env_dir: Path = Path(sys.prefix)) -> tuple[str, bool | None]:
    """(HEAD of the git checkout whose top is `root`, whether its tracked files differ from it). Outside a
    checkout (a copy of a built tree without `.git`), the state the build of `env_dir` (this interpreter's
    environment) recorded, marked "(build record)"; without either, ("unknown", None): a bench result still
    stands without it (`nam56r_patchlane.checkout_state`)."""
    from nam56r_patchlane.checkout_state import built_checkout, checkout_state

    state = checkout_state(root)
    if state.commit is not None:
        return state.commit, state.dirty
    built = built_checkout(env_dir)
    if built is not None and built.commit is not None:
        return f"{built.commit} (build record)", built.dirty
    return "unknown", None


def _upstream_pins() -> dict[str, str]:
    from nam56r_patchlane.lock import load_lock

    return {u.name: u.commit for u in load_lock(ROOT).upstreams}


def require_gpu(suite: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise BenchError(f"suite {suite!r} needs a CUDA GPU (an H100/H200) and none is visible here")


def cuda_time_ms(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10, calls_per_sample: int = 1) -> float:
    """Median milliseconds per call of `fn` over `iters` samples after `warmup` calls (`cuda_samples_ms`)."""
    return statistics.median(cuda_samples_ms(fn, warmup=warmup, iters=iters, calls_per_sample=calls_per_sample))


def cuda_samples_ms(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10, calls_per_sample: int = 1) -> list[float]:
    """Milliseconds per call of `fn` in each of `iters` samples after `warmup` calls, timed with CUDA events. A
    sample is `calls_per_sample` calls in a row with no synchronization between them (the host queues a call while
    the GPU still runs the previous one), divided by their number."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_sample):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls_per_sample)
    return times


def cuda_peak_extra_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak CUDA memory `fn` allocates beyond what was allocated when it started, its outputs included;
    what `fn` returned)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, result


BASELINE_PREFIXES = ("upstream", "reference")


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """Per case, each candidate against the fastest measured baseline (a variant named upstream… or
    reference…): speedup = baseline time / candidate time, memory_ratio = baseline memory / candidate memory."""
    out = []
    by_case: dict[str, list[Row]] = {}
    for row in rows:
        by_case.setdefault(row.case, []).append(row)
    for case, variants in by_case.items():
        baselines = [r for r in variants if r.variant.startswith(BASELINE_PREFIXES) and r.time_ms is not None]
        if not baselines:
            continue
        base = min(baselines, key=lambda r: r.time_ms)
        for row in variants:
            if row.variant.startswith(BASELINE_PREFIXES):
                continue
            entry: dict[str, Any] = {"case": case, "variant": row.variant, "against": base.variant}
            if base.time_ms and row.time_ms:
                entry["speedup"] = base.time_ms / row.time_ms
            if base.peak_extra_bytes and row.peak_extra_bytes:
                entry["memory_ratio"] = base.peak_extra_bytes / row.peak_extra_bytes
            out.append(entry)
    return out


def write_suite(suite: Suite, rows: list[Row], ctx: Context, host: dict[str, Any], seconds: float) -> Path:
    """<out>/<suite>.json (stamp, rows, ratios) and <out>/<suite>.png; returns the JSON path."""
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "suite": suite.name,
        "summary": suite.summary,
        "quick": ctx.quick,
        "host": host,
        "seconds": round(seconds, 2),
        "rows": [asdict(r) for r in rows],
        "ratios": ratios(rows),
    }
    path = ctx.out_dir / f"{suite.name}.json"
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    render(result, path.with_suffix(".png"))
    return path
