"""Output layer + per-token cross-entropy without the [N, V] logits: a PyTorch reference and a chunked path.

Why: at NAM56R's vocabulary (131072) the LM head's logits for 32k tokens are 8 GiB in bf16 and 16 GiB once
cross-entropy upcasts them; the LM head and both MTP depths each build them. The chunked path runs a chunk
of tokens at a time through three cuBLAS GEMMs (logits, input gradient, weight gradient) and one Triton
kernel that turns the chunk's logits into its loss and, in place, its logit gradient, so the only large
buffer is one chunk of logits. It computes the gradients in the forward (three GEMMs, not the four a
backward recompute costs), which fixes their per-token weights at forward time: the caller passes them.

Contract (both implementations):

- ``hidden``: [N, H] floating, ``weight``: [V, H] same dtype and device, ``labels``: integer [N] in
  [0, V) or ``ignore_index``.
- Returns the fp32 [N] loss ``logsumexp(logits[i]) - logits[i, labels[i]]`` with ``logits = hidden @
  weight.T`` computed in the inputs' dtype with fp32 accumulation (cuBLAS) and the softmax in fp32; 0 where
  ``labels[i] == ignore_index``, as ``F.cross_entropy(..., reduction="none")`` gives. The chunked path
  also returns int64 [N] predictions: the index of a largest logit of each token (for accuracy metrics).
- ``linear_cross_entropy`` takes ``loss_weight`` [N] (None: 1 for every token): the gradient arriving at
  the loss in backward must be ``c * loss_weight`` for one scalar c, as Megatron's masked loss sums give
  (``loss_mask`` times a global scale). Anything else fails an on-device assertion instead of returning
  wrong gradients. The weight gradient is accumulated over chunks in the weight's dtype.
- The chunked path needs CUDA tensors, or Triton's CPU interpreter (``TRITON_INTERPRET=1``) in tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nam56r_kernels.triton_support import require_cuda_or_interpreter

__all__ = ["LinearCrossEntropy", "linear_cross_entropy", "linear_cross_entropy_reference"]

# One chunk of logits at most this many bytes: 512 MiB is 2048 tokens at V = 131072 in bf16.
CHUNK_BYTES = 512 << 20
_ROW_BLOCK = 4096
# Relative slack of the backward's check that the incoming gradient is c * loss_weight (bf16 scales).
_GRADIENT_SHAPE_RTOL = 1e-2


class LinearCrossEntropy(NamedTuple):
    loss: torch.Tensor  # fp32 [N], differentiable
    predictions: torch.Tensor  # int64 [N], an argmax of each token's logits


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """fp32 [N] loss from the materialized logits (the output layer, then fp32 cross-entropy)."""
    _check_inputs(hidden, weight, labels)
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels.long(), reduction="none", ignore_index=ignore_index)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_weight: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    chunk_bytes: int = CHUNK_BYTES,
) -> LinearCrossEntropy:
    """The same loss as ``linear_cross_entropy_reference``, a chunk of tokens at a time, and each token's
    argmax (module docstring)."""
    _check_inputs(hidden, weight, labels)
    require_cuda_or_interpreter(hidden, "linear_cross_entropy", "linear_cross_entropy_reference")
    if loss_weight is not None and (loss_weight.shape != labels.shape or loss_weight.device != labels.device):
        raise ValueError(f"loss_weight must be [N] = {tuple(labels.shape)} on {labels.device}, got "
                         f"{tuple(loss_weight.shape)} on {loss_weight.device}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    # Function.apply reports needs_input_grad from requires_grad even under no_grad: evaluation would pay the two
    # gradient GEMMs per chunk and hold the gradient buffers for nothing.
    gradients = torch.is_grad_enabled()
    return LinearCrossEntropy(*_LinearCrossEntropy.apply(hidden, weight, labels, loss_weight, ignore_index, chunk_bytes,
                                                         gradients))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_weight, ignore_index, chunk_bytes, gradients):
        tokens, vocab = hidden.shape[0], weight.shape[0]
        kept = labels != ignore_index
        weights = kept.float() if loss_weight is None else loss_weight.float() * kept
        loss = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        predictions = torch.empty(tokens, dtype=torch.int64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if gradients and ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if gradients and ctx.needs_input_grad[1] else None
        chunk = max(1, min(tokens, chunk_bytes // (vocab * hidden.element_size())))
        logits = torch.empty(chunk, vocab, dtype=hidden.dtype, device=hidden.device)
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            x = hidden[rows]
            block = logits[: x.shape[0]]
            torch.matmul(x, weight.t(), out=block)
            _cross_entropy_rows_kernel[(x.shape[0],)](
                block, labels[rows], weights[rows], loss[rows], predictions[rows], vocab, block.stride(0), ignore_index,
                BLOCK=_ROW_BLOCK, num_warps=8,
            )
            if grad_hidden is not None:
                torch.matmul(block, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(block.t(), x)
        ctx.save_for_backward(grad_hidden, grad_weight, weights, kept)
        ctx.mark_non_differentiable(predictions)
        ctx.backward_ran = False
        return loss, predictions

    @staticmethod
    def backward(ctx, grad_loss, _grad_predictions):
        if ctx.backward_ran:
            raise RuntimeError("linear_cross_entropy's backward runs once: it scales the gradients it computed in forward "
                               "in place (backward with retain_graph=True a second time is not supported)")
        ctx.backward_ran = True
        grad_hidden, grad_weight, weights, kept = ctx.saved_tensors
        scale = _gradient_scale(grad_loss.float(), weights, kept)
        # In place: these buffers are this call's own, and a scaled copy would double the weight gradient's memory.
        return (
            None if grad_hidden is None else grad_hidden.mul_(scale.to(grad_hidden.dtype)),
            None if grad_weight is None else grad_weight.mul_(scale.to(grad_weight.dtype)),
            None, None, None, None, None,
        )


def _gradient_scale(grad_loss: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The scalar c with grad_loss = c * weights on the kept tokens (least squares; an ignored token's loss is
    the constant 0, so its gradient is moot), asserted on the device without a host sync."""
    norm = (weights * weights).sum()
    scale = (grad_loss * weights).sum() / norm.clamp_min(torch.finfo(torch.float32).tiny)
    deviation = torch.where(kept, (grad_loss - scale * weights).abs(), 0.0).max()
    torch._assert_async(
        deviation <= _GRADIENT_SHAPE_RTOL * scale.abs() + torch.finfo(torch.float32).tiny,
        "linear_cross_entropy folds loss_weight into its gradients in forward: the loss's gradient must be "
        "c * loss_weight for one scalar c (pass the loss mask as loss_weight)",
    )
    return scale


@triton.jit
def _cross_entropy_rows_kernel(logits_ptr, labels_ptr, weights_ptr, loss_ptr, predictions_ptr, vocab, stride_row,
                               ignore_index, BLOCK: tl.constexpr):
    """One token: its loss and argmax from its logits row, then the row overwritten by weight * (softmax - onehot)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    # Online max / sum of exponentials per lane; a finite floor keeps masked lanes from making 0 * inf.
    running_max = tl.full((BLOCK,), -1e30, tl.float32)
    running_sum = tl.zeros((BLOCK,), tl.float32)
    running_argmax = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        running_argmax = tl.where(x > running_max, start + cols, running_argmax)
        new_max = tl.maximum(running_max, x)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.exp(x - new_max)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    lse = row_max + tl.log(tl.sum(running_sum * tl.exp(running_max - row_max), axis=0))
    best_lane = tl.argmax(running_max, axis=0)
    tl.store(predictions_ptr + row, tl.sum(tl.where(cols == best_lane, running_argmax, 0), axis=0))
    label = tl.load(labels_ptr + row).to(tl.int64)
    ignored = label == ignore_index
    target = tl.load(base + tl.where(ignored, 0, label)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - target))
    weight = tl.where(ignored, 0.0, tl.load(weights_ptr + row))
    for start in range(0, vocab, BLOCK):
        offsets = start + cols
        in_row = offsets < vocab
        x = tl.load(base + offsets, mask=in_row, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(offsets == label, 1.0, 0.0)
        tl.store(base + offsets, (grad * weight).to(logits_ptr.dtype.element_ty), mask=in_row)


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    if hidden.ndim != 2 or weight.ndim != 2 or labels.ndim != 1:
        raise ValueError(f"expected hidden [N, H], weight [V, H], labels [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)}")
    if weight.shape[1] != hidden.shape[1] or labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"shapes disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} (must be [V, "
                         f"{hidden.shape[1]}]), labels {tuple(labels.shape)} (must be [{hidden.shape[0]}])")
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share a floating dtype, got {hidden.dtype} and {weight.dtype}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")
    if weight.device != hidden.device or labels.device != hidden.device:
        raise ValueError(f"hidden, weight and labels must share a device, got {hidden.device}, {weight.device}, "
                         f"{labels.device}")
