"""Compile the Mamba-3 MIMO TileLang kernels for a recipe's shapes at several micro-batch sizes, in parallel, before
training needs them.

mamba_ssm's three MIMO kernel factories (`mamba_mimo_fwd`, `mamba_mimo_bwd_fwd`, `mamba_mimo_bwd_bwd`) take the
batch `B` as a static argument (mamba patch 0004 keeps upstream's static shapes), so each new micro-batch size costs
a training process about 2.5 minutes of serial compiles in its first step. Compiled kernels land in TileLang's
on-disk cache (`TILELANG_CACHE_DIR`, default ~/.tilelang/cache), keyed by the kernel's TIR, target and pass configs,
so a kernel compiled here is a cache hit for any later process on the machine.

How the calls are found: one Mamba-3 layer, built as the model builds it (`nam56r.model.mamba3_mixer.build_mamba3`),
runs a forward and backward at micro-batch 1 on the GPU with the three factories replaced by recorders that keep
their arguments and return kernels that do nothing (nothing compiles, the outputs are garbage). The recorded calls
are mamba's own, shapes and options included; only `B` is then changed, and a process pool calls the real factories
(`--jobs`, default one per CPU), each compile in its own process.

    python -m nam56r.training.launcher.kernel_prewarm --recipe proxy-1gpu --mbs 1-12
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from nam56r.training.arg_types import positive_int

# (module, factory) for each MIMO kernel factory whose arguments include the static batch `B`.
MIMO_FACTORIES = (
    ("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_fwd", "mamba_mimo_fwd"),
    ("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_bwd", "mamba_mimo_bwd_fwd"),
    ("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_bwd", "mamba_mimo_bwd_bwd"),
)
BATCH_ARGUMENT = "B"


class PrewarmError(RuntimeError):
    pass


@dataclass(frozen=True)
class FactoryCall:
    """One call of a `@tilelang.jit` factory: its module and name, and its arguments bound by parameter name."""

    module: str
    name: str
    arguments: tuple[tuple[str, object], ...]

    def factory(self):
        return getattr(importlib.import_module(self.module), self.name)

    @property
    def batch(self) -> int:
        return dict(self.arguments)[BATCH_ARGUMENT]

    def at_batch(self, batch: int) -> FactoryCall:
        """The same call with the static batch `B` set to `batch`."""
        if batch < 1:
            raise PrewarmError(f"{self.name}: batch must be at least 1, got {batch}")
        return FactoryCall(self.module, self.name, tuple((k, batch if k == BATCH_ARGUMENT else v) for k, v in self.arguments))

    def label(self) -> str:
        return f"{self.name} B={self.batch}"


class _NoOpKernel:
    def __call__(self, *args: object, **kwargs: object) -> None:
        return None


class _Recorder:
    """Stands in for one factory while calls are recorded: binds the arguments to the real factory's signature
    (a call the factory would refuse fails here too) and returns a kernel that does nothing."""

    def __init__(self, module: str, name: str, real, calls: list[FactoryCall]) -> None:
        self.module, self.name, self.real, self.calls = module, name, real, calls

    def __call__(self, *args: object, **kwargs: object) -> _NoOpKernel:
        bound = self.real.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if BATCH_ARGUMENT not in bound.arguments:
            raise PrewarmError(f"{self.module}.{self.name} has no {BATCH_ARGUMENT!r} parameter; the prewarm cannot vary its batch")
        call = FactoryCall(self.module, self.name, tuple(bound.arguments.items()))
        if call not in self.calls:
            self.calls.append(call)
        return _NoOpKernel()


@contextlib.contextmanager
def recording(calls: list[FactoryCall], factories: Sequence[tuple[str, str]] = MIMO_FACTORIES) -> Iterator[list[FactoryCall]]:
    """Within the block, mamba's wrappers reach `factories` through recorders that append to `calls` and compile
    nothing (the wrappers look the factories up as module globals at each call)."""
    replaced = []
    try:
        for module, name in factories:
            mod = importlib.import_module(module)
            real = getattr(mod, name)
            setattr(mod, name, _Recorder(module, name, real, calls))
            replaced.append((mod, name, real))
        yield calls
    finally:
        for mod, name, real in replaced:
            setattr(mod, name, real)


def record_mimo_calls(model, *, micro_batch: int = 1) -> list[FactoryCall]:
    """The MIMO factory calls one of `model`'s (a `ModelConfig`) Mamba-3 layers makes in a training step's forward
    and backward at `micro_batch`, recorded on the current CUDA device without compiling anything."""
    import torch

    from nam56r.model.mamba3_mixer import build_mamba3

    if not model.mamba.mimo:
        raise PrewarmError("the model's Mamba-3 layers are SISO (mamba.mimo false): they use Triton kernels, not the MIMO TileLang ones")
    if not torch.cuda.is_available():
        raise PrewarmError("recording the Mamba-3 kernel calls needs a CUDA GPU (mamba's Triton kernels run around them)")
    device = torch.device("cuda", torch.cuda.current_device())
    # NAM56R's Mamba-3 layers run in bf16 at either precision (fp8 reaches only TransformerEngine's GEMMs).
    layer = build_mamba3(model.mamba, model.hidden_size, 1, device=device, dtype=torch.bfloat16)
    inputs = torch.randn(micro_batch, model.seq_length, model.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    calls: list[FactoryCall] = []
    with recording(calls):
        layer(inputs).float().sum().backward()
    torch.cuda.synchronize()
    names = sorted({call.name for call in calls})
    expected = sorted(name for _, name in MIMO_FACTORIES)
    if names != expected:
        raise PrewarmError(f"a Mamba-3 layer's step called the MIMO factories {names}, expected {expected}")
    return calls


def compile_call(call: FactoryCall) -> float:
    """Call the real factory (compiling into TileLang's disk cache, or loading from it); seconds taken."""
    start = time.perf_counter()
    call.factory()(**dict(call.arguments))
    return time.perf_counter() - start


def compile_in_processes(work: Sequence[FactoryCall], jobs: int,
                         report: Callable[[FactoryCall, float | Exception, int, float], None]) -> dict[FactoryCall, float | Exception]:
    """Each call compiled in a process of its own, `jobs` at a time: {call: seconds, or the exception its compile
    raised}; `report(call, outcome, calls done, seconds elapsed)` as each finishes (it may raise to stop)."""
    outcomes: dict[FactoryCall, float | Exception] = {}
    start = time.perf_counter()
    # spawn: a forked child would inherit this process's CUDA state.
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(compile_call, call): call for call in work}
        for future in as_completed(futures):
            call = futures[future]
            try:
                outcomes[call] = future.result()
            except Exception as exc:  # noqa: BLE001 - the caller's report decides what a failed compile means
                outcomes[call] = exc
            report(call, outcomes[call], len(outcomes), time.perf_counter() - start)
    return outcomes


def process_count(jobs: int | None, work: int) -> int:
    """`jobs`, or one process per CPU, and at most one per compile."""
    return max(1, min(jobs or os.cpu_count() or 1, work))


def compile_at_batches(calls: Sequence[FactoryCall], batches: Sequence[int], *, jobs: int | None = None) -> dict[str, float]:
    """Compile every call at every batch in `batches`, `jobs` processes at a time (default: one per CPU, at most
    one per compile); {label: seconds}, printed as each finishes. A failed compile raises, naming it."""
    work = [call.at_batch(batch) for batch in batches for call in calls]
    if not work:
        return {}
    jobs = process_count(jobs, len(work))
    print(f"[prewarm] {len(work)} kernels ({len(calls)} factories x micro-batches {format_sizes(batches)}) on {jobs} processes",
          flush=True)

    def report(call: FactoryCall, outcome: float | Exception, done: int, elapsed: float) -> None:
        if isinstance(outcome, Exception):
            raise PrewarmError(f"compiling {call.label()} failed: {type(outcome).__name__}: {outcome}") from outcome
        print(f"[prewarm] {call.label()}: {outcome:.1f} s ({done}/{len(work)}, {elapsed:.0f} s elapsed)", flush=True)

    return {call.label(): seconds for call, seconds in compile_in_processes(work, jobs, report).items()}


def parse_sizes(text: str) -> tuple[int, ...]:
    """'1-4,8' -> (1, 2, 3, 4, 8): micro-batch sizes, ranges inclusive."""
    sizes: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise ValueError(f"micro-batch sizes are numbers and ranges such as 1-12,16; got {text!r}") from None
        if first < 1 or last < first:
            raise ValueError(f"micro-batch range {part.strip()!r} must go up from 1 or more")
        sizes += range(first, last + 1)
    return tuple(dict.fromkeys(sizes))


def format_sizes(sizes: Sequence[int]) -> str:
    return ",".join(map(str, sizes)) if len(sizes) < 4 or list(sizes) != list(range(sizes[0], sizes[-1] + 1)) else f"{sizes[0]}-{sizes[-1]}"


def build_parser() -> argparse.ArgumentParser:
    from nam56r.model.presets import PRESETS
    from nam56r.training.recipe import RECIPES

    parser = argparse.ArgumentParser(prog="python -m nam56r.training.launcher.kernel_prewarm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="proxy-1gpu", choices=sorted(RECIPES),
                        help="the recipe whose shapes to compile for (default proxy-1gpu)")
    parser.add_argument("--model", choices=sorted(PRESETS), help="model preset, as the launcher's --model")
    parser.add_argument("--seq", type=int, dest="seq_length", help="sequence length, as the launcher's --seq (default: the recipe's)")
    parser.add_argument("--mbs", type=sizes_argument, required=True, metavar="SIZES",
                        help="micro-batch sizes per GPU to compile for: numbers and inclusive ranges, e.g. 1-12 or 2,4,8")
    parser.add_argument("--jobs", type=positive_int, help="compile processes (default: one per CPU, at most one per kernel)")
    return parser


def sizes_argument(text: str) -> tuple[int, ...]:
    """`parse_sizes` as an argparse type: a bad list is a usage error."""
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    from nam56r.training.recipe import get_recipe

    args = build_parser().parse_args(argv)
    model = get_recipe(args.recipe, kernels=False, model=args.model, seq_length=args.seq_length).model_config()
    start = time.perf_counter()
    try:
        calls = record_mimo_calls(model)
        print(f"[prewarm] recorded {len(calls)} MIMO kernel calls of one {model.name} Mamba-3 layer at seq {model.seq_length} "
              f"in {time.perf_counter() - start:.1f} s", flush=True)
        seconds = compile_at_batches(calls, args.mbs, jobs=args.jobs)
    except PrewarmError as exc:
        print(f"kernel_prewarm: {exc}", file=sys.stderr)
        return 1
    print(f"[prewarm] done: {len(seconds)} kernels in {time.perf_counter() - start:.0f} s, the slowest {max(seconds.values()):.0f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
