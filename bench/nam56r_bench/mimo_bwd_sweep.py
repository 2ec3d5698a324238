"""The kernels suite's `mamba-mimo-bwd` case group (GPU): a launch-configuration sweep of Mamba-3's MIMO backward
TileLang kernels, `mamba_mimo_bwd_fwd` and `mamba_mimo_bwd_bwd` (mamba_ssm/ops/tilelang/mamba3/mamba3_mimo_bwd.py),
at NAM56R's shapes and micro-batches 4 and 8 (4 with --quick), against the configuration mamba_ssm launches them with
(`mamba_mimo_bwd_combined`: bwd_fwd threads=128, bwd_bwd threads=256, num_stages=0 both, chunk_size the model's).

1. The calls: one NAM56R Mamba-3 layer's step records mamba's own factory calls (nam56r.training.launcher.kernel_prewarm;
   nothing compiles), moved to each micro-batch. A candidate is such a call with its `settings` replaced by name; a
   name the real factory does not take is refused (`with_settings`).
2. Every call is compiled first, in parallel processes (about 30-70 s each), into TileLang's disk cache; a candidate
   that fails to compile gets a row with the compiler's error.
3. Per micro-batch, one process (`nam56r_bench.mimo_bwd_worker`) runs the reference on seeded inputs and each
   candidate on the same, comparing every output (max |candidate - reference| / max |reference| per output, and a
   bitwise-equal flag) and timing the two in alternating rounds (CUDA events, median). A candidate that hangs or
   crashes is written down with its cause and the rest run in a fresh process.

Rows: case ``mamba-mimo <kernel> mb<B>``, the reference as ``upstream config (...)``, each candidate by its settings,
with its interleaved speedup, per-output errors and compile seconds in ``extra``. A chunk_size candidate changes the
algorithm's blocking (and its kernels' output shapes): it runs the whole backward from the chunked decays on, in the
case ``mamba-mimo backward (dacs_segsum + mamba_mimo_bwd_combined) mb<B>``, compared on its 14 gradients.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nam56r.training.launcher.kernel_prewarm import FactoryCall
from nam56r_bench.harness import Context, Row, require_gpu
from nam56r_bench.kernel_shapes import KernelShapes, KernelSweep
from nam56r_bench.mimo_bwd_worker import BACKWARD, BWD_BWD, BWD_FWD, SweepError, describe, worker_main

SWEPT_FACTORIES = (BWD_FWD, BWD_BWD)
# The most a worker may take to start, load the reference kernels and run them, and then per candidate (load one
# kernel from the disk cache, run, compare, time): past it, the process is taken for hung and killed.
STARTUP_TIMEOUT_S = 300.0
CANDIDATE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Candidate:
    """A launch configuration to try: `settings` replace those factory arguments in `target`'s call(s)."""

    target: str  # BWD_FWD, BWD_BWD, or BACKWARD (both kernels' calls: a blocking change)
    settings: tuple[tuple[str, int], ...]
    why: str

    def label(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in self.settings)


# Upstream (state-spaces/mamba main, June 2026) still launches both kernels with fixed configurations; its autotuner
# spaces are left commented out above the factories (bwd_fwd: threads 128/256/512 x num_stages 0-3; bwd_bwd: threads
# 128/256, num_stages 0), tuned for 32 heads in 1 group at sequence 2048 on an H100. NAM56R runs 128 heads in 8 groups
# at 4096, a grid of (128, B) CTAs over 132 SMs, so the sweep takes the part of those spaces TileLang 0.1.8 builds
# without TMA or warp specialization (both kernels disable them) plus two probes past them.
CANDIDATES: tuple[Candidate, ...] = (
    Candidate(BWD_FWD, (("threads", 256),), "upstream's space: twice the warps to hide the per-chunk elementwise latency"),
    Candidate(BWD_FWD, (("threads", 512),), "upstream's space: its largest thread count"),
    Candidate(BWD_FWD, (("num_stages", 1),), "upstream's space: cp.async prefetch of the next chunk's Q/K/V/dO/Z loads"),
    Candidate(BWD_FWD, (("num_stages", 2),), "upstream's space: two chunks ahead (3 left out: ~100 KB shared memory per stage)"),
    Candidate(BWD_FWD, (("threads", 256), ("num_stages", 1)), "both of the above, should each help alone"),
    Candidate(BWD_BWD, (("threads", 128),), "upstream's space (its N=16 chunk-8 test runs it): more registers per thread"),
    Candidate(BWD_BWD, (("threads", 512),), "past upstream's space: its 64x64 tiles split over 16 warps"),
    Candidate(BWD_BWD, (("num_stages", 1),), "past upstream's space (stages 0 only): a probe; its ~200 KB of shared "
              "buffers may not fit a second stage"),
    Candidate(BACKWARD, (("chunk_size", 8),), "changes the blocking: the quadratic intra-chunk work halves while the "
              "sequential chunk loop doubles; upstream's test grid passes R=4 at chunk 8 (N16/P64, N256/P64, N128/P128) "
              "within its tolerance (stable max relative error < 0.10 against an fp32 reference)"),
)
# mamba_mimo_bwd_combined's shared-memory bound (it warns above it) and its minimum chunk.
MAX_CHUNK_TIMES_RANK, MIN_CHUNK = 64, 8


def with_settings(call: FactoryCall, settings: Sequence[tuple[str, int]]) -> FactoryCall:
    """`call` with `settings` replacing those arguments; a name the factory does not take (its call is bound to the
    real factory's signature, defaults included) is refused, naming the ones it takes."""
    arguments = dict(call.arguments)
    unknown = [name for name, _ in settings if name not in arguments]
    if unknown:
        raise SweepError(f"{call.name} takes no {', '.join(unknown)} (it takes {', '.join(arguments)}): mamba's "
                         "factory changed; update CANDIDATES")
    new = dict(settings)
    return FactoryCall(call.module, call.name, tuple((name, new.get(name, value)) for name, value in call.arguments))


@dataclass(frozen=True)
class Planned:
    """One candidate at one micro-batch: its calls, or why it is not run."""

    index: int
    candidate: Candidate
    calls: Mapping[str, FactoryCall]
    skipped: str | None = None


def plan(current: Mapping[str, FactoryCall], candidates: Sequence[Candidate] = CANDIDATES) -> list[Planned]:
    """Each candidate's calls against `current` ({factory name: mamba's call}); one that is the current configuration
    or a chunk size mamba's backward does not take is kept with the reason it is not run."""
    planned = []
    for index, candidate in enumerate(candidates):
        targets = SWEPT_FACTORIES if candidate.target == BACKWARD else (candidate.target,)
        calls = {name: with_settings(current[name], candidate.settings) for name in targets}
        planned.append(Planned(index, candidate, calls, _why_not(current, calls)))
    return planned


def _why_not(current: Mapping[str, FactoryCall], calls: Mapping[str, FactoryCall]) -> str | None:
    if all(calls[name] == current[name] for name in calls):
        return "this is the current configuration"
    args: dict[str, Any] = dict(next(iter(calls.values())).arguments)
    chunk, rank, seq = args["chunk_size"], args["R"], args["S"]
    if chunk < MIN_CHUNK or chunk * rank > MAX_CHUNK_TIMES_RANK or seq % chunk:
        return (f"chunk_size {chunk} is outside what mamba's backward takes at R={rank}, S={seq} (>= {MIN_CHUNK}, "
                f"chunk_size x R <= {MAX_CHUNK_TIMES_RANK}, dividing S)")
    return None


def call_label(call: FactoryCall) -> str:
    args = dict(call.arguments)
    return " ".join([call.name, *(f"{k}={args[k]}" for k in ("B", "threads", "num_stages", "chunk_size") if k in args)])


def compile_calls(calls: Sequence[FactoryCall], *, jobs: int | None = None) -> dict[FactoryCall, tuple[float | None, str | None]]:
    """Compile each distinct call in its own process, `jobs` at a time (default one per CPU); {call: (seconds, None)}
    or (None, the error) for one that failed: one failure does not stop the others."""
    from nam56r.training.launcher.kernel_prewarm import compile_in_processes, process_count

    work = list(dict.fromkeys(calls))
    jobs = process_count(jobs, len(work))
    print(f"[mimo-bwd] compiling {len(work)} kernels on {jobs} processes", flush=True)

    def report(call: FactoryCall, outcome: float | Exception, done: int, elapsed: float) -> None:
        state = f"failed: {describe(outcome).splitlines()[0][:200]}" if isinstance(outcome, Exception) else f"{outcome:.0f} s"
        print(f"[mimo-bwd] {call_label(call)}: {state} ({done}/{len(work)}, {elapsed:.0f} s)", flush=True)

    # the candidate's row carries the compiler's error
    return {call: (None, describe(outcome)) if isinstance(outcome, Exception) else (outcome, None)
            for call, outcome in compile_in_processes(work, jobs, report).items()}


def _next_message(connection, process, timeout: float):
    """The worker's next message, or None when it sent none within `timeout` or exited without one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if connection.poll(1.0) or not process.is_alive() and connection.poll(0):
            try:
                return connection.recv()
            except EOFError:
                return None
        if not process.is_alive():
            return None
    return None


def measure_batch(current: Mapping[str, FactoryCall], work: Sequence[Planned], quick: bool, *,
                  worker: Callable[..., None] = worker_main, startup_timeout: float = STARTUP_TIMEOUT_S,
                  candidate_timeout: float = CANDIDATE_TIMEOUT_S) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """(the reference's summary or {"error": ...}, {candidate index: its result or {"error": ...}}) for `work` at one
    micro-batch, in worker processes: one that fails, hangs or dies costs its candidate only, and a fresh process
    takes the rest."""
    reference: dict[str, Any] = {}
    results: dict[int, dict[str, Any]] = {}
    remaining = list(work)
    context = multiprocessing.get_context("spawn")
    while True:
        # A pipe, not a Queue: send() is written before it returns, so a process that dies right after still told.
        receiver, sender = context.Pipe(duplex=False)
        args = (dict(current), [(p.index, p.candidate.target, dict(p.calls)) for p in remaining], quick, sender)
        process = context.Process(target=worker, args=args, daemon=True)
        process.start()
        sender.close()
        try:
            lost, started = _follow(process, receiver, reference, results, remaining, startup_timeout, candidate_timeout)
        finally:
            receiver.close()
            if process.is_alive():
                process.kill()
            process.join()
        if lost is not None and not started:
            reference = {"error": f"the reference run failed: {lost}"}
        if "error" in reference:
            return reference, results | {p.index: {"error": f"not measured: {reference['error']}"} for p in remaining}
        if lost is not None and remaining:
            results[remaining.pop(0).index] = {"error": lost}
        if not remaining:
            return reference, results


def _follow(process, connection, reference: dict[str, Any], results: dict[int, dict[str, Any]], remaining: list[Planned],
            startup_timeout: float, candidate_timeout: float) -> tuple[str | None, bool]:
    """Read one worker's messages into `reference` and `results`, dropping measured candidates from `remaining`:
    (None, _) when it finished or stopped after a reported failure, else (why it was lost, whether its reference
    run had finished: the candidate it was on is then remaining[0])."""
    timeout, started = startup_timeout, False
    while True:
        message = _next_message(connection, process, timeout)
        if message is None:
            process.join(5.0)  # one whose pipe just closed may not have been reaped yet
            if process.is_alive():
                return f"no result within {timeout:.0f} s (a hang?); its process was killed", started
            return f"its process died with exit code {process.exitcode} (a crash in the kernel or CUDA)", started
        kind = message[0]
        if kind == "reference":
            if not reference:
                reference.update(message[1])
            started, timeout = True, candidate_timeout
        elif kind == "fatal":
            reference.clear()
            reference["error"] = message[1]
            return None, started
        elif kind in ("measured", "failed"):
            results[message[1]] = message[2] if kind == "measured" else {"error": message[2]}
            remaining[:] = [p for p in remaining if p.index != message[1]]
            if kind == "failed":
                return None, started
        elif kind == "done":
            return None, started


def _config(call: FactoryCall) -> dict[str, int]:
    args: dict[str, Any] = dict(call.arguments)
    return {name: args[name] for name in ("threads", "num_stages", "chunk_size")}


def _case(target: str, batch: int) -> str:
    if target == BACKWARD:
        return f"mamba-mimo backward (dacs_segsum + mamba_mimo_bwd_combined) mb{batch}"
    return f"mamba-mimo {target} mb{batch}"


def batch_rows(batch: int, current: Mapping[str, FactoryCall], planned: Sequence[Planned],
               compiled: Mapping[FactoryCall, tuple[float | None, str | None]], quick: bool) -> list[Row]:
    """Measure `planned` at `batch` (what compiled of it) and write every candidate's row, measured or not."""
    not_run: dict[int, dict[str, Any]] = {}
    runnable = []
    for p in planned:
        failures = [f"{call_label(c)} failed to compile: {compiled[c][1]}" for c in p.calls.values()
                    if p.skipped is None and compiled[c][1] is not None]
        if p.skipped is not None or failures:
            not_run[p.index] = {"error": f"not run: {p.skipped}" if p.skipped else "; ".join(failures)}
        else:
            runnable.append(p)
    broken = [f"{call_label(c)} failed to compile: {compiled[c][1]}" for c in current.values() if compiled[c][1] is not None]
    if broken:
        reference = {"error": "; ".join(broken)}
        results = {p.index: {"error": "not measured: the reference configuration did not compile"} for p in runnable}
    else:
        reference, results = measure_batch(current, runnable, quick)
    return _rows(batch, current, planned, reference, results | not_run, compiled)


def _rows(batch: int, current: Mapping[str, FactoryCall], planned: Sequence[Planned], reference: Mapping[str, Any],
          results: Mapping[int, Mapping[str, Any]], compiled: Mapping[FactoryCall, tuple[float | None, str | None]]) -> list[Row]:
    rows = []
    for target in (*SWEPT_FACTORIES, BACKWARD):
        mine = [p for p in planned if p.candidate.target == target]
        ref: Mapping[str, Any]
        if target == BACKWARD:
            if not mine:
                continue
            measured = [results[p.index]["reference_ms"] for p in mine if "reference_ms" in results[p.index]]
            ref = {"time_ms": measured[0]} if measured else {"error": "no backward candidate was measured"}
            config = {"chunk_size": _config(current[BWD_FWD])["chunk_size"]}
        else:
            ref = reference.get(target, reference)
            config = _config(current[target])
        label = ", ".join(f"{k}={v}" for k, v in config.items())
        rows.append(Row(_case(target, batch), f"upstream config ({label})", time_ms=ref.get("time_ms"),
                        extra={"config": config, **({"error": ref["error"]} if "error" in ref else {})}))
        for p in mine:
            result = results[p.index]
            extra = {"why": p.candidate.why, "config": {**config, **dict(p.candidate.settings)},
                     "compile_s": {call_label(c): compiled[c][0] for c in p.calls.values() if c in compiled}}
            for key in ("speedup", "reference_ms", "bitwise_equal", "errors", "error"):
                if key in result:
                    extra[key] = result[key]
            rows.append(Row(_case(target, batch), p.candidate.label(), time_ms=result.get("time_ms"),
                            max_error=result.get("max_error"), extra=extra))
    return rows


def mimo_bwd_cases(ctx: Context, shapes: KernelShapes, sweep: KernelSweep) -> list[Row]:
    """The sweep at the preset's shapes and each of sweep.mimo_bwd_batches (the kernels suite's case group)."""
    require_gpu("kernels")
    import torch

    from nam56r.model.presets import get_preset
    from nam56r.training.launcher.kernel_prewarm import record_mimo_calls

    recorded = {call.name: call for call in record_mimo_calls(get_preset(shapes.preset)) if call.name in SWEPT_FACTORIES}
    torch.cuda.empty_cache()
    currents = {batch: {name: call.at_batch(batch) for name, call in recorded.items()} for batch in sweep.mimo_bwd_batches}
    plans = {batch: plan(current) for batch, current in currents.items()}
    calls = [c for current in currents.values() for c in current.values()]
    calls += [c for planned in plans.values() for p in planned if p.skipped is None for c in p.calls.values()]
    compiled = compile_calls(calls)
    rows: list[Row] = []
    for batch, current in currents.items():
        rows += batch_rows(batch, current, plans[batch], compiled, ctx.quick)
    return rows
