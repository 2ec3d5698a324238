"""Grouped-GEMM MoE expert MLP in pure PyTorch (``torch.nn.functional.grouped_mm``), beside its per-expert loop.

Why: Megatron's local backend runs MoE experts as ``SequentialMLP``, a Python loop of two small GEMMs per
expert, and its grouped-GEMM experts need TransformerEngine. ``grouped_mm`` runs all experts' GEMMs as one
call per projection, with autograd, on CUDA and on CPU.

Contract (both implementations):

- ``x``: [T, H] floating, tokens already permuted so each expert's tokens are contiguous, expert 0 first.
- ``fc1_weight``: [E, F, H], ``fc2_weight``: [E, H, F] (nn.Linear's out x in layout, one slice per expert).
- ``tokens_per_expert``: integer [E], non-negative, summing to T (zero-token experts are fine). Any device.
- ``activation``: an elementwise callable (e.g. ``F.gelu``), applied to the fc1 output.
- ``per_token_scale``: optional [T] (router probs), multiplied into the activation output before fc2 and the
  product cast back to the activation's dtype, exactly as Megatron's ``MLP`` applies ``per_token_scale``.
- x and both weights share one dtype and one device. Output: [T, H] in that dtype, for expert e's rows::

      out[rows_e] = (activation(x[rows_e] @ fc1_weight[e].T) * scale[rows_e, None]) @ fc2_weight[e].T

``grouped_mm`` needs every stride a multiple of 16 bytes, so H and F must be multiples of 16 / itemsize
(8 for bf16/fp16, 4 for fp32); the fused op raises otherwise rather than pad silently. Rows past the last
offset would be left uninitialised by ``grouped_mm``, so the fused op checks ``sum(tokens_per_expert) == T``
when ``tokens_per_expert`` is on the CPU (Megatron's dispatchers keep it there); on an accelerator the check
would cost a host sync per call, so it is the caller's contract.

CPU support (torch 2.13): bf16, fp16 and fp32, forward and backward. Its backward fails on a zero-stride
(expanded) grad_output, e.g. from ``out.sum().backward()`` ("Invalid strides/sizes, got [0, 0]"), so the
fused op passes its output through ``_ContiguousGrad``, which makes the incoming gradient contiguous.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nam56r_kernels.expert_activation import scaled_gelu

__all__ = ["grouped_mlp", "grouped_mlp_reference"]

_STRIDE_ALIGN_BYTES = 16


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (grouped_mm's CPU backward rejects zero strides)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _check_inputs(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    per_token_scale: torch.Tensor | None,
) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if fc1_weight.dim() != 3:
        raise ValueError(f"fc1_weight must be [E, F, H], got shape {tuple(fc1_weight.shape)}")
    num_tokens, hidden = x.shape
    num_experts, ffn, fc1_in = fc1_weight.shape
    if fc1_in != hidden:
        raise ValueError(f"fc1_weight {tuple(fc1_weight.shape)} must be [E, F, H] with H = x's {hidden} (x {tuple(x.shape)})")
    if tuple(fc2_weight.shape) != (num_experts, hidden, ffn):
        raise ValueError(
            f"fc2_weight must be [E, H, F] = {(num_experts, hidden, ffn)} to match fc1_weight {tuple(fc1_weight.shape)} "
            f"and x {tuple(x.shape)}, got {tuple(fc2_weight.shape)}"
        )
    if tuple(tokens_per_expert.shape) != (num_experts,):
        raise ValueError(f"tokens_per_expert must be [E] = [{num_experts}], got shape {tuple(tokens_per_expert.shape)}")
    if tokens_per_expert.is_floating_point() or tokens_per_expert.is_complex():
        raise ValueError(f"tokens_per_expert must be an integer tensor, got {tokens_per_expert.dtype}")
    if per_token_scale is not None and tuple(per_token_scale.shape) != (num_tokens,):
        raise ValueError(f"per_token_scale must be [T] = [{num_tokens}], got shape {tuple(per_token_scale.shape)}")
    if not (x.dtype == fc1_weight.dtype == fc2_weight.dtype):
        raise ValueError(f"x, fc1_weight and fc2_weight must share a dtype, got {x.dtype}, {fc1_weight.dtype}, {fc2_weight.dtype}")
    if not (x.device == fc1_weight.device == fc2_weight.device):
        raise ValueError(f"x, fc1_weight and fc2_weight must share a device, got {x.device}, {fc1_weight.device}, {fc2_weight.device}")
    if tokens_per_expert.device.type == "cpu":
        if bool((tokens_per_expert < 0).any()):
            raise ValueError(f"tokens_per_expert must be non-negative, got {tokens_per_expert.tolist()}")
        total = int(tokens_per_expert.sum())
        if total != num_tokens:
            raise ValueError(f"tokens_per_expert sums to {total} but x has T = {num_tokens} rows ({tokens_per_expert.tolist()})")


def grouped_mlp(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    per_token_scale: torch.Tensor | None = None,
    fused_activation: bool = False,
) -> torch.Tensor:
    """All experts' MLPs with two ``grouped_mm`` calls; differentiable in x, both weights and the scale.

    Shapes, dtypes and devices as in the module docstring; raises ValueError naming the offending shape.
    ``fused_activation``: the activation and the scale in one Triton pass each way
    (``nam56r_kernels.expert_activation.scaled_gelu``, the same rounding steps); needs ``F.gelu`` and a scale.
    """
    _check_inputs(x, fc1_weight, fc2_weight, tokens_per_expert, per_token_scale)
    if fused_activation and (activation is not F.gelu or per_token_scale is None):
        raise ValueError(f"fused_activation needs activation F.gelu and a per_token_scale, got {activation!r} and "
                         f"{'a scale' if per_token_scale is not None else 'no scale'}; use fused_activation=False")
    hidden, ffn = x.shape[1], fc1_weight.shape[1]
    align = _STRIDE_ALIGN_BYTES // x.element_size()
    if hidden % align or ffn % align:
        raise ValueError(
            f"grouped_mm needs 16-byte aligned strides: H = {hidden} and F = {ffn} must be multiples of {align} "
            f"for {x.dtype}; use grouped_mlp_reference for these sizes"
        )
    offs = torch.cumsum(tokens_per_expert.to(device=x.device), dim=0, dtype=torch.int32)
    # grouped_mm's 2d x 3d form takes the second operand as [E, K, N]: the weights' [E, out, in] transposed.
    intermediate = F.grouped_mm(x, fc1_weight.transpose(1, 2), offs=offs)
    if fused_activation:
        intermediate = scaled_gelu(intermediate, per_token_scale)
    else:
        intermediate = activation(_ContiguousGrad.apply(intermediate))
        if per_token_scale is not None:
            intermediate = (intermediate * per_token_scale.unsqueeze(-1)).to(intermediate.dtype)
    out = F.grouped_mm(intermediate, fc2_weight.transpose(1, 2), offs=offs)
    return _ContiguousGrad.apply(out)


def grouped_mlp_reference(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    per_token_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same contract as ``grouped_mlp``, one expert at a time with ``torch.matmul`` (no alignment needs)."""
    _check_inputs(x, fc1_weight, fc2_weight, tokens_per_expert, per_token_scale)
    counts = [int(n) for n in tokens_per_expert.tolist()]
    if any(n < 0 for n in counts) or sum(counts) != x.shape[0]:
        raise ValueError(f"tokens_per_expert {counts} must be non-negative and sum to T = {x.shape[0]}")
    scales = torch.split(per_token_scale, counts) if per_token_scale is not None else [None] * len(counts)
    outputs = []
    for expert, (tokens, scale) in enumerate(zip(torch.split(x, counts), scales, strict=True)):
        intermediate = activation(torch.matmul(tokens, fc1_weight[expert].t()))
        if scale is not None:
            intermediate = (intermediate * scale.unsqueeze(-1)).to(intermediate.dtype)
        outputs.append(torch.matmul(intermediate, fc2_weight[expert].t()))
    return torch.cat(outputs, dim=0)
