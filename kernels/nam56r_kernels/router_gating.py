"""The MoE router's gating GEMM with fp32 logits from bf16 operands, beside Megatron's local computation.

Why: with ``moe_router_dtype="fp32"`` and no TransformerEngine, Megatron's ``RouterGatingLinearFunction`` copies the
router input [T, H] to fp32 (twice the size of the bf16 tensor, once in the forward and once more for the weight
gradient) and runs fp32 GEMMs on CUDA cores: about 1.7 ms of a 32k-token MoE layer step on an H200. TransformerEngine's
path, which the local one stands in for, multiplies the bf16 operands with fp32 output instead. Products of bf16
values are exact in fp32, so every fp32 sum here is the local path's up to summation order.

Contract (both implementations):

- ``x``: [..., H] bf16; ``weight``: [E, H] bf16; same device.
- Output: fp32 [..., E], ``x @ weight.T`` accumulated in fp32.
- Backward (the incoming gradient is fp32 [..., E]): the input's gradient is ``grad @ weight`` in fp32, rounded to bf16
  once; the weight's gradient is ``grad.T @ x`` in fp32, summed over fixed row blocks and then across them (no atomics:
  run to run it is bit-identical), rounded to bf16 once. Megatron rounds both the same way. On the GPU the fp32
  gradient is split into three bf16 terms that sum to it exactly (8 significant bits each), so every product with a
  bf16 operand is exact and runs on the tensor cores; only the order of the fp32 sums differs from an fp32 GEMM.
- Triton on CUDA tensors, or under Triton's CPU interpreter (the CPU tests); ``router_gating_reference`` is Megatron's
  local computation. Nothing falls back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nam56r_kernels.triton_support import interpreted, require_cuda_or_interpreter

__all__ = ["router_gating", "router_gating_reference"]

_BLOCK_T = 64
_BLOCK_H = 128
# Rows each weight-gradient program sums before the cross-block sum.
_WGRAD_ROWS = 2048


def router_gating_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Megatron's local ``RouterGatingLinearFunction`` at router_dtype fp32: both operands upcast, an fp32 GEMM."""
    _check(x, weight)
    return torch.mm(x.reshape(-1, x.shape[-1]).float(), weight.float().t()).view(*x.shape[:-1], weight.shape[0])


def router_gating(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``x @ weight.T`` from bf16 operands without an fp32 copy of x (module docstring)."""
    _check(x, weight)
    require_cuda_or_interpreter(x, "nam56r_kernels.router_gating", "router_gating_reference")
    return _RouterGating.apply(x, weight)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [E, H] with H = x's last dim; got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"x and weight must be bf16, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x and weight must share a device, got {x.device} and {weight.device}")


# UPCAST: Triton's CPU interpreter multiplies 16-bit tiles as raw integers, so there every product is of exact fp32
# upcasts (the same products); on a GPU the bf16 tiles go to the tensor cores.


def _experts_block(experts: int) -> int:
    return max(16, triton.next_power_of_2(experts))  # tl.dot's smallest tile side


class _RouterGating(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows_in = x.reshape(-1, x.shape[-1]).contiguous()
        weight = weight.contiguous()
        (tokens, hidden), experts = rows_in.shape, weight.shape[0]
        logits = torch.empty(tokens, experts, dtype=torch.float32, device=x.device)
        if tokens:
            _gating_fwd[(triton.cdiv(tokens, _BLOCK_T),)](rows_in, weight, logits, tokens, hidden, experts,
                                                          BLOCK_T=_BLOCK_T, BLOCK_H=_BLOCK_H, BLOCK_E=_experts_block(experts),
                                                          UPCAST=interpreted())
        ctx.save_for_backward(rows_in, weight)
        ctx.x_shape = x.shape
        return logits.view(*x.shape[:-1], experts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows_in, weight = ctx.saved_tensors
        (tokens, hidden), experts = rows_in.shape, weight.shape[0]
        grad = grad.reshape(tokens, experts).float().contiguous()
        grad_x = torch.empty_like(rows_in)
        blocks = triton.cdiv(tokens, _WGRAD_ROWS)
        partial = torch.empty(blocks, experts, hidden, dtype=torch.float32, device=rows_in.device)
        if tokens:
            block_e = _experts_block(experts)
            _gating_dgrad[(triton.cdiv(tokens, _BLOCK_T), triton.cdiv(hidden, _BLOCK_H))](
                grad, weight, grad_x, tokens, hidden, experts, BLOCK_T=_BLOCK_T, BLOCK_H=_BLOCK_H, BLOCK_E=block_e,
                UPCAST=interpreted())
            _gating_wgrad[(blocks, triton.cdiv(hidden, _BLOCK_H))](
                grad, rows_in, partial, tokens, hidden, experts, ROWS=_WGRAD_ROWS, BLOCK_T=_BLOCK_T, BLOCK_H=_BLOCK_H,
                BLOCK_E=block_e, UPCAST=interpreted())
        grad_weight = partial.sum(dim=0).to(weight.dtype) if tokens else torch.zeros_like(weight)
        return grad_x.view(ctx.x_shape), grad_weight


@triton.jit
def _gating_fwd(x_ptr, w_ptr, out_ptr, tokens, hidden, experts, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_E: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    es = tl.arange(0, BLOCK_E)
    row_in, e_in = rows < tokens, es < experts
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        col_in = cols < hidden
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], mask=row_in[:, None] & col_in[None, :], other=0.0)
        w = tl.load(w_ptr + es[None, :] * hidden + cols[:, None], mask=e_in[None, :] & col_in[:, None], other=0.0)
        if UPCAST:  # 16-bit products are exact in fp32 either way
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * experts + es[None, :], acc, mask=row_in[:, None] & e_in[None, :])


@triton.jit
def _dot_fp32_bf16(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b for an fp32 tile a and a bf16 tile b, every product exact: a as three bf16 terms summing to it."""
    if UPCAST:
        return tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
    high = a.to(tl.bfloat16)
    rest = a - high.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    low = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(low, b, tl.dot(mid, b, tl.dot(high, b, acc)))


@triton.jit
def _gating_dgrad(g_ptr, w_ptr, gx_ptr, tokens, hidden, experts, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_E: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    es = tl.arange(0, BLOCK_E)
    row_in, col_in, e_in = rows < tokens, cols < hidden, es < experts
    g = tl.load(g_ptr + rows.to(tl.int64)[:, None] * experts + es[None, :], mask=row_in[:, None] & e_in[None, :], other=0.0)
    w = tl.load(w_ptr + es[:, None] * hidden + cols[None, :], mask=e_in[:, None] & col_in[None, :], other=0.0)
    gx = _dot_fp32_bf16(g, w, tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32), UPCAST)
    tl.store(gx_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], gx.to(gx_ptr.dtype.element_ty),
             mask=row_in[:, None] & col_in[None, :])


@triton.jit
def _gating_wgrad(g_ptr, x_ptr, partial_ptr, tokens, hidden, experts, ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, UPCAST: tl.constexpr):
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    es = tl.arange(0, BLOCK_E)
    col_in, e_in = cols < hidden, es < experts
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for start in range(block * ROWS, block * ROWS + ROWS, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        row_in = rows < tokens
        g_t = tl.load(g_ptr + rows.to(tl.int64)[None, :] * experts + es[:, None], mask=e_in[:, None] & row_in[None, :], other=0.0)
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], mask=row_in[:, None] & col_in[None, :],
                    other=0.0)
        acc = _dot_fp32_bf16(g_t, x, acc, UPCAST)
    tl.store(partial_ptr + (block * experts + es[:, None]).to(tl.int64) * hidden + cols[None, :], acc,
             mask=e_in[:, None] & col_in[None, :])
