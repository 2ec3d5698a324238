"""RMSNorm of a transformer layer's input whose backward also sums the residual branch's gradient, beside its reference.

Why: a pre-norm transformer layer reads its input twice, through the norm and as the residual. Without
TransformerEngine, Megatron's norm is torch's RMSNorm, and autograd then adds the residual's gradient to the norm's
input gradient in bf16: one more pass over [T, H] after the norm's backward, which itself runs as two kernels (the
input's gradient, then the weight's in a separate column reduction). Here the backward is one pass over the rows that
writes the input's gradient with the residual's already in it, rounded once, and each program's fp32 share of the
weight's gradient, which one small sum finishes.

Contract (both implementations):

- ``x``: [T, H] floating; ``weight``: [H] in x's dtype; ``eps``: float.
- ``rms_norm_residual(x, weight, eps)`` -> (``y``, ``residual``): ``y`` [T, H] in x's dtype is
  ``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32 and rounded once (torch's CUDA ``F.rms_norm``);
  ``residual`` is an alias of x for the residual branch, whose gradient the norm's backward sums into x's.
- Backward: x's gradient is the norm's input gradient plus the residual's, summed in fp32 and rounded once (autograd
  rounds the norm's, then adds the residual's in x's dtype); the weight's is an fp32 sum over the rows, in another
  order than torch's.
- The Triton kernels need CUDA tensors, or Triton's CPU interpreter (TRITON_INTERPRET=1); anything else raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nam56r_kernels.triton_support import require_cuda_or_interpreter

__all__ = ["rms_norm_residual", "rms_norm_residual_reference"]

# Programs of the backward: each walks its share of the rows and keeps an fp32 partial of the weight's gradient, so the
# partials are a few MB and their sum one small launch.
_BACKWARD_PROGRAMS = 1024


def rms_norm_residual_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch's ``F.rms_norm(x, (H,), weight, eps)``, x itself): what Megatron's local norm and residual read."""
    _check(x, weight)
    return F.rms_norm(x, (x.shape[-1],), weight, eps), x


def rms_norm_residual(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normed rows, an alias of x for the residual): one Triton pass forward, and one backward that sums the
    residual's gradient into x's (the module docstring's contract)."""
    _check(x, weight)
    require_cuda_or_interpreter(x, "nam56r_kernels.residual_rms_norm.rms_norm_residual", "rms_norm_residual_reference")
    return _RMSNormResidual.apply(x, weight, float(eps))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be floating [T, H], got {x.dtype} {tuple(x.shape)}")
    if tuple(weight.shape) != (x.shape[1],) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [H] = [{x.shape[1]}] {x.dtype} on {x.device} for x {tuple(x.shape)}, got "
                         f"{weight.dtype} {tuple(weight.shape)} on {weight.device}")


def _block(hidden: int) -> tuple[int, int]:
    """(columns a program's tile spans, its warps): one whole row at a time."""
    block = triton.next_power_of_2(hidden)
    return block, max(1, min(16, block // 512))


class _RMSNormResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x = x.contiguous()
        rows, hidden = x.shape
        y = torch.empty_like(x)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block, warps = _block(hidden)
        if rows:
            _rms_norm_fwd[(rows,)](x, weight, y, rstd, hidden, eps, BLOCK_H=block, num_warps=warps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.set_materialize_grads(False)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, grad_y, grad_residual):
        x, weight, rstd = ctx.saved_tensors
        rows, hidden = x.shape
        if grad_y is None:
            return grad_residual, None, None
        grad_y = grad_y.contiguous()
        grad_x = torch.empty_like(x)
        programs = max(1, min(rows, _BACKWARD_PROGRAMS))
        partial = torch.empty(programs, hidden, dtype=torch.float32, device=x.device)
        block, warps = _block(hidden)
        if rows:
            residual = grad_residual.contiguous() if grad_residual is not None else grad_x  # unread without RESIDUAL
            _rms_norm_bwd[(programs,)](grad_y, residual, x, weight, rstd, grad_x, partial, rows, hidden,
                                       triton.cdiv(rows, programs), RESIDUAL=grad_residual is not None, BLOCK_H=block,
                                       num_warps=warps)
        else:
            partial.zero_()
        return grad_x, partial.sum(0).to(weight.dtype), None


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, hidden, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < hidden
    at = row.to(tl.int64) * hidden + cols
    x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + at, (w * (x * rstd)).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rms_norm_bwd(grad_y_ptr, grad_res_ptr, x_ptr, w_ptr, rstd_ptr, grad_x_ptr, partial_ptr, rows, hidden, rows_per_program,
                  RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    """dx = rstd * (dy w - x rstd^2 mean(dy w x)) (+ the residual's gradient); this program's rows' dw = sum dy x rstd."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < hidden
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    grad_w = tl.zeros([BLOCK_H], dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    for step in range(rows_per_program):
        row = first + step
        live = inside & (row < rows)
        at = row * hidden + cols
        dy = tl.load(grad_y_ptr + at, mask=live, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + at, mask=live, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / hidden))
        if RESIDUAL:
            dx += tl.load(grad_res_ptr + at, mask=live, other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + at, dx.to(grad_x_ptr.dtype.element_ty), mask=live)
        grad_w += dy * xhat
    tl.store(partial_ptr + program * hidden + cols, grad_w, mask=inside)
