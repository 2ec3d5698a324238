"""The GPU side of the `mamba-mimo-bwd` sweep (`nam56r_bench.mimo_bwd_sweep`): one process per micro-batch that loads
the compiled kernels, builds one set of inputs, runs mamba_ssm's launch configuration as the reference and measures
each candidate against it. It runs in a process of its own so that a candidate that hangs the GPU or leaves the CUDA
context unusable costs that candidate only: the sweep kills the process and starts another for the rest.

The kernels are called with their arguments matched to the TIR's parameters by name (`kernel_arguments`), the way
`mamba_mimo_bwd_combined` passes them; `tests/bench/test_mimo_bwd_sweep.py` checks that match on CPU against the
tensors mamba's own backward hands the kernels.
"""

from __future__ import annotations

import math
import statistics
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nam56r.training.launcher.kernel_prewarm import FactoryCall

BWD_FWD, BWD_BWD = "mamba_mimo_bwd_fwd", "mamba_mimo_bwd_bwd"
# Both kernels and the wrapper around them, from the chunked decays on: a candidate that changes the blocking
# (chunk_size) changes the shapes of the kernels' chunk outputs, so it is compared on the backward's gradients.
BACKWARD = "backward"

# `mamba_mimo_bwd_combined`'s tensor parameters -> the kernels' TIR buffers they are passed as.
WRAPPER_TO_BUFFER = {
    "dout": "DOUT", "q": "Q", "k": "K", "v": "V", "q_bias": "Q_BIAS", "k_bias": "K_BIAS", "mimo_v": "MIMO_V",
    "mimo_o": "MIMO_O", "z": "Z", "mimo_z": "MIMO_Z", "angles": "ANGLES", "dA_cs": "DA_CS", "dA_cs_rev": "DA_CS_REV",
    "dt": "DT", "trap": "TRAP", "D": "D", "segsum": "SEGSUM",
}
# What each kernel writes; everything else it takes is an input.
OUTPUTS = {
    BWD_FWD: ("DMIMO_O", "STATES", "DZ", "DMIMO_Z", "QK_DOT"),
    BWD_BWD: ("DK", "DV", "DMIMO_V", "DQ", "DFACTOR", "DGAMMA_DIAG", "DANGLES", "DD", "DDA", "DSSDA", "DDA_CS_REV", "DDA_CS"),
}
PASSED_ON = ("STATES", "QK_DOT")  # bwd_fwd's outputs that bwd_bwd reads
# mamba_mimo_bwd_combined's return values, in order.
GRADIENTS = ("dq", "dk", "dv", "ddA", "ddt", "dtrap", "dq_bias", "dk_bias", "dmimo_v", "dmimo_z", "dmimo_o", "dangles", "dD", "dz")


class SweepError(RuntimeError):
    """The sweep cannot build or run a measurement; the message names what and why."""


@dataclass(frozen=True)
class Timing:
    warmup: int
    rounds: int  # a candidate and the reference alternate this many times ...
    samples: int  # ... timing this many calls each time


FULL_TIMING, QUICK_TIMING = Timing(warmup=3, rounds=4, samples=5), Timing(warmup=1, rounds=2, samples=3)


@dataclass(frozen=True)
class Dims:
    """The static shape arguments of a backward factory call (mamba_ssm's names)."""

    B: int
    S: int
    H: int
    G: int
    N: int
    P: int
    R: int
    chunk_size: int
    rotary_dim_divisor: int
    dtype: str


def dims_of(call: FactoryCall) -> Dims:
    """The shapes of `call`; refused unless it is NAM56R's case (Z gate, D skip, MIMO output projection)."""
    args: dict[str, Any] = dict(call.arguments)
    if not (args["hasZ"] and args["hasD"] and args["reduceO"]):
        raise SweepError(f"{call.name}: the sweep builds the gated case with D and the MIMO output projection (NAM56R's); "
                         f"got hasZ={args['hasZ']}, hasD={args['hasD']}, reduceO={args['reduceO']}")
    return Dims(**{name: args[name] for name in Dims.__dataclass_fields__})


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[str(name)]


def dacs_segsum(adt, chunk_size: int):
    """mamba's chunked decays (DA_CS, DA_CS_REV, SEGSUM), as its backward computes them before the kernels."""
    from mamba_ssm.ops.triton.mamba3 import mamba3_mimo_utils

    return mamba3_mimo_utils.compute_dacs_segsum_triton(adt, chunk_size)


def backward_inputs(dims: Dims, device: str, seed: int = 0) -> tuple[dict[str, Any], Any]:
    """(`mamba_mimo_bwd_combined`'s tensor arguments by its parameter names, the per-step decay A*dt they are chunked
    from): seeded, so every worker process builds the same. Magnitudes as a trained layer's: dt around 0.1, decays in
    (-1, 0], pre-sigmoid trap logits, unit activations."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    act, f32 = torch_dtype(dims.dtype), torch.float32
    B, S, H, G, N, P, R = dims.B, dims.S, dims.H, dims.G, dims.N, dims.P, dims.R

    def randn(*shape: int, scale: float = 1.0, dtype=act):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    dt = torch.nn.functional.softplus(randn(B, H, S, dtype=f32) - 2)
    adt = -dt * (1 + 7 * torch.rand(B, H, S, generator=g, device=device))
    inputs = {
        "dout": randn(B, S, H, P), "q": randn(B, S, R, G, N), "k": randn(B, S, R, G, N), "v": randn(B, S, H, P),
        "q_bias": randn(H, R, N, scale=0.1, dtype=f32), "k_bias": randn(H, R, N, scale=0.1, dtype=f32),
        "mimo_v": randn(H, R, P, scale=0.5, dtype=f32), "mimo_o": randn(H, R, P, scale=0.5, dtype=f32),
        "z": randn(B, S, H, P), "mimo_z": randn(H, R, P, scale=0.5, dtype=f32),
        "angles": torch.rand(B, S, H, N // dims.rotary_dim_divisor, generator=g, device=device) * (2 * math.pi),
        "dt": dt, "trap": randn(B, H, S), "D": randn(H, dtype=f32),
    }
    inputs["dA_cs"], inputs["dA_cs_rev"], inputs["segsum"] = dacs_segsum(adt, dims.chunk_size)
    return inputs, adt


def kernel_buffers(kernel) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each tensor parameter of a compiled TileLang kernel, in call order."""
    func = kernel.prim_func
    return [(b.name, tuple(int(d) for d in b.shape), str(b.dtype)) for b in (func.buffer_map[p] for p in func.params)]


def kernel_arguments(kernel, name: str, available: Mapping[str, Any], device: str) -> tuple[list[Any], dict[str, Any]]:
    """(the positional arguments of `kernel`, the `name` factory's, its outputs by buffer name): inputs from
    `available` (by TIR buffer name), outputs NaN-filled so that an element a candidate leaves unwritten shows."""
    import torch

    args, outputs = [], {}
    buffers = kernel_buffers(kernel)
    missing = sorted(set(OUTPUTS[name]) - {b for b, _, _ in buffers})
    if missing:
        raise SweepError(f"{name} no longer writes {missing}: mamba's kernel changed; update OUTPUTS in {__name__}")
    for buffer, shape, dtype in buffers:
        if buffer in OUTPUTS[name]:
            outputs[buffer] = torch.full(shape, float("nan"), dtype=torch_dtype(dtype), device=device)
            args.append(outputs[buffer])
            continue
        if buffer not in available:
            raise SweepError(f"{name} takes {buffer}, which the sweep neither builds nor reads back: mamba's kernel "
                             f"changed; update WRAPPER_TO_BUFFER/OUTPUTS in {__name__}")
        tensor = available[buffer]
        if tuple(tensor.shape) != shape or tensor.dtype != torch_dtype(dtype):
            raise SweepError(f"{name}.{buffer} is {shape} {dtype}, the sweep built {tuple(tensor.shape)} {tensor.dtype}")
        args.append(tensor)
    return args, outputs


def compare(got: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, Any]:
    """Per output, max |got - want| / max |want| (inf where they differ in which elements are finite), and whether
    every output is bit for bit the reference's."""
    from nam56r_bench.case_measure import relative_error

    errors = {name: relative_error(got[name], want[name]) for name in want if want[name] is not None}
    bitwise = all(_same_bits(got[name], want[name]) for name in errors)
    return {"max_error": max(errors.values(), default=0.0), "errors": errors, "bitwise_equal": bitwise}


def _same_bits(a, b) -> bool:
    import torch

    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(as_int[a.element_size()]), b.view(as_int[b.element_size()]))


def interleaved_ms(reference: Callable[[], Any], candidate: Callable[[], Any], timing: Timing) -> tuple[list[float], list[float]]:
    """CUDA-event milliseconds per call of `reference` and `candidate`, timed in alternating rounds so that clock and
    thermal drift fall on both alike."""
    from nam56r_bench.harness import cuda_samples_ms

    ref, cand = [], []
    for _ in range(timing.rounds):
        ref += cuda_samples_ms(reference, warmup=timing.warmup, iters=timing.samples)
        cand += cuda_samples_ms(candidate, warmup=timing.warmup, iters=timing.samples)
    return ref, cand


class KernelBench:
    """The reference run of one micro-batch: mamba's launch configuration (`current`, a call per factory) on one set of
    inputs, its outputs kept to compare candidates against."""

    def __init__(self, current: Mapping[str, FactoryCall], timing: Timing) -> None:
        import torch

        self.current, self.timing, self.dims = current, timing, dims_of(current[BWD_FWD])
        self.inputs, self.adt = backward_inputs(self.dims, "cuda")
        self.base = {WRAPPER_TO_BUFFER[k]: v for k, v in self.inputs.items()}
        self.kernels = {name: call.factory()(**dict(call.arguments)) for name, call in current.items()}
        self.args: dict[str, list[Any]] = {}
        self.reference: dict[str, dict[str, Any]] = {}
        for name in (BWD_FWD, BWD_BWD):
            self.args[name], outputs = kernel_arguments(self.kernels[name], name, self.available(), "cuda")
            self.kernels[name](*self.args[name])
            torch.cuda.synchronize()
            # Copies: timing the reference later writes into `outputs` again.
            self.reference[name] = {k: v.clone() for k, v in outputs.items()}
        self._backward_reference: dict[str, Any] | None = None

    def available(self) -> dict[str, Any]:
        """The kernels' inputs by buffer name: the built ones, and bwd_fwd's reference outputs that bwd_bwd reads."""
        passed = {k: self.reference[BWD_FWD][k] for k in PASSED_ON} if BWD_FWD in self.reference else {}
        return {**self.base, **passed}

    def reference_summary(self) -> dict[str, Any]:
        from nam56r_bench.harness import cuda_samples_ms

        summary = {}
        for name in (BWD_FWD, BWD_BWD):
            launch = self._launcher(self.kernels[name], self.args[name])
            summary[name] = {"time_ms": statistics.median(cuda_samples_ms(launch, warmup=self.timing.warmup,
                                                                         iters=self.timing.rounds * self.timing.samples))}
        return summary

    def measure(self, target: str, calls: Mapping[str, FactoryCall]) -> dict[str, Any]:
        """A candidate's calls (`target` one kernel, or BACKWARD: both and the wrapper) against the reference."""
        if target == BACKWARD:
            chunk_size: int = dict(calls[BWD_FWD].arguments)["chunk_size"]  # type: ignore[assignment]
            return self._measure_backward(chunk_size)
        call = calls[target]
        if dict(call.arguments)["chunk_size"] != self.dims.chunk_size:
            raise SweepError(f"{call.name}: a chunk_size change is measured on the whole backward (target {BACKWARD!r})")
        kernel = call.factory()(**dict(call.arguments))
        args, outputs = kernel_arguments(kernel, target, self.available(), "cuda")
        kernel(*args)
        result = compare(outputs, self.reference[target])
        ref, cand = interleaved_ms(self._launcher(self.kernels[target], self.args[target]), self._launcher(kernel, args), self.timing)
        return {**result, **_times(ref, cand)}

    def _measure_backward(self, chunk_size: int) -> dict[str, Any]:
        reference = self._backward(self.dims.chunk_size)
        if self._backward_reference is None:
            self._backward_reference = dict(zip(GRADIENTS, reference(), strict=True))
        candidate = self._backward(chunk_size)
        result = compare(dict(zip(GRADIENTS, candidate(), strict=True)), self._backward_reference)
        return {**result, **_times(*interleaved_ms(reference, candidate, self.timing))}

    def _backward(self, chunk_size: int) -> Callable[[], tuple]:
        """mamba's MIMO backward from the chunked decays on, at `chunk_size` (what _Mamba3Function.backward runs before
        the angle cumsum's backward)."""
        from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo_bwd

        fixed = {k: v for k, v in self.inputs.items() if k not in ("dA_cs", "dA_cs_rev", "segsum")}

        def run() -> tuple:
            dA_cs, dA_cs_rev, segsum = dacs_segsum(self.adt, chunk_size)
            return mamba3_mimo_bwd.mamba_mimo_bwd_combined(
                **fixed, dA_cs=dA_cs, dA_cs_rev=dA_cs_rev, segsum=segsum, chunk_size=chunk_size,
                rotary_dim_divisor=self.dims.rotary_dim_divisor, dtype=torch_dtype(self.dims.dtype))

        return run

    @staticmethod
    def _launcher(kernel, args: list[Any]) -> Callable[[], None]:
        return lambda: kernel(*args)


def _times(reference: list[float], candidate: list[float]) -> dict[str, float]:
    ref, cand = statistics.median(reference), statistics.median(candidate)
    return {"time_ms": cand, "reference_ms": ref, "speedup": ref / cand}


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def worker_main(current: Mapping[str, FactoryCall], work: list[tuple[int, str, dict[str, FactoryCall]]], quick: bool, channel) -> None:
    """Measure `work` ((index, target, calls) per candidate) against `current` at one micro-batch, sending on
    `channel` (a pipe's sending end): ("reference", summary) once, then ("measured" | "failed", index, result or
    error) per candidate, ("done",) at the end, or ("fatal", error) when the reference itself cannot run. After a
    failed candidate it stops: the parent starts a fresh process for the rest, as a failed launch may leave this
    process's CUDA context unusable."""
    try:
        bench = KernelBench(current, QUICK_TIMING if quick else FULL_TIMING)
        channel.send(("reference", bench.reference_summary()))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which writes it into the rows
        traceback.print_exc()
        channel.send(("fatal", describe(exc)))
        return
    for index, target, calls in work:
        try:
            channel.send(("measured", index, bench.measure(target, calls)))
        except Exception as exc:  # noqa: BLE001 - as above
            traceback.print_exc()
            channel.send(("failed", index, describe(exc)))
            return
    channel.send(("done",))
