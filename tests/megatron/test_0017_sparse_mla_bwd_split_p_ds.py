"""Patch megatron-lm 0017: the TileLang sparse MLA backward hands P and dP to its dQ/dKV GEMMs as
bf16 hi+lo pairs. The kernel cannot run on CPU; here the split's arithmetic is checked in torch, and
the real kernel is lowered for Hopper (sm_90) to read its shared memory per CTA, patched and as pinned.
The GPU reproducer (patches/packs/22-sparse-mla-bwd-p-ds-precision/repro.py) measures the gradients."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from nam56r.model.presets import nam56r

tilelang = pytest.importorskip("tilelang")
sparse_mla_bwd = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.ops.tilelang_sparse_mla_bwd")

BWD_PATH = "megatron/core/transformer/experimental_attention_variant/ops/tilelang_sparse_mla_bwd.py"
HOPPER = "cuda -arch=sm_90"
HOPPER_SMEM_PER_BLOCK = 227 * 1024
BLOCK_SIZE = 32  # the kernel's top-k block (BS)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().to(x.dtype)


def _gemm_error(operand: torch.Tensor, exact_operand: torch.Tensor, other: torch.Tensor) -> float:
    """Relative L2 error of operand^T @ other (a dKV-style GEMM, float64 accumulation) against exact_operand's."""
    exact = exact_operand.double().T @ other.double()
    return ((operand.double().T @ other.double() - exact).norm() / exact.norm()).item()


def test_hi_lo_pair_carries_an_fp32_operand_to_16_bits() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(4 * torch.randn(64, 256, generator=gen), dim=-1)  # P: (0, 1], rows sum to 1
    ds = p * torch.randn(64, 256, generator=gen)  # dS: both signs
    d_out = _bf16(torch.randn(64, 64, generator=gen))
    for x in (p, ds):
        hi = _bf16(x)
        lo = _bf16(x - hi)
        assert ((hi + lo - x).abs() <= 2.0**-16 * x.abs()).all()
        assert _gemm_error(hi + lo, x, d_out) < 1e-5 < 1e-4 < _gemm_error(hi, x, d_out)


def _shared_memory_bytes(bwd_factory, heads: int, dim: int, tail: int, topk: int) -> int:
    """Dynamic shared memory per CTA of the backward kernel, lowered for Hopper without a GPU."""
    tir = bwd_factory.get_tir(heads, dim, tail, topk, 1, None, max_block_h=32)
    with tilelang.tvm.transform.PassContext(config=bwd_factory.pass_configs), tilelang.tvm.target.Target(HOPPER):
        artifact = tilelang.lower(tir, target=HOPPER)
    (kernel,) = artifact.device_mod.functions.values()
    return int(kernel.attrs["dyn_shared_memory_buf"])


def _pinned_module(pinned_release, tmp_path: Path) -> ModuleType:
    """The pinned release's module, from a file beside the patched one's package: TileLang's parser
    reads a kernel's source through inspect, so the definition must come from a file on disk."""
    path = tmp_path / "tilelang_sparse_mla_bwd_pinned.py"
    path.write_text(pinned_release.source(BWD_PATH))
    spec = importlib.util.spec_from_file_location(f"{sparse_mla_bwd.__package__}.tilelang_sparse_mla_bwd_pinned", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_split_adds_two_bf16_tiles_of_shared_memory_at_nam56r_shape(pinned_release, tmp_path: Path) -> None:
    config = nam56r()
    mla = config.mla
    shape = (mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, config.dsa.topk)
    patched = _shared_memory_bytes(sparse_mla_bwd.bwd, *shape)
    pinned = _shared_memory_bytes(_pinned_module(pinned_release, tmp_path).bwd, *shape)
    block_h = min(32, max(mla.num_heads, 16))
    assert patched - pinned == 2 * block_h * BLOCK_SIZE * 2  # P_lo and dP_lo, bf16
    assert patched <= HOPPER_SMEM_PER_BLOCK


def test_deepseek_v32_head_still_fits_hopper() -> None:
    """The largest head the kernel is used at: 128 heads, 512 value + 64 rope, top-k 2048."""
    assert _shared_memory_bytes(sparse_mla_bwd.bwd, 128, 512, 64, 2048) <= HOPPER_SMEM_PER_BLOCK
