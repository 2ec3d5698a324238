"""The MoE experts' activation and router-prob scale in one Triton pass each way, beside its eager reference.

Why: between the two grouped GEMMs, Megatron's ``MLP`` (and ``grouped_mlp``) runs ``F.gelu`` on the fc1 output,
multiplies by the router probs, which are fp32, and casts back: three passes over a [T*topk, F] tensor, one of them
an fp32 copy twice its size, and as many again in the backward. ``scaled_gelu`` reads the fc1 output once and
writes the scaled activation once; its backward reads the incoming gradient and the fc1 output once and writes the
fc1 output's gradient and the probs' gradient.

Contract (both implementations):

- ``h``: [N, F] bf16, fp16 or fp32, the fc1 output; ``scale``: [N] floating (Megatron's probs: fp32).
- Output [N, F] in h's dtype: ``(F.gelu(h) * scale[:, None]).to(h.dtype)``, the exact (erf) GELU.
- The rounding steps are the eager expression's: GELU computed in fp32 and rounded to h's dtype, then multiplied by
  the scale in the promoted dtype and rounded again; in the backward the activation's gradient is rounded to h's
  dtype before GELU's derivative, as autograd does. GELU's erf is CUDA's libdevice ``erff``, which differs from
  torch's CUDA ``erf`` in the last fp32 bits, so about 1 % of bf16 outputs (0.4 % of h's gradients) land one bf16
  step away from torch's, most of them in the far negative tail where ``1 + erf`` cancels. The scale's gradient is
  an fp32 row sum (its order differs from torch's reduction by fp32 rounding).
- The Triton kernels need CUDA tensors, or Triton's CPU interpreter (TRITON_INTERPRET=1); anything else raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nam56r_kernels.triton_support import require_cuda_or_interpreter

__all__ = ["scaled_gelu", "scaled_gelu_reference"]

# 8 rows x 128 columns a step: 128 divides the expert FFN of 896 (no masked lanes), and of the tiles swept on an H200 at
# 131072 x 896 it is the fastest both ways (190 and 272 us against 221 and 312 us at 8 x 256), with bit-equal results.
_BLOCK_ROWS = 8
_BLOCK_COLS = 128
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


def scaled_gelu_reference(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(F.gelu(h) * scale[:, None]).to(h.dtype)``: what Megatron's MLP computes with ``per_token_scale``."""
    _check(h, scale)
    return (F.gelu(h) * scale.unsqueeze(-1)).to(h.dtype)


def scaled_gelu(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference's result and gradients (in h and scale) from one Triton pass each way."""
    _check(h, scale)
    require_cuda_or_interpreter(h, "nam56r_kernels.expert_activation.scaled_gelu", "scaled_gelu_reference")
    return _ScaledGelu.apply(h, scale)


def _check(h: torch.Tensor, scale: torch.Tensor) -> None:
    if h.dim() != 2:
        raise ValueError(f"h must be [N, F], got shape {tuple(h.shape)}")
    if tuple(scale.shape) != (h.shape[0],):
        raise ValueError(f"scale must be [N] = [{h.shape[0]}] for h {tuple(h.shape)}, got shape {tuple(scale.shape)}")
    if not (h.is_floating_point() and scale.is_floating_point()):
        raise ValueError(f"h and scale must be floating, got {h.dtype} and {scale.dtype}")
    if h.device != scale.device:
        raise ValueError(f"h and scale must share a device, got {h.device} and {scale.device}")


def _grid(rows: int) -> tuple[int]:
    return (triton.cdiv(rows, _BLOCK_ROWS),)


class _ScaledGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h, scale = h.contiguous(), scale.contiguous()
        out = torch.empty_like(h)
        # The product's dtype: h's and the scale's promoted, as the eager multiply's.
        product_fp32 = torch.promote_types(h.dtype, scale.dtype) == torch.float32
        if h.numel():
            _scaled_gelu_fwd[_grid(h.shape[0])](h, scale, out, h.shape[0], h.shape[1], PRODUCT_FP32=product_fp32,
                                                 BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS)
        ctx.save_for_backward(h, scale)
        ctx.product_fp32 = product_fp32
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, scale = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h = torch.empty_like(h)
        grad_scale = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        if h.numel():
            _scaled_gelu_bwd[_grid(h.shape[0])](grad, h, scale, grad_h, grad_scale, h.shape[0], h.shape[1],
                                                 PRODUCT_FP32=ctx.product_fp32, BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS)
        else:
            grad_scale.zero_()
        return grad_h, grad_scale.to(scale.dtype)


@triton.jit
def _gelu(h):
    return h * 0.5 * (1.0 + tl.math.erf(h * _INV_SQRT2))


@triton.jit
def _row_block(scale_ptr, n_rows, n_cols, dtype: tl.constexpr, PRODUCT_FP32: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """This program's rows: (their indices, which are in range, their scale as the product sees it, their offsets)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_in = rows < n_rows
    scale = tl.load(scale_ptr + rows, mask=row_in, other=0.0).to(tl.float32)
    if not PRODUCT_FP32:
        scale = scale.to(dtype).to(tl.float32)
    return rows, row_in, scale, rows.to(tl.int64)[:, None] * n_cols


@triton.jit
def _scaled_gelu_fwd(h_ptr, scale_ptr, out_ptr, n_rows, n_cols, PRODUCT_FP32: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     BLOCK_COLS: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    rows, row_in, scale, base = _row_block(scale_ptr, n_rows, n_cols, dtype, PRODUCT_FP32, BLOCK_ROWS)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        mask = row_in[:, None] & (cols < n_cols)[None, :]
        h = tl.load(h_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        act = _gelu(h).to(dtype).to(tl.float32)  # F.gelu's output, in h's dtype
        tl.store(out_ptr + base + cols[None, :], (act * scale[:, None]).to(dtype), mask=mask)


@triton.jit
def _scaled_gelu_bwd(grad_ptr, h_ptr, scale_ptr, grad_h_ptr, grad_scale_ptr, n_rows, n_cols, PRODUCT_FP32: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    dtype = grad_h_ptr.dtype.element_ty
    rows, row_in, scale, base = _row_block(scale_ptr, n_rows, n_cols, dtype, PRODUCT_FP32, BLOCK_ROWS)
    grad_scale = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS)
        mask = row_in[:, None] & (cols < n_cols)[None, :]
        grad = tl.load(grad_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        cdf = 0.5 * (1.0 + tl.math.erf(h * _INV_SQRT2))
        act = (h * cdf).to(dtype).to(tl.float32)
        grad_scale += tl.sum(grad * act, axis=1)
        grad_act = (grad * scale[:, None]).to(dtype).to(tl.float32)  # autograd rounds it to the activation's dtype
        slope = cdf + h * tl.exp(-0.5 * h * h) * _INV_SQRT_2PI
        tl.store(grad_h_ptr + base + cols[None, :], (grad_act * slope).to(dtype), mask=mask)
    tl.store(grad_scale_ptr + rows, grad_scale, mask=row_in)
