"""Patch mamba 0004: the Mamba-3 MIMO call sites pass plain-int shapes to the @tilelang.jit kernel
factories, so tilelang.jit's in-memory cache hits and each kernel compiles once per shape.

The pinned release passes fresh T.dynamic symbols on every call: the cache key never repeats and every
forward and backward runs the factory body again on the host. Here the real factories run their real
bodies (TIR elaboration works on CPU) through the real entry points mamba_mimo_forward(_varlen) and
mamba_mimo_bwd_combined(_varlen); only the step below them is recorded instead of run: the JITKernel
that TileLang's kernel cache builds (TVM lowering and nvcc, which need CUDA). TileLang's own kernel
cache is disabled so that every compile tilelang.jit asks for reaches that JITKernel and is counted.
The GPU measurement (host vs GPU time per forward+backward) is pack 12's reproducer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import tilelang.cache.kernel_cache
import torch
from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo_bwd, mamba3_mimo_bwd_varlen, mamba3_mimo_fwd, mamba3_mimo_fwd_varlen
from tilelang.jit import JITImpl
from torch.overrides import TorchFunctionMode
from tvm import tir

R, N, P, CHUNK = 4, 16, 8, 16
H100_TARGET = "cuda -arch=sm_90a"
FACTORIES = {
    "fwd": mamba3_mimo_fwd.mamba_mimo_fwd,
    "bwd_fwd": mamba3_mimo_bwd.mamba_mimo_bwd_fwd,
    "bwd_bwd": mamba3_mimo_bwd.mamba_mimo_bwd_bwd,
    "fwd_varlen": mamba3_mimo_fwd_varlen.mamba_mimo_fwd,
    "bwd_fwd_varlen": mamba3_mimo_bwd_varlen.mamba_mimo_bwd_fwd,
    "bwd_bwd_varlen": mamba3_mimo_bwd_varlen.mamba_mimo_bwd_bwd,
}


@dataclass
class RecordedKernel:
    """What TileLang was asked to lower and compile, and every launch of the result."""

    prim_func: tir.PrimFunc
    target: Any
    launches: list[tuple] = field(default_factory=list)

    def __call__(self, *tensors: Any) -> None:
        self.launches.append(tensors)

    def __repr__(self) -> str:
        return f"<{self.prim_func.attrs['global_symbol']} Q={self.shape('Q')} launched {len(self.launches)}x>"

    def shape(self, buffer: str) -> list[int | str]:
        """The shape of the kernel's tensor argument `buffer`: ints where static, symbol names where dynamic."""
        shapes = {b.name: b.shape for b in self.prim_func.buffer_map.values()}
        return [int(d) if isinstance(d, tir.IntImm) else str(d) for d in shapes[buffer]]


@dataclass
class Compiler:
    """Takes the place of JITKernel inside TileLang's kernel cache: records instead of lowering."""

    kernels: list[RecordedKernel] = field(default_factory=list)

    def __call__(self, func: tir.PrimFunc, *, target: Any = None, **compile_args: Any) -> RecordedKernel:
        assert isinstance(func, tir.PrimFunc), type(func)
        self.kernels.append(RecordedKernel(func, target))
        return self.kernels[-1]

    def named(self, name: str) -> list[RecordedKernel]:
        return [k for k in self.kernels if str(k.prim_func.attrs["global_symbol"]) == name]


class CudaAllocationsOnCpu(TorchFunctionMode):
    """The entry points allocate some outputs with device='cuda'; on a CPU host those land on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@pytest.fixture
def compiler(monkeypatch: pytest.MonkeyPatch) -> Iterator[Compiler]:
    recorder = Compiler()
    monkeypatch.setattr(tilelang.cache.kernel_cache, "JITKernel", recorder)
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")  # no disk or memory cache below tilelang.jit
    # An H100's target, named in full: "auto" or a bare "cuda" probe the CUDA runtime, which aborts on a CPU host.
    monkeypatch.setenv("TILELANG_TARGET", H100_TARGET)
    for factory in FACTORIES.values():
        assert isinstance(factory, JITImpl), f"{factory!r} is not the real @tilelang.jit factory"
        monkeypatch.setattr(factory, "_kernel_cache", {})
        monkeypatch.setattr(factory.func, "p1_cache", {})
    with CudaAllocationsOnCpu():
        yield recorder


def cache_keys(factory: JITImpl) -> list[tuple]:
    return list(factory._kernel_cache)


def assert_plain_key(key: tuple) -> None:
    """tilelang.jit keys a lazy factory's call by its (name, value) pairs: each value must compare by value, not identity."""
    items, _ = key
    for name, value in items:
        assert isinstance(value, bool | int | str | type(None)), f"key item {name}={value!r} ({type(value).__name__})"


def inputs(b: int, s: int, h: int, g: int, nchunks: int | None = None) -> dict[str, Any]:
    """The entry points' tensor arguments, by name: bf16 activations, fp32 parameters and decays (as patch 0002 passes them)."""
    act = lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16)  # noqa: E731
    f32 = lambda *shape: torch.zeros(*shape, dtype=torch.float32)  # noqa: E731
    return {
        "q": act(b, s, R, g, N), "k": act(b, s, R, g, N), "v": act(b, s, h, P), "z": act(b, s, h, P),
        "q_bias": f32(h, R, N), "k_bias": f32(h, R, N), "mimo_v": f32(h, R, P), "mimo_o": f32(h, R, P), "mimo_z": f32(h, R, P),
        "D": f32(h), "angles": f32(b, s, h, N // 4),
        "dA_cs": f32(b, h, s), "dA_cs_rev": f32(b, h, s), "dt": f32(b, h, s), "trap": f32(b, h, s),
        "segsum": f32(b, h, nchunks if nchunks is not None else s // CHUNK, CHUNK, CHUNK),
        "chunk_size": CHUNK, "rotary_dim_divisor": 4, "dtype": torch.bfloat16,
    }


def forward(entry: Callable, b: int, s: int, h: int, g: int, nchunks: int | None = None, **kwargs: Any) -> tuple:
    return entry(**inputs(b, s, h, g, nchunks), **kwargs)


def backward(entry: Callable, b: int, s: int, h: int, g: int, nchunks: int | None = None, **kwargs: Any) -> tuple:
    return entry(dout=torch.zeros(b, s, h, P, dtype=torch.bfloat16), **inputs(b, s, h, g, nchunks), **kwargs)


@pytest.fixture
def triton_epilogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernels after the TileLang ones in the backward (GPU only) return zeros of their output shapes."""
    for module in (mamba3_mimo_bwd, mamba3_mimo_bwd_varlen):
        for name in ("bwd_dtrap_ddt_triton", "bwd_dtrap_ddt_triton_varlen"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda trap, *a, **k: (torch.zeros_like(trap), torch.zeros_like(trap)))
        for name in ("bwd_dadt_fused_triton", "bwd_dadt_fused_triton_varlen"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda dssda, ssda, ddA_cs, *a, **k: torch.zeros_like(ddA_cs))


def test_forward_compiles_once_per_batch_and_sequence_length(compiler: Compiler) -> None:
    entry, factory = mamba3_mimo_fwd.mamba_mimo_forward, FACTORIES["fwd"]
    first = forward(entry, 1, 32, 4, 2)
    forward(entry, 1, 32, 4, 2)
    assert len(compiler.kernels) == 1, "the same shapes compiled twice"
    assert len(compiler.kernels[0].launches) == 2 and first[0].shape == (1, 32, 4, P)
    forward(entry, 2, 32, 4, 2)
    forward(entry, 1, 64, 4, 2)
    forward(entry, 2, 32, 4, 2)
    assert [k.shape("Q") for k in compiler.kernels] == [[1, 32, R, 2, N], [2, 32, R, 2, N], [1, 64, R, 2, N]]
    assert [len(k.launches) for k in compiler.kernels] == [2, 2, 1]
    assert "-arch=sm_90a" in str(compiler.kernels[0].target)
    assert len(cache_keys(factory)) == 3
    for key in cache_keys(factory):
        assert_plain_key(key)


def test_backward_compiles_each_kernel_once_per_shape(compiler: Compiler, triton_epilogue: None) -> None:
    entry = mamba3_mimo_bwd.mamba_mimo_bwd_combined
    grads = backward(entry, 1, 32, 4, 2)
    backward(entry, 1, 32, 4, 2)
    assert grads[0].shape == (1, 32, R, 2, N)  # per-group dq from the epilogue
    assert [len(compiler.named(n)) for n in ("mamba_mimo_bwd_fwd_kernel", "mamba_mimo_bwd_bwd_kernel")] == [1, 1]
    backward(entry, 2, 32, 4, 2)
    backward(entry, 1, 64, 4, 2)
    for name in ("mamba_mimo_bwd_fwd_kernel", "mamba_mimo_bwd_bwd_kernel"):
        kernels = compiler.named(name)
        assert [k.shape("Q") for k in kernels] == [[1, 32, R, 2, N], [2, 32, R, 2, N], [1, 64, R, 2, N]]
        assert [len(k.launches) for k in kernels] == [2, 1, 1]
    for factory in (FACTORIES["bwd_fwd"], FACTORIES["bwd_bwd"]):
        assert len(cache_keys(factory)) == 3
        for key in cache_keys(factory):
            assert_plain_key(key)


def test_varlen_compiles_once_per_batch_heads_and_groups(compiler: Compiler, triton_epilogue: None) -> None:
    # Packed sequences: S and the number of sequences NS stay dynamic, so other lengths reuse the kernel.
    for s, cu_seqlens in ((32, [0, 32]), (48, [0, 16, 48]), (64, [0, 8, 24, 40, 64])):
        nchunks = s // CHUNK + len(cu_seqlens) - 1
        cu = torch.tensor(cu_seqlens, dtype=torch.int32)
        forward(mamba3_mimo_fwd_varlen.mamba_mimo_forward_varlen, 1, s, 4, 2, cu_seqlens=cu, nchunks=nchunks)
        backward(mamba3_mimo_bwd_varlen.mamba_mimo_bwd_combined_varlen, 1, s, 4, 2, cu_seqlens=cu, nchunks=nchunks)
    one_sequence = torch.tensor([0, 32], dtype=torch.int32)
    forward(mamba3_mimo_fwd_varlen.mamba_mimo_forward_varlen, 1, 32, 8, 2, nchunks=3, cu_seqlens=one_sequence)
    for name in ("mamba_mimo_fwd_kernel", "mamba_mimo_bwd_fwd_kernel", "mamba_mimo_bwd_bwd_kernel"):
        kernels = compiler.named(name)
        assert kernels[0].shape("Q") == [1, "S", R, 2, N]
        assert [len(k.launches) for k in kernels] == ([3, 1] if name == "mamba_mimo_fwd_kernel" else [3])
    assert compiler.named("mamba_mimo_fwd_kernel")[1].shape("V") == [1, "S", 8, P]
    for name in ("fwd_varlen", "bwd_fwd_varlen", "bwd_bwd_varlen"):
        for key in cache_keys(FACTORIES[name]):
            assert_plain_key(key)


PINNED_ENTRIES = [
    ("mamba_mimo_forward", "mamba_ssm/ops/tilelang/mamba3/mamba3_mimo_fwd.py"),
    ("mamba_mimo_bwd_combined", "mamba_ssm/ops/tilelang/mamba3/mamba3_mimo_bwd.py"),
]


@pytest.mark.parametrize("entry, path", PINNED_ENTRIES)
def test_pinned_release_compiles_on_every_call(pinned_release, compiler: Compiler, triton_epilogue: None, entry: str, path: str) -> None:
    # The bug: the release's call sites build with fresh T.dynamic symbols, so the same shapes compile again.
    # (One group: the release's backward epilogue supports only ngroups 1 or nheads; patch 0005 lifts that.)
    module = mamba3_mimo_fwd if entry == "mamba_mimo_forward" else mamba3_mimo_bwd
    pinned = pinned_release.definition(module, path, entry)
    run = forward if entry == "mamba_mimo_forward" else backward
    run(pinned, 1, 32, 4, 1)
    run(pinned, 1, 32, 4, 1)
    kernels_per_call = 1 if entry == "mamba_mimo_forward" else 2
    assert len(compiler.kernels) == 2 * kernels_per_call
    assert compiler.kernels[0].shape("Q") == ["B", "S", R, "G", N]
