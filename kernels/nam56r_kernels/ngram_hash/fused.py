"""The fused Triton path of the n-gram hash embedding (the contract: the package docstring).

The fused paths compute the hashes inside the gather kernel, so the training step never writes or reads a
[b, s, orders, heads] id tensor, and their backward re-hashes from the saved tokens.

The fused backward accumulates in an fp32 buffer with atomic adds (so bf16 tables get one rounding, not
one per colliding row) and casts to the tables' dtype at the end. Its atomics make the summation order,
and therefore the last fp32 bits of colliding rows, run-to-run nondeterministic.

``ngram_hash_project_fused`` does hash + gather + the model's projection to its hidden size in one kernel:
each token block gathers its O*H rows once and sums their products with ``proj_weight``'s column slices on
tensor cores, so the [b, s, O*H*D] features never exist in memory, forward or backward (the backward
re-hashes, recomputes each block's features in registers, and sums the weight gradient with split-token
fp32 atomics).

These run on CUDA tensors only. The one exception is Triton's CPU interpreter (``TRITON_INTERPRET=1``, set
before triton is imported), which the CPU tests use; there is no silent fallback to the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nam56r_kernels.ngram_hash.contract import check_embed_inputs, check_proj_weight
from nam56r_kernels.triton_support import dot_precision, require_cuda_or_interpreter

_BLOCK_TOKENS = 128
# The projection kernels: token rows per program, hidden columns per GEMM tile, and the number of token
# splits whose partial weight gradients are summed with atomics.
_PROJ_BLOCK_T = 32
_PROJ_BLOCK_N = 64
_PROJ_WGRAD_SPLITS = 32


def ngram_hash_embed_fused(
    tokens: torch.Tensor, tables: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """The same as ``ngram_hash_embed_reference``, as one Triton kernel forward and one backward.

    Needs CUDA tensors (or ``TRITON_INTERPRET=1`` for Triton's CPU interpreter); raises RuntimeError otherwise.
    """
    orders = check_embed_inputs(tokens, tables, orders, mult, offset)
    require_cuda_or_interpreter(tokens, "ngram_hash_embed_fused", "ngram_hash_embed_reference")
    return _NgramHashEmbed.apply(tokens, tables, orders, mult, offset)


def ngram_hash_project_fused(
    tokens: torch.Tensor,
    tables: torch.Tensor,
    orders: tuple[int, ...],
    mult: torch.Tensor,
    offset: torch.Tensor,
    proj_weight: torch.Tensor,
) -> torch.Tensor:
    """The same as ``ngram_hash_project_reference`` without the [b, s, O*H*D] features, forward or backward.

    Gradients flow into ``tables`` and ``proj_weight`` (accumulated in fp32, cast to their dtypes).
    Needs CUDA tensors (or ``TRITON_INTERPRET=1``); raises RuntimeError otherwise.
    """
    orders = check_embed_inputs(tokens, tables, orders, mult, offset)
    check_proj_weight(tables, mult, proj_weight)
    require_cuda_or_interpreter(tokens, "ngram_hash_project_fused", "ngram_hash_project_reference")
    return _NgramHashProject.apply(tokens, tables, orders, mult, offset, proj_weight)


class _NgramHashEmbed(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        tokens: torch.Tensor,
        tables: torch.Tensor,
        orders: tuple[int, ...],
        mult: torch.Tensor,
        offset: torch.Tensor,
    ) -> torch.Tensor:
        tokens, tables = tokens.contiguous(), tables.contiguous()
        mult, offset = mult.contiguous(), offset.contiguous()
        orders_t = torch.tensor(orders, dtype=torch.int64, device=tokens.device)
        batch, seq = tokens.shape
        num_orders, table_size, dim = tables.shape
        num_heads, max_order = mult.shape[1], mult.shape[2]
        out = torch.empty(batch, seq, num_orders * num_heads * dim, dtype=tables.dtype, device=tables.device)
        ctx.save_for_backward(tokens, orders_t, mult, offset)
        ctx.tables_shape, ctx.tables_dtype = tables.shape, tables.dtype
        if tokens.numel() == 0:
            return out
        grid = (triton.cdiv(batch * seq, _BLOCK_TOKENS), num_orders * num_heads)
        _ngram_hash_gather_kernel[grid](
            tokens, orders_t, mult, offset, tables, out,
            batch * seq, seq, table_size, dim,
            NUM_HEADS=num_heads, MAX_ORDER=max_order, BLOCK_T=_BLOCK_TOKENS, BLOCK_D=triton.next_power_of_2(dim),
        )
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tokens, orders_t, mult, offset = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        num_orders, table_size, dim = ctx.tables_shape
        num_heads, max_order = mult.shape[1], mult.shape[2]
        batch, seq = tokens.shape
        # fp32 accumulation: colliding rows of bf16 tables are summed at full precision, rounded once.
        grad_tables = torch.zeros(ctx.tables_shape, dtype=torch.float32, device=tokens.device)
        if tokens.numel() > 0:
            grid = (triton.cdiv(batch * seq, _BLOCK_TOKENS), num_orders * num_heads)
            _ngram_hash_scatter_add_kernel[grid](
                tokens, orders_t, mult, offset, grad_out.contiguous(), grad_tables,
                batch * seq, seq, table_size, dim,
                NUM_HEADS=num_heads, MAX_ORDER=max_order, BLOCK_T=_BLOCK_TOKENS, BLOCK_D=triton.next_power_of_2(dim),
            )
        return None, grad_tables.to(ctx.tables_dtype), None, None, None


class _NgramHashProject(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        tokens: torch.Tensor,
        tables: torch.Tensor,
        orders: tuple[int, ...],
        mult: torch.Tensor,
        offset: torch.Tensor,
        proj_weight: torch.Tensor,
    ) -> torch.Tensor:
        tokens, tables, proj_weight = tokens.contiguous(), tables.contiguous(), proj_weight.contiguous()
        mult, offset = mult.contiguous(), offset.contiguous()
        orders_t = torch.tensor(orders, dtype=torch.int64, device=tokens.device)
        batch, seq = tokens.shape
        hidden = proj_weight.shape[0]
        out = torch.empty(batch, seq, hidden, dtype=tables.dtype, device=tables.device)
        ctx.save_for_backward(tokens, orders_t, mult, offset, tables, proj_weight)
        if tokens.numel() == 0:
            return out
        grid = (triton.cdiv(batch * seq, _PROJ_BLOCK_T),)
        _ngram_project_fwd_kernel[grid](
            tokens, orders_t, mult, offset, tables, proj_weight, out,
            batch * seq, seq, tables.shape[1], tables.shape[2], hidden, **_proj_meta(mult, tables),
        )
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tokens, orders_t, mult, offset, tables, proj_weight = ctx.saved_tensors
        batch, seq = tokens.shape
        hidden = proj_weight.shape[0]
        grad_out = grad_out.contiguous()
        grad_tables = grad_weight = None
        meta = _proj_meta(mult, tables)
        if ctx.needs_input_grad[1]:
            grad_tables32 = torch.zeros(tables.shape, dtype=torch.float32, device=tables.device)
            if tokens.numel() > 0:
                _ngram_project_dtables_kernel[(triton.cdiv(batch * seq, _PROJ_BLOCK_T),)](
                    tokens, orders_t, mult, offset, proj_weight, grad_out, grad_tables32,
                    batch * seq, seq, tables.shape[1], tables.shape[2], hidden, **meta,
                )
            grad_tables = grad_tables32.to(tables.dtype)
        if ctx.needs_input_grad[5]:
            grad_weight32 = torch.zeros(proj_weight.shape, dtype=torch.float32, device=proj_weight.device)
            if tokens.numel() > 0:
                grid = (triton.cdiv(hidden, _PROJ_BLOCK_N), _PROJ_WGRAD_SPLITS)
                _ngram_project_dweight_kernel[grid](
                    tokens, orders_t, mult, offset, tables, grad_out, grad_weight32,
                    batch * seq, seq, tables.shape[1], tables.shape[2], hidden, **meta, num_warps=8,
                )
            grad_weight = grad_weight32.to(proj_weight.dtype)
        return None, grad_tables, None, None, None, grad_weight


def _proj_meta(mult: torch.Tensor, tables: torch.Tensor) -> dict[str, int]:
    num_pairs = mult.shape[0] * mult.shape[1]
    return {
        "NUM_HEADS": mult.shape[1], "MAX_ORDER": mult.shape[2], "NUM_PAIRS": num_pairs,
        "BLOCK_P": max(1, triton.next_power_of_2(num_pairs)), "BLOCK_D": max(16, triton.next_power_of_2(tables.shape[2])),
        "BLOCK_T": _PROJ_BLOCK_T, "BLOCK_N": _PROJ_BLOCK_N, "DOT_PRECISION": dot_precision(tables.dtype),
    }


@triton.jit
def _hash_pair_rows(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tok, pair, num_tokens, seq_len, table_size,
                    NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr):
    """Elementwise over broadcast ``tok`` (flat token index) x ``pair`` (o * H + h): the row in the stacked
    [O*T, D] tables and whether it exists (the token is in range and t >= n - 1). See the package docstring."""
    order_idx = pair // NUM_HEADS
    n = tl.load(orders_ptr + order_idx)
    valid = (tok < num_tokens) & (tok % seq_len >= n - 1)
    acc = tl.load(offset_ptr + pair) % table_size
    for i in tl.static_range(MAX_ORDER):
        use = valid & (i < n)
        token_id = tl.load(tokens_ptr + tok - i, mask=use, other=0)
        m = tl.load(mult_ptr + pair * MAX_ORDER + i)
        # Reduce each product (< 2**62) before adding so the running sum never overflows int64.
        acc = (acc + tl.where(use, (token_id * m) % table_size, 0)) % table_size
    return order_idx.to(tl.int64) * table_size + acc, valid


@triton.jit
def _block_entries(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tok, num_tokens, seq_len, table_size, dim,
                   NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr, NUM_PAIRS: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """For the tokens ``tok`` and every (order, head) pair, padded to [BLOCK_T, BLOCK_P, BLOCK_D]: the element
    offsets into the stacked [O*T, D] tables, and the mask of real entries (the n-gram fits, no padding)."""
    pair = tl.arange(0, BLOCK_P)
    rows, valid = _hash_pair_rows(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tok[:, None],
                                  tl.minimum(pair, NUM_PAIRS - 1)[None, :], num_tokens, seq_len, table_size, NUM_HEADS, MAX_ORDER)
    d = tl.arange(0, BLOCK_D)
    mask = (valid & (pair < NUM_PAIRS)[None, :])[:, :, None] & (d < dim)[None, None, :]
    return rows[:, :, None] * dim + d[None, None, :], mask


@triton.jit
def _gather_features(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tables_ptr, tok, num_tokens, seq_len, table_size, dim,
                     NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr, NUM_PAIRS: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_T, BLOCK_P * BLOCK_D] features of the tokens ``tok`` (zeros where an n-gram does not fit or in padding)."""
    entries, mask = _block_entries(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tok, num_tokens, seq_len, table_size, dim,
                                   NUM_HEADS, MAX_ORDER, NUM_PAIRS, BLOCK_P, BLOCK_D)
    values = tl.load(tables_ptr + entries, mask=mask, other=0.0)
    return tl.reshape(values, (tok.shape[0], BLOCK_P * BLOCK_D))


@triton.jit
def _feature_columns(dim, NUM_PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """For each padded feature slot p * BLOCK_D + d: its column p * D + d in proj_weight, and whether it is real."""
    slot = tl.arange(0, BLOCK_P * BLOCK_D)
    p, d = slot // BLOCK_D, slot % BLOCK_D
    return p * dim + d, (p < NUM_PAIRS) & (d < dim)


@triton.jit
def _ngram_project_fwd_kernel(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tables_ptr, weight_ptr, out_ptr,
                              num_tokens, seq_len, table_size, dim, hidden,
                              NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr, NUM_PAIRS: tl.constexpr,
                              BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    features = _gather_features(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tables_ptr, tok, num_tokens,
                                seq_len, table_size, dim, NUM_HEADS, MAX_ORDER, NUM_PAIRS, BLOCK_P, BLOCK_D)
    cols, col_ok = _feature_columns(dim, NUM_PAIRS, BLOCK_P, BLOCK_D)
    width = NUM_PAIRS * dim
    for n0 in range(0, hidden, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        # proj_weight is [hidden, O*H*D]; this tile is its transpose restricted to columns n.
        w_t = tl.load(weight_ptr + n[None, :].to(tl.int64) * width + cols[:, None],
                      mask=col_ok[:, None] & (n < hidden)[None, :], other=0.0)
        acc = tl.dot(features, w_t, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        tl.store(out_ptr + tok[:, None] * hidden + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(tok < num_tokens)[:, None] & (n < hidden)[None, :])


@triton.jit
def _ngram_project_dtables_kernel(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, weight_ptr, grad_out_ptr, grad_tables_ptr,
                                  num_tokens, seq_len, table_size, dim, hidden,
                                  NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr, NUM_PAIRS: tl.constexpr,
                                  BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                                  DOT_PRECISION: tl.constexpr):
    """grad_features = grad_out @ proj_weight for a token block, kept in registers, scattered into the tables."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols, col_ok = _feature_columns(dim, NUM_PAIRS, BLOCK_P, BLOCK_D)
    width = NUM_PAIRS * dim
    grad_features = tl.zeros((BLOCK_T, BLOCK_P * BLOCK_D), dtype=tl.float32)
    for n0 in range(0, hidden, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        g = tl.load(grad_out_ptr + tok[:, None] * hidden + n[None, :], mask=(tok < num_tokens)[:, None] & (n < hidden)[None, :],
                    other=0.0)
        w = tl.load(weight_ptr + n[:, None].to(tl.int64) * width + cols[None, :], mask=(n < hidden)[:, None] & col_ok[None, :],
                    other=0.0)
        grad_features = tl.dot(g, w, acc=grad_features, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    entries, mask = _block_entries(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tok, num_tokens, seq_len, table_size, dim,
                                   NUM_HEADS, MAX_ORDER, NUM_PAIRS, BLOCK_P, BLOCK_D)
    tl.atomic_add(grad_tables_ptr + entries, tl.reshape(grad_features, (BLOCK_T, BLOCK_P, BLOCK_D)), mask=mask)


@triton.jit
def _ngram_project_dweight_kernel(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tables_ptr, grad_out_ptr, grad_weight_ptr,
                                  num_tokens, seq_len, table_size, dim, hidden,
                                  NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr, NUM_PAIRS: tl.constexpr,
                                  BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                                  DOT_PRECISION: tl.constexpr):
    """grad_weight[n, :] = sum over tokens of grad_out[t, n] * features[t, :]; this program sums one column
    block over every num_programs(1)-th token block, then adds its partial sum into the fp32 result."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols, col_ok = _feature_columns(dim, NUM_PAIRS, BLOCK_P, BLOCK_D)
    acc = tl.zeros((BLOCK_P * BLOCK_D, BLOCK_N), dtype=tl.float32)
    for start in range(tl.program_id(1) * BLOCK_T, num_tokens, tl.num_programs(1) * BLOCK_T):
        tok = start + tl.arange(0, BLOCK_T).to(tl.int64)
        features = _gather_features(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tables_ptr, tok, num_tokens,
                                    seq_len, table_size, dim, NUM_HEADS, MAX_ORDER, NUM_PAIRS, BLOCK_P, BLOCK_D)
        g = tl.load(grad_out_ptr + tok[:, None] * hidden + n[None, :], mask=(tok < num_tokens)[:, None] & (n < hidden)[None, :],
                    other=0.0)
        acc = tl.dot(tl.trans(features), g.to(features.dtype), acc=acc, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    width = NUM_PAIRS * dim
    tl.atomic_add(grad_weight_ptr + n[None, :].to(tl.int64) * width + cols[:, None], acc,
                  mask=col_ok[:, None] & (n < hidden)[None, :])


@triton.jit
def _hash_rows(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, num_tokens, seq_len, table_size,
               NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr, BLOCK_T: tl.constexpr):
    """For this program's BLOCK_T flat token positions and its (order, head): token index, row in the
    stacked [O*T, D] tables, and whether that row exists (t >= n - 1 and the token is in range)."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row, valid = _hash_pair_rows(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tok, tl.program_id(1), num_tokens, seq_len,
                                 table_size, NUM_HEADS, MAX_ORDER)
    return tok, row, valid


@triton.jit
def _ngram_hash_gather_kernel(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, tables_ptr, out_ptr,
                              num_tokens, seq_len, table_size, dim,
                              NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_D: tl.constexpr):
    tok, row, valid = _hash_rows(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, num_tokens, seq_len, table_size,
                                 NUM_HEADS, MAX_ORDER, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    values = tl.load(tables_ptr + row[:, None] * dim + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    out_width = tl.num_programs(1) * dim
    out_cols = tl.program_id(1) * dim + d
    out_mask = (tok < num_tokens)[:, None] & d_ok[None, :]  # invalid-but-in-range rows are written as zeros
    tl.store(out_ptr + tok[:, None] * out_width + out_cols[None, :], values, mask=out_mask)


@triton.jit
def _ngram_hash_scatter_add_kernel(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, grad_out_ptr, grad_tables_ptr,
                                   num_tokens, seq_len, table_size, dim,
                                   NUM_HEADS: tl.constexpr, MAX_ORDER: tl.constexpr, BLOCK_T: tl.constexpr,
                                   BLOCK_D: tl.constexpr):
    tok, row, valid = _hash_rows(tokens_ptr, orders_ptr, mult_ptr, offset_ptr, num_tokens, seq_len, table_size,
                                 NUM_HEADS, MAX_ORDER, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (d < dim)[None, :]
    out_width = tl.num_programs(1) * dim
    out_cols = tl.program_id(1) * dim + d
    grad = tl.load(grad_out_ptr + tok[:, None] * out_width + out_cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(grad_tables_ptr + row[:, None] * dim + d[None, :], grad, mask=mask)
