"""Whether a kernel's per-token top-k (argmax: k = 1) of the logits ``hidden @ weight.T`` is one that a correct
kernel can select once its logits are rounded as a GEMM rounds them (fp32 accumulation, then the logits' dtype),
and a real defective launch of the chunked cross-entropy's row kernel to show that the check rejects a broken
argmax.

The bound (``selection_violations``), for inputs and logits in the normal floating-point range:

- ℓ_j = Σ_k h_k w_jk are the exact logits of the given inputs. Computed in fp64: a product of two bf16 (or
  fp16) values is exact in fp64, and the fp64 sum errs by at most γ_K(2^-53)·S_j, folded into γ below.
- The kernel's logit is ℓ̂_j = round(fl32(ℓ_j)). Any order of fp32 accumulation of K products errs by at
  most γ_K·S_j, γ_K = K·u/(1 - K·u), S_j = Σ_k |h_k w_jk| (Higham, Accuracy and Stability, eq. 3.5). u is
  2^-22, not fp32's 2^-24: tensor cores add with truncation (2^-23) and align a block's addends to the
  largest before adding, which at most doubles it (measured on V100, T4 and A100 by Fasi et al., "Numerical
  behavior of NVIDIA tensor cores", 2021). Rounding to a narrower logits dtype adds at most its unit roundoff
  r (2^-8 for bf16; r = 0 for fp32 logits) relative. So |ℓ̂_j - ℓ_j| ≤ δ_j = γ_K·S_j + r·(|ℓ_j| + γ_K·S_j).
- A correct selection T (any of tied values) has ℓ̂_p ≥ ℓ̂_i for every p in T and i not in T, hence
  ℓ_p + δ_p ≥ ℓ_i - δ_i (for an argmax p and the exact argmax j*: ℓ_j* - ℓ_p ≤ δ_p + δ_j*). A token
  breaking that is a violation: no correct kernel selects it.
- A token is decidable when the exact top-k T*'s intervals lie above every other logit's, min_{p∈T*} ℓ_p - δ_p >
  max_{i∉T*} ℓ_i + δ_i (for k = 1, every token whose top-1/top-2 gap exceeds 2·max_j δ_j is): there T must be
  T*, and a mismatch there is a violation too. The decidable share says how much of the test the rounding
  leaves decided.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from nam56r_kernels.linear_cross_entropy import _ROW_BLOCK, _cross_entropy_rows_kernel

# fp32 accumulation's unit roundoff on tensor cores, with the alignment's loss (module docstring).
ACCUMULATION_UNIT = 2.0**-22
REFERENCE_UNIT = 2.0**-53


class SelectionCheck(NamedTuple):
    violations: int  # tokens whose selection no rounding within δ explains
    decidable: torch.Tensor  # bool [N]: tokens whose exact top-k no rounding within δ can change
    decidable_mismatches: int  # decidable tokens whose selection is not their exact top-k

    @property
    def decidable_share(self) -> float:
        return self.decidable.float().mean().item()


def summation_gamma(terms: int, unit: float) -> float:
    """γ_n = n·u / (1 - n·u): the relative bound, against the sum of magnitudes, on n terms summed in any order."""
    if terms * unit >= 1:
        raise ValueError(f"γ_n needs n·u < 1, got n={terms}, u={unit}")
    return terms * unit / (1 - terms * unit)


def selection_violations(hidden: torch.Tensor, weight: torch.Tensor, selected: torch.Tensor, *,
                         logits_dtype: torch.dtype | None = None, token_chunk: int = 512) -> SelectionCheck:
    """Check ``selected`` ([N, k] integer, any order) against the exact top-k of ``hidden`` [N, K] @ ``weight``
    [V, K].T (bf16 or fp16 products; logits in ``logits_dtype``, the inputs' by default) within the rounding bound
    of the module docstring. Token chunks of ``token_chunk`` rows keep the fp64 buffers at 4 · token_chunk · V · 8
    bytes."""
    tokens, depth = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != depth or selected.ndim != 2 or selected.shape[0] != tokens:
        raise ValueError(f"expected hidden [N, K], weight [V, K], selected [N, k]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(selected.shape)}")
    if selected.dtype.is_floating_point or selected.dtype == torch.bool:
        raise TypeError(f"selected must be integer indices, got {selected.dtype}")
    logits_dtype = hidden.dtype if logits_dtype is None else logits_dtype
    gamma = summation_gamma(depth, ACCUMULATION_UNIT) + summation_gamma(depth, REFERENCE_UNIT)
    rounding = 0.0 if logits_dtype == torch.float32 else torch.finfo(logits_dtype).eps / 2
    weight64 = weight.detach().double()
    weight_magnitude = weight64.abs()
    violations = mismatches = 0
    decidable = torch.zeros(tokens, dtype=torch.bool, device=hidden.device)
    for start in range(0, tokens, token_chunk):
        rows = slice(start, min(start + token_chunk, tokens))
        hidden64 = hidden[rows].detach().double()
        exact = hidden64 @ weight64.t()
        # δ = γ·S + r·(|ℓ| + γ·S), built in the buffer of S.
        delta = (hidden64.abs() @ weight_magnitude.t()).mul_(gamma * (1 + rounding)).add_(exact.abs(), alpha=rounding)
        best = exact.topk(selected.shape[1], -1).indices.sort(-1).values
        upper, lower = exact + delta, exact.sub_(delta)
        del delta
        chosen = selected[rows].to(device=hidden.device, dtype=torch.int64).sort(-1).values
        malformed = ((chosen < 0) | (chosen >= vocab)).any(-1) | (chosen[:, 1:] == chosen[:, :-1]).any(-1)
        chosen = chosen.clamp(0, vocab - 1)
        lowest_chosen = upper.gather(-1, chosen).amin(-1)
        highest_other = lower.scatter(-1, chosen, float("-inf")).amax(-1)
        violations += int((malformed | (lowest_chosen < highest_other)).sum())
        decidable[rows] = lower.gather(-1, best).amin(-1) > upper.scatter_(-1, best, float("-inf")).amax(-1)
        mismatches += int((decidable[rows] & (chosen != best).any(-1)).sum())
    return SelectionCheck(violations, decidable, mismatches)


def argmax_violations(hidden: torch.Tensor, weight: torch.Tensor, predictions: torch.Tensor) -> SelectionCheck:
    """``selection_violations`` of one index per token: ``predictions`` [N], logits in the inputs' dtype."""
    return selection_violations(hidden, weight, predictions.unsqueeze(-1))


def predictions_without_the_last_vocab_block(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The chunked cross-entropy's row kernel launched with ``vocab`` one row block short, on the logits that
    the chunked path computes (one cuBLAS GEMM of all of ``hidden``: pass one token chunk): the argmax of a
    kernel that drops its last vocab block."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    if vocab <= _ROW_BLOCK:
        raise ValueError(f"vocab {vocab} has one row block of {_ROW_BLOCK}: nothing is left once it is dropped")
    device = hidden.device
    logits = torch.matmul(hidden.detach(), weight.detach().t())
    predictions = torch.empty(tokens, dtype=torch.int64, device=device)
    _cross_entropy_rows_kernel[(tokens,)](
        logits, torch.zeros(tokens, dtype=torch.int64, device=device), torch.ones(tokens, device=device),
        torch.empty(tokens, device=device), predictions, vocab - _ROW_BLOCK, logits.stride(0), -100,
        BLOCK=_ROW_BLOCK, num_warps=8,
    )
    return predictions
