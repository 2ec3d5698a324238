"""CPU stand-ins for the GPU-only kernels inside NAM56R's layers, for counting saved activations on a CPU.

Each stand-in replaces a kernel *call* (TileLang, or a Triton launch Triton's CPU interpreter cannot run) with torch
code returning tensors of the kernel's output shapes and dtypes. The autograd Functions around them are the real
ones, so what they pass to `save_for_backward` is what the GPU path saves:

- Mamba-3 MIMO (`mamba_ssm.ops.tilelang.mamba3.mamba3_mimo._Mamba3Function`): the TileLang forward
  (`mamba_mimo_forward`) and the autotuned Triton `angle_dt_fwd` / `compute_dacs_segsum_triton` it calls. The
  Function saves its contiguous Q, K, V, ADT, DT, Trap, Angles, Angles_Cumsum, Z and the small parameters; the
  segment sums are recomputed in its backward, so their stand-in returns nothing.
- DSA sparse MLA (Megatron's `SparseMLA`): the TileLang `sparse_mla_fwd_interface`. SparseMLA saves q, kv, indices
  and the valid-head mask; its output and log-sum-exp are recomputed in backward.
- The fused DSA indexer (`nam56r.model.dsa_fused_indexer`, "fused-tilelang-loss"): the fused top-k (no gradients),
  and Megatron's TileLang target and KL kernels. `_SelectedIndexScores` (q, k, fp32 weights, indices per sequence)
  and `SparseIndexerKLLoss` (the fp32 [sq, topk] logits gradient) are real.

Two torch ops differ between CPU and CUDA in what they save: MLA's `scaled_dot_product_attention` (CUDA: a fused
kernel saving q, k, v, output and an fp32 log-sum-exp; CPU: the math path, saving the [b, heads, s, s] weights)
and `rms_norm` (CUDA: `_fused_rms_norm`, saving the input and an fp32 rstd; CPU: fp32 decomposed ops). Both are
replaced by Functions saving what the CUDA kernels save.

The nam56r_kernels Triton kernels (fused residual norm, expert activation, router gating, routing) and mamba_ssm's
gated RMSNorm run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), which needs
`torch.cuda.device` to accept a CPU tensor's device index (None).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any
from unittest import mock

import torch

# The ops the stand-ins replace, called inside them for their values.
_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
_TORCH_RMS_NORM = torch.nn.functional.rms_norm


class _FlashAttention(torch.autograd.Function):
    """torch's CUDA SDPA (flash / memory-efficient / cuDNN) saves q, k, v, its output and an fp32 log-sum-exp
    [b, heads, s]; on CPU, MLA's unequal q/v head dims take the math path, which saves the [b, heads, s, s] weights."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        with torch.no_grad():
            out = _TORCH_SDPA(q, k, v, is_causal=True, scale=scale)
        lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        raise NotImplementedError("a stand-in for counting saved tensors; it has no backward")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None, **kwargs: Any) -> torch.Tensor:
    if attn_mask is not None or not is_causal:
        raise NotImplementedError("the SDPA stand-in covers MLA's causal call only")
    return _FlashAttention.apply(q, k, v, scale)


class _FusedRMSNorm(torch.autograd.Function):
    """torch's CUDA rms_norm (`_fused_rms_norm`) saves its input and an fp32 rstd per row; on CPU it decomposes
    into fp32 ops that save fp32 copies."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: list[int], weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
        with torch.no_grad():
            out = _TORCH_RMS_NORM(x, shape, weight, eps)
            rstd = torch.zeros(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        raise NotImplementedError("a stand-in for counting saved tensors; it has no backward")


def _rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    return _FusedRMSNorm.apply(x, list(normalized_shape), weight, eps)


def _mimo_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, dtype: torch.dtype | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None, None]:
    # The kernel's output is V-shaped [b, s, heads, head_dim] in the model dtype (MIMO_Out reduces the rank axis).
    return torch.zeros_like(v, dtype=dtype or v.dtype), None, None


def _angle_dt_fwd(angle: torch.Tensor, dt: torch.Tensor, chunk_size: int | None = None, return_output_state: bool = False,
                  cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    cumsum = torch.cumsum(angle * dt.transpose(1, 2).unsqueeze(-1), dim=1)  # [b, s, heads, angles] fp32, as the kernel's
    return cumsum, cumsum[:, -1].clone()


def _segsum(adt: torch.Tensor, chunk_size: int, **kwargs: Any) -> tuple[None, None, None]:
    return None, None, None


def _sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float | None = None,
                    d_v: int = 512, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(*q.shape[:-1], d_v, dtype=q.dtype, device=q.device)  # [b, s, heads, d_v]
    return out, torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)  # lse [b, s, heads]


def _index_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *, use_relu: bool,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal top-k of the index scores in plain torch: fp32 scores and int32 indices [b, sq, min(topk, sk)]."""
    sq, sk = q.shape[0], k.shape[0]
    per_head = torch.einsum("sbhd,tbd->bsht", q.float(), k.float())
    scores = ((per_head.relu() if use_relu else per_head) * weights.transpose(0, 1).float().unsqueeze(-1)).sum(2)
    future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    values, indices = scores.topk(min(topk, sk), dim=-1)
    return values, indices.masked_fill(values.isinf(), -1).to(torch.int32)


def _indexer_target(query: torch.Tensor, key: torch.Tensor, indices: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    return torch.zeros(indices.shape, dtype=torch.float32, device=query.device)


def _indexer_kl(target: torch.Tensor, index_logits: torch.Tensor, valid_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((), dtype=torch.float32, device=target.device), torch.zeros_like(index_logits, dtype=torch.float32)


@contextmanager
def gpu_kernel_stand_ins() -> Iterator[None]:
    """The stand-ins above in place of the GPU kernels (the module docstring), and `torch.cuda.device` a no-op."""
    from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo
    from megatron.core.transformer.experimental_attention_variant.ops import sparse_mla, tilelang_indexer_loss

    from nam56r.model import dsa_fused_indexer

    patches = [
        mock.patch.object(torch.cuda, "device", lambda index=None: nullcontext()),
        mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _sdpa),
        mock.patch.object(torch.nn.functional, "rms_norm", _rms_norm),
        mock.patch.object(mamba3_mimo, "mamba_mimo_forward", _mimo_forward),
        mock.patch.object(mamba3_mimo, "angle_dt_fwd", _angle_dt_fwd),
        mock.patch.object(mamba3_mimo, "compute_dacs_segsum_triton", _segsum),
        mock.patch.object(sparse_mla, "sparse_mla_fwd_interface", _sparse_mla_fwd),
        mock.patch.object(dsa_fused_indexer, "index_topk_fused", _index_topk),
        mock.patch.object(dsa_fused_indexer, "tilelang_kernel_problems", lambda *args: []),
        mock.patch.object(tilelang_indexer_loss, "sparse_indexer_target_interface", _indexer_target),
        mock.patch.object(tilelang_indexer_loss, "sparse_indexer_kl_interface", _indexer_kl),
    ]
    with ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield
