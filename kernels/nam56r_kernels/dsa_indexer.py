"""DSA lightning-indexer scores and top-k: PyTorch references and fused Triton kernels, with one contract.

Why: Megatron core_v0.19.0 computes the indexer's scores ``sum_h w[h] * relu(q[h] . k)`` as an fp32
einsum over a ``[sq, b, heads, sk]`` intermediate (32x the result at NAM56R's 32 index heads) without
tensor cores, and its fused TileLang indexer writes fp32 logits for a whole sequence before
``torch.topk``. The fused scores kernel here runs each head's ``q . k`` as a bf16 tensor-core GEMM with
fp32 accumulation and writes only the ``[b, sq, sk]`` result. The fused top-k scores one sequence at a
time into a reused ``[sq, sk]`` buffer and selects each query's top-k exactly in one pass over registers:
the k-th largest score's bits by bisection (31 counts over the row), then a compaction and a sort of
only the k kept keys. Selecting by sort merges, or by ``torch.topk``, costs more than the scores do.

Contract (Megatron's layouts, so the kernels drop in where ``_compute_index_scores`` is called):

- ``q``: [sq, b, H, D] bf16/fp16/fp32, ``k``: [sk, b, D] same dtype, ``weights``: [sq, b, H] floating.
  D is a power of two >= 16 (a tensor-core tile); NAM56R uses H=32, D=64.
- ``score[b, i, j] = sum_h weights[i, b, h] * act(q[i, b, h] . k[j, b])`` in fp32, act = relu when
  ``use_relu`` else identity. Products of bf16 values are exact in fp32, so the fused and reference
  scores differ only by fp32 summation order.
- ``causal=True`` (needs sq == sk): key j is visible to query i iff j <= i; hidden scores are -inf,
  as after Megatron adds its causal float mask.
- Scores: fp32 [b, sq, sk].
- Top-k: ``(scores, indices)``, fp32 and int32 [b, sq, min(topk, sk)], per query in descending score
  order, equal scores in ascending key order. Slots with no visible key left (query i < topk - 1 under
  the causal mask) hold score -inf and index -1, as Megatron's naive ``fused_qk_topk_naive`` does.
  Apart from exact ties, the selected set equals ``torch.topk`` over the masked reference scores.

The fused paths run on CUDA tensors only, or under Triton's CPU interpreter (``TRITON_INTERPRET=1`` set
before triton is imported), which the CPU tests use; there is no silent fallback to the references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nam56r_kernels.triton_support import dot_precision, require_cuda_or_interpreter

__all__ = [
    "index_scores_fused",
    "index_scores_reference",
    "index_topk_fused",
    "index_topk_reference",
]

_SCORE_BLOCK_M = 64
_SCORE_BLOCK_N = 128
# Longest key row the select holds in registers (16 warps, 64 keys a thread).
MAX_SELECT_KEYS = 32768


def index_scores_reference(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *, use_relu: bool = True, causal: bool = False
) -> torch.Tensor:
    """fp32 [b, sq, sk] scores, one head at a time in fp32 (Megatron patch 0002's per-head naive path)."""
    _check_indexer_inputs(q, k, weights, causal)
    sq, batch, heads, _ = q.shape
    k_bdt = k.float().permute(1, 2, 0)  # [b, D, sk]
    weights_bsh = weights.float().transpose(0, 1)  # [b, sq, H]
    scores = torch.zeros(batch, sq, k.shape[0], dtype=torch.float32, device=q.device)
    for head in range(heads):
        head_scores = torch.bmm(q[:, :, head].float().transpose(0, 1), k_bdt)
        if use_relu:
            head_scores.relu_()
        scores.addcmul_(head_scores, weights_bsh[:, :, head : head + 1])
    if causal:
        scores.masked_fill_(_causal_hidden(sq, q.device), float("-inf"))
    return scores


def index_topk_reference(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *, use_relu: bool = True, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scores, int32 indices) [b, sq, min(topk, sk)]: the reference scores, then ``torch.topk``."""
    _check_topk(topk)
    scores = index_scores_reference(q, k, weights, use_relu=use_relu, causal=causal)
    top_scores, top_indices = scores.topk(min(topk, k.shape[0]), dim=-1)
    top_indices = top_indices.masked_fill(top_scores == float("-inf"), -1).to(torch.int32)
    return top_scores, top_indices


def index_scores_fused(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *, use_relu: bool = True, causal: bool = False
) -> torch.Tensor:
    """The same as ``index_scores_reference``, as one Triton kernel (bf16 tensor-core GEMMs, fp32 sums)."""
    _check_indexer_inputs(q, k, weights, causal)
    require_cuda_or_interpreter(q, "index_scores_fused", "index_scores_reference")
    sq, batch, heads, dim = q.shape
    sk = k.shape[0]
    out = torch.empty(batch, sq, sk, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    q, k = _d_contiguous(q), _d_contiguous(k)
    grid = (triton.cdiv(sq, _SCORE_BLOCK_M), triton.cdiv(sk, _SCORE_BLOCK_N), batch)
    _index_scores_kernel[grid](
        q, k, weights, out, sq, sk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0), out.stride(1),
        HEADS=heads, DIM=dim, BLOCK_M=_SCORE_BLOCK_M, BLOCK_N=_SCORE_BLOCK_N, USE_RELU=use_relu, CAUSAL=causal,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=4, num_stages=2,
    )
    return out


def index_topk_fused(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, *, use_relu: bool = True, causal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as ``index_topk_reference``: per sequence, the fused scores, then one exact select per query.

    Extra memory beyond the outputs is one sequence's fp32 [sq, sk] scores, reused across the batch.
    """
    _check_topk(topk)
    _check_indexer_inputs(q, k, weights, causal)
    require_cuda_or_interpreter(q, "index_topk_fused", "index_topk_reference")
    sq, batch, _, _ = q.shape
    sk = k.shape[0]
    if sk > MAX_SELECT_KEYS:
        raise ValueError(f"index_topk_fused selects among at most {MAX_SELECT_KEYS} keys per query, got sk={sk}; "
                         "use index_topk_reference")
    kept = min(topk, sk)
    top_scores = torch.empty(batch, sq, kept, dtype=torch.float32, device=q.device)
    top_indices = torch.empty(batch, sq, kept, dtype=torch.int32, device=q.device)
    if top_scores.numel() == 0:
        return top_scores, top_indices
    row_width = max(16, triton.next_power_of_2(sk))
    for bi in range(batch):
        scores = index_scores_fused(q[:, bi : bi + 1], k[:, bi : bi + 1], weights[:, bi : bi + 1],
                                    use_relu=use_relu, causal=causal)[0]
        _select_topk_kernel[(sq,)](
            scores, top_scores[bi], top_indices[bi], sk, kept, scores.stride(0), top_scores.stride(1),
            ROW=row_width, KEEP=max(16, triton.next_power_of_2(kept)), num_warps=max(4, min(16, row_width // 1024)),
        )
    return top_scores, top_indices


@triton.jit
def _index_scores_kernel(q_ptr, k_ptr, w_ptr, out_ptr, sq, sk,
                         stride_qs, stride_qb, stride_qh, stride_ks, stride_kb,
                         stride_ws, stride_wb, stride_wh, stride_ob, stride_os,
                         HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         USE_RELU: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m, pid_n, bi = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + bi * stride_ob + rows[:, None].to(tl.int64) * stride_os + cols[None, :]
    out_mask = (rows < sq)[:, None] & (cols < sk)[None, :]
    if CAUSAL and pid_n * BLOCK_N > pid_m * BLOCK_M + BLOCK_M - 1:
        # The whole block is above the diagonal: no GEMM, only the -inf the mask would add.
        tl.store(out_ptrs, tl.full((BLOCK_M, BLOCK_N), float("-inf"), tl.float32), mask=out_mask)
    else:
        acc = _weighted_head_sum(q_ptr, k_ptr, w_ptr, bi, rows, cols, sq, sk,
                                 stride_qs, stride_qb, stride_qh, stride_ks, stride_kb,
                                 stride_ws, stride_wb, stride_wh, HEADS, DIM, BLOCK_M, BLOCK_N, USE_RELU, DOT_PRECISION)
        if CAUSAL:
            acc = tl.where(cols[None, :] <= rows[:, None], acc, float("-inf"))
        tl.store(out_ptrs, acc, mask=out_mask)


@triton.jit
def _weighted_head_sum(q_ptr, k_ptr, w_ptr, bi, rows, cols, sq, sk,
                       stride_qs, stride_qb, stride_qh, stride_ks, stride_kb,
                       stride_ws, stride_wb, stride_wh,
                       HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       USE_RELU: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N]: sum over heads of w * act(q_h . k) for these query rows and key columns."""
    d = tl.arange(0, DIM)
    row_ok, col_ok = rows < sq, cols < sk
    k_tile = tl.load(k_ptr + cols[:, None].to(tl.int64) * stride_ks + bi * stride_kb + d[None, :],
                     mask=col_ok[:, None], other=0.0)
    k_t = tl.trans(k_tile)  # [DIM, BLOCK_N]
    q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_qs + bi * stride_qb + d[None, :]
    w_rows = w_ptr + rows.to(tl.int64) * stride_ws + bi * stride_wb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for h in range(HEADS):
        q_tile = tl.load(q_rows + h * stride_qh, mask=row_ok[:, None], other=0.0)
        head = tl.dot(q_tile, k_t, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        if USE_RELU:
            head = tl.maximum(head, 0.0)
        w_h = tl.load(w_rows + h * stride_wh, mask=row_ok, other=0.0).to(tl.float32)
        acc += head * w_h[:, None]
    return acc


@triton.jit
def _pack_keys(scores, cols):
    """int64 keys ordered like (score, -col): a float's bits made monotone in the high word, ~col low."""
    bits = scores.to(tl.int32, bitcast=True)
    mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (0xFFFFFFFF - cols.to(tl.int64))


@triton.jit
def _select_topk_kernel(scores_ptr, out_scores_ptr, out_indices_ptr, sk, kept, stride_row, stride_out,
                        ROW: tl.constexpr, KEEP: tl.constexpr):
    """One query's top-``kept`` of its ``sk`` scores, exactly: the kept-th largest key by bisection over its bits,
    then everything above it plus the lowest-numbered keys tied with it, sorted (score descending, key ascending)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, ROW)
    scores = tl.load(scores_ptr + row * stride_row + cols, mask=cols < sk, other=float("-inf"))
    bits = scores.to(tl.int32, bitcast=True)
    # Signed ints ordered as the floats are; past-the-end keys sit below every real one, -inf included.
    mono = tl.where(cols < sk, tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), -2147483647 - 1)
    # The largest threshold t with at least `kept` keys >= t, built from the sign bit down; no step overflows.
    threshold = tl.where(tl.sum((mono >= 0).to(tl.int32), axis=0) >= kept, 0, -2147483647 - 1)
    for step in tl.static_range(31):
        candidate = threshold + (1 << (30 - step))
        threshold = tl.where(tl.sum((mono >= candidate).to(tl.int32), axis=0) >= kept, candidate, threshold)
    above = mono > threshold
    tied = mono == threshold
    ties_wanted = kept - tl.sum(above.to(tl.int32), axis=0)
    chosen = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= ties_wanted))
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    out_scores = out_scores_ptr + row * stride_out
    out_indices = out_indices_ptr + row * stride_out
    tl.store(out_scores + slot, scores, mask=chosen)
    tl.store(out_indices + slot, cols, mask=chosen)
    # The chosen keys are in key order; a sort of the kept slots, read back by the same block, orders them.
    tl.debug_barrier()
    lane = tl.arange(0, KEEP)
    in_row = lane < kept
    keys = _pack_keys(tl.load(out_scores + lane, mask=in_row, other=float("-inf")),
                      tl.load(out_indices + lane, mask=in_row, other=0))
    keys = tl.where(in_row, keys, -9223372036854775807 - 1)
    keys = tl.sort(keys, dim=0, descending=True)
    mono_top = (keys >> 32).to(tl.int32)
    top = tl.where(mono_top >= 0, mono_top, mono_top ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    top_cols = tl.where(top == float("-inf"), -1, (0xFFFFFFFF - (keys & 0xFFFFFFFF)).to(tl.int32))
    tl.debug_barrier()
    tl.store(out_scores + lane, top, mask=in_row)
    tl.store(out_indices + lane, top_cols, mask=in_row)


def _causal_hidden(seq: int, device: torch.device) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu_(1)


def _d_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_topk(topk: int) -> None:
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")


def _check_indexer_inputs(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, causal: bool) -> None:
    for name, value in (("q", q), ("k", k), ("weights", weights)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {value.dtype}")
    if q.ndim != 4 or k.ndim != 3 or weights.ndim != 3:
        raise ValueError(
            f"expected q [sq, b, H, D], k [sk, b, D], weights [sq, b, H]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, weights {tuple(weights.shape)}"
        )
    sq, batch, heads, dim = q.shape
    if k.shape[1] != batch or k.shape[2] != dim:
        raise ValueError(f"k must be [sk, b={batch}, D={dim}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(weights.shape) != (sq, batch, heads):
        raise ValueError(f"weights must be [sq, b, H] = {(sq, batch, heads)}, got {tuple(weights.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must share a dtype, got q {q.dtype} and k {k.dtype}")
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"index head dim D must be a power of two >= 16, got {dim}")
    if k.device != q.device or weights.device != q.device:
        raise ValueError(f"q, k and weights must share a device, got {q.device}, {k.device}, {weights.device}")
    if causal and k.shape[0] != sq:
        raise ValueError(f"causal scores need sq == sk, got sq={sq}, sk={k.shape[0]}")
