"""MoE token permutation without atomics: each token's rows in expert order, gathered and summed by the token.

Why: Megatron's unfused permute (no TransformerEngine) sorts the routing map, `index_select`s the tokens (its
backward an atomic `index_add` into the tokens' gradient), and its unpermute `scatter_add`s the expert outputs
back into the tokens with bf16 atomics, one rounding per add. Here one table says where each (token, expert)
pair sits in expert order, so both directions of both ops are one pass over the tokens: a token's row is
copied to its rows, or its rows are summed (in fp32, rounded once) into it. No sort, no atomics, and no host
sync: the row count is the routing's static top-k x tokens.

Contract:

- ``routing_map``: bool [T, E], exactly ``topk`` True per token (dropless routing).
- ``expert_rows(routing_map)``: int32 [T, E] row of each selected pair in the permuted order (-1 where not
  selected) and int64 [E] tokens per expert, on the routing map's device. The order is Megatron's: expert 0's
  tokens first, each expert's tokens ascending.
- ``permute_tokens(tokens [T, H], rows)`` -> [N, H], N = number of selected pairs: row ``rows[t, e]`` is token t.
  Backward: a token's gradient is the sum of its rows' gradients.
- ``unpermute_tokens(permuted [N, H], rows, addend=None)`` -> [T, H]: token t is the sum of its rows (plus
  ``addend[t]``, [T, H] in permuted's dtype, e.g. the shared expert's output), accumulated in fp32 and returned in
  the input's dtype. Backward: each row's gradient is its token's, and so is the addend's.
- ``fan_out(tokens [T, H], uses)`` -> (``uses`` aliases of tokens, a ``RowsGradient``): for a layer input that several
  ops read besides the permute (Megatron's router and shared expert). ``permute_tokens(alias, rows, N,
  rows_gradient=it)`` leaves its rows' gradient there, and the tokens' gradient is then the fp32 sum of each token's
  rows and of every alias's gradient, rounded once: one pass, where autograd would sum the rows and then add each
  other use's gradient in bf16, a pass over [T, H] each.
- ``permute_probs(probs [T, E], rows, N)`` -> [N]: each selected pair's prob in the permuted order,
  differentiable (plain torch).
- ``routing_table(routing_map, probs, N)`` -> ``expert_rows``' two tensors and ``permute_probs``' [N], from two Triton
  passes over the routing map instead of a dozen torch ops (each op costs the host a launch, and the dispatch sits
  between the router and the experts, where the GPU waits on the host), and a device-side check that the map selects
  N pairs. Differentiable in probs.

Triton kernels on CUDA tensors, or under Triton's CPU interpreter (the CPU tests); the references are
``permute_tokens_reference`` / ``unpermute_tokens_reference`` (index_select / index_add). Nothing falls back.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from nam56r_kernels.triton_support import require_cuda_or_interpreter

__all__ = [
    "RowsGradient",
    "expert_rows",
    "fan_out",
    "routing_table",
    "permute_probs",
    "permute_tokens",
    "permute_tokens_reference",
    "unpermute_tokens",
    "unpermute_tokens_reference",
]

_BLOCK_H = 1024
_MAX_ADDENDS = 3  # tensors summed into the tokens besides their rows, in one _sum_rows pass
_TABLE_BLOCK_T = 256  # tokens per routing-table program
_TABLE_CHUNK = 64  # blocks' counts read at a time for a block's prefix


def expert_rows(routing_map: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [T, E] row of each selected (token, expert) pair in expert order, -1 elsewhere; int64 [E] tokens per
    expert), without a host sync."""
    _check_routing_map(routing_map)
    by_expert = routing_map.t().contiguous()  # [E, T]: expert-major, tokens ascending
    rows = torch.cumsum(by_expert.view(-1), dim=0, dtype=torch.int32) - 1
    rows = rows.masked_fill_(~by_expert.view(-1), -1).view(by_expert.shape)
    return rows.t().contiguous(), by_expert.sum(dim=1)


def permute_probs(probs: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[num_rows] probs of the selected pairs in the permuted order (`probs` [T, E]); differentiable in probs."""
    if probs.shape != rows.shape:
        raise ValueError(f"probs {tuple(probs.shape)} and rows {tuple(rows.shape)} must both be [T, E]")
    slots = torch.where(rows >= 0, rows, num_rows).long().view(-1)  # unselected pairs land in a spare slot
    return probs.new_zeros(num_rows + 1).scatter(0, slots, probs.reshape(-1))[:num_rows]


def routing_table(routing_map: torch.Tensor, probs: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows int32 [T, E], tokens per expert int64 [E], probs of the selected pairs in row order [num_rows]): what
    `expert_rows` and `permute_probs` return, without a host sync; an asynchronous device assertion fails the next
    synchronizing call when the map does not select exactly num_rows pairs (dropless top-k routing)."""
    _check_routing_map(routing_map)
    if probs.shape != routing_map.shape or not probs.is_floating_point() or probs.device != routing_map.device:
        raise ValueError(f"probs must be floating and shaped as routing_map {tuple(routing_map.shape)} on its device, got "
                         f"{probs.dtype} {tuple(probs.shape)} on {probs.device}")
    require_cuda_or_interpreter(routing_map, "nam56r_kernels.moe_permute.routing_table", "expert_rows and permute_probs")
    return _RoutingTable.apply(routing_map, probs, num_rows)


def permute_tokens(tokens: torch.Tensor, rows: torch.Tensor, num_rows: int,
                   rows_gradient: RowsGradient | None = None) -> torch.Tensor:
    """[num_rows, H]: row rows[t, e] holds token t (the module docstring's contract). With ``rows_gradient`` (from
    ``fan_out``, whose alias ``tokens`` must be), the backward leaves the rows' gradient there for ``fan_out``'s
    backward to sum, instead of summing it into the tokens' gradient itself."""
    _check(tokens, rows, tokens.shape[0], "tokens")
    if rows_gradient is not None:
        rows_gradient.attach(tokens)
    return _PermuteTokens.apply(tokens, rows, num_rows, rows_gradient)


class RowsGradient:
    """Where ``permute_tokens(alias, rows, N, rows_gradient=self)`` leaves its rows' gradient [N, H] (and the rows) in
    the backward, for the backward of the ``fan_out`` that made the alias. One permute per fan-out."""

    def __init__(self) -> None:
        self._aliases: list[weakref.ref] = []  # fan_out's aliases, one of which the permute must read
        self.attached = False
        self.grad: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    def bind(self, aliases: tuple[torch.Tensor, ...]) -> None:
        """The aliases `fan_out` made: the one permute this gradient belongs to must read one of them."""
        self._aliases = [weakref.ref(alias) for alias in aliases]

    def attach(self, tokens: torch.Tensor) -> None:
        if self.attached:
            raise ValueError("this RowsGradient already takes another permute_tokens' gradient; fan_out once per permute")
        if not any(alias() is tokens for alias in self._aliases):
            raise ValueError("permute_tokens' rows_gradient belongs to other tokens: pass one of the aliases fan_out returned "
                             "with it (its backward sums the rows' gradient into those tokens' gradient)")
        self.attached = True

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        grad, rows, self.grad, self.rows = self.grad, self.rows, None, None
        return grad, rows


def fan_out(tokens: torch.Tensor, uses: int) -> tuple[tuple[torch.Tensor, ...], RowsGradient]:
    """(``uses`` aliases of ``tokens`` [T, H], one per op that reads them, and the RowsGradient for the one that goes to
    ``permute_tokens``): the backward sums the aliases' gradients and the permuted rows' gradient into the tokens' in
    one fp32 pass, rounded once (the module docstring's contract). Up to three uses, the permute's among them."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [T, H], got {tuple(tokens.shape)}")
    if not 1 <= uses <= _MAX_ADDENDS:
        raise ValueError(f"fan_out takes 1 to {_MAX_ADDENDS} uses, got {uses}")
    require_cuda_or_interpreter(tokens, "nam56r_kernels.moe_permute.fan_out", "the tokens themselves for every use")
    sink = RowsGradient()
    aliases = _FanOut.apply(tokens, sink, uses)
    aliases = aliases if isinstance(aliases, tuple) else (aliases,)
    sink.bind(aliases)
    return aliases, sink


def unpermute_tokens(permuted: torch.Tensor, rows: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H]: token t is the fp32 sum of its rows and of addend[t] if given, in permuted's dtype."""
    if addend is not None and (addend.shape != (rows.shape[0], permuted.shape[1]) or addend.dtype != permuted.dtype
                               or addend.device != permuted.device):
        raise ValueError(f"addend must be [T, H] = {[rows.shape[0], permuted.shape[1]]} {permuted.dtype} on {permuted.device}, "
                         f"got {addend.dtype} {tuple(addend.shape)} on {addend.device}")
    _check(permuted, rows, None, "permuted")
    return _UnpermuteTokens.apply(permuted, rows, addend)


def permute_tokens_reference(tokens: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`permute_tokens` as Megatron computes it: an index_select of the tokens in row order."""
    token_of_row = torch.empty(num_rows, dtype=torch.long, device=rows.device)
    selected = rows >= 0
    token_of_row[rows[selected].long()] = selected.nonzero()[:, 0]
    return tokens.index_select(0, token_of_row)


def unpermute_tokens_reference(permuted: torch.Tensor, rows: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
    """`unpermute_tokens` in torch: an fp32 index_add of each row into its token (starting from the addend)."""
    selected = rows >= 0
    token_of_pair = selected.nonzero()[:, 0]
    out = torch.zeros(rows.shape[0], permuted.shape[1], dtype=torch.float32, device=permuted.device)
    if addend is not None:
        out += addend.float()
    return out.index_add_(0, token_of_pair, permuted[rows[selected].long()].float()).to(permuted.dtype)


def _check_routing_map(routing_map: torch.Tensor) -> None:
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
        raise ValueError(f"routing_map must be bool [T, E], got {routing_map.dtype} {tuple(routing_map.shape)}")


def _check(x: torch.Tensor, rows: torch.Tensor, tokens: int | None, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [rows, H], got {tuple(x.shape)}")
    if rows.dim() != 2 or rows.dtype != torch.int32 or (tokens is not None and rows.shape[0] != tokens):
        raise ValueError(f"rows must be int32 [T, E] (expert_rows) for {name} {tuple(x.shape)}, got {rows.dtype} {tuple(rows.shape)}")
    if rows.device != x.device:
        raise ValueError(f"rows on {rows.device} and {name} on {x.device} must share a device")
    require_cuda_or_interpreter(x, "nam56r_kernels.moe_permute", "permute_tokens_reference / unpermute_tokens_reference")


def _copy_to_rows(src: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    src = src.contiguous()
    out = src.new_empty(num_rows, src.shape[1])
    if src.numel():
        grid = (src.shape[0], triton.cdiv(src.shape[1], _BLOCK_H))
        _copy_to_rows_kernel[grid](src, out, rows, src.shape[1], EXPERTS=rows.shape[1], BLOCK_H=_BLOCK_H)
    return out


def _sum_rows(src: torch.Tensor, rows: torch.Tensor, addends: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """[T, H] in src's dtype: each token's rows of src [N, H] and its row of every addend [T, H], summed in fp32."""
    if len(addends) > _MAX_ADDENDS:
        raise ValueError(f"_sum_rows takes up to {_MAX_ADDENDS} addends, got {len(addends)}")
    src = src.contiguous()
    out = src.new_empty(rows.shape[0], src.shape[1])
    if out.numel():
        grid = (rows.shape[0], triton.cdiv(src.shape[1], _BLOCK_H))
        padded = [addend.contiguous() for addend in addends] + [out] * (_MAX_ADDENDS - len(addends))  # unread past ADDENDS
        _sum_rows_kernel[grid](src, *padded, out, rows, src.shape[1], EXPERTS=rows.shape[1], BLOCK_H=_BLOCK_H,
                               ADDENDS=len(addends))
    return out


class _RoutingTable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, routing_map, probs, num_rows):
        tokens, experts = routing_map.shape
        selected = routing_map.contiguous().view(torch.uint8)
        device = routing_map.device
        num_blocks = triton.cdiv(tokens, _TABLE_BLOCK_T)
        block_e = triton.next_power_of_2(experts)
        block_counts = torch.empty(max(num_blocks, 1), block_e, dtype=torch.int32, device=device)
        rows = torch.empty(tokens, experts, dtype=torch.int32, device=device)
        # Every entry is written when the map selects num_rows pairs (the device assertion checks it): no fills, each a
        # launch while the GPU waits on the host.
        counts = torch.empty(experts, dtype=torch.int64, device=device)
        row_probs = torch.empty(num_rows, dtype=probs.dtype, device=probs.device)
        covered = torch.empty(1, dtype=torch.uint8, device=device)
        if num_blocks:
            blocks = {"EXPERTS": experts, "BLOCK_T": _TABLE_BLOCK_T, "BLOCK_E": block_e}
            _block_counts_kernel[(num_blocks,)](selected, block_counts, tokens, **blocks)
            _routing_rows_kernel[(num_blocks,)](selected, probs.contiguous(), block_counts, counts, rows, row_probs, covered,
                                                tokens, num_rows, num_blocks, **blocks, CHUNK=_TABLE_CHUNK)
        else:
            counts.zero_()
            covered.fill_(num_rows == 0)
        torch._assert_async(covered.view(torch.bool), "the routing map does not select exactly top-k experts per token")
        ctx.save_for_backward(rows)
        ctx.mark_non_differentiable(rows, counts)
        return rows, counts, row_probs

    @staticmethod
    def backward(ctx, _grad_rows, _grad_counts, grad_row_probs):
        (rows,) = ctx.saved_tensors
        selected = rows >= 0
        return None, torch.where(selected, grad_row_probs[rows.clamp_min(0).long()], 0.0), None


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, rows, num_rows, rows_gradient):
        ctx.save_for_backward(rows)
        ctx.rows_gradient = rows_gradient
        return _copy_to_rows(tokens, rows, num_rows)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        if ctx.rows_gradient is None:
            return _sum_rows(grad, rows), None, None, None
        # fan_out's backward runs after this one (autograd waits for every use of its aliases) and sums these rows.
        ctx.rows_gradient.grad, ctx.rows_gradient.rows = grad, rows
        return None, None, None, None


class _FanOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, rows_gradient, uses):
        ctx.rows_gradient = rows_gradient
        ctx.set_materialize_grads(False)
        return tuple(tokens.view_as(tokens) for _ in range(uses))

    @staticmethod
    def backward(ctx, *grads):
        grad_rows, rows = ctx.rows_gradient.take()
        addends = tuple(grad for grad in grads if grad is not None)
        if grad_rows is not None:
            return _sum_rows(grad_rows, rows, addends), None, None
        if not addends:
            return None, None, None
        total = addends[0].float()
        for grad in addends[1:]:
            total += grad
        return total.to(addends[0].dtype), None, None


class _UnpermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, rows, addend):
        ctx.save_for_backward(rows)
        ctx.num_rows = permuted.shape[0]
        return _sum_rows(permuted, rows, () if addend is None else (addend,))

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return _copy_to_rows(grad, rows, ctx.num_rows), None, grad if ctx.needs_input_grad[2] else None


@triton.jit
def _copy_to_rows_kernel(src_ptr, out_ptr, rows_ptr, hidden, EXPERTS: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    values = tl.load(src_ptr + token.to(tl.int64) * hidden + cols, mask=in_row)
    for expert in range(EXPERTS):
        row = tl.load(rows_ptr + token * EXPERTS + expert)
        if row >= 0:
            tl.store(out_ptr + row.to(tl.int64) * hidden + cols, values, mask=in_row)


@triton.jit
def _sum_rows_kernel(src_ptr, addend0_ptr, addend1_ptr, addend2_ptr, out_ptr, rows_ptr, hidden, EXPERTS: tl.constexpr,
                     BLOCK_H: tl.constexpr, ADDENDS: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    at = token.to(tl.int64) * hidden + cols
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    if ADDENDS > 0:
        total += tl.load(addend0_ptr + at, mask=in_row, other=0.0).to(tl.float32)
    if ADDENDS > 1:
        total += tl.load(addend1_ptr + at, mask=in_row, other=0.0).to(tl.float32)
    if ADDENDS > 2:
        total += tl.load(addend2_ptr + at, mask=in_row, other=0.0).to(tl.float32)
    for expert in range(EXPERTS):
        row = tl.load(rows_ptr + token * EXPERTS + expert)
        if row >= 0:
            total += tl.load(src_ptr + row.to(tl.int64) * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _block_counts_kernel(selected_ptr, block_counts_ptr, tokens, EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr):
    """Each expert's selected tokens in one block of BLOCK_T tokens (padding experts count 0)."""
    block = tl.program_id(0)
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    es = tl.arange(0, BLOCK_E)
    inside = (t[:, None] < tokens) & (es[None, :] < EXPERTS)
    picked = tl.load(selected_ptr + t.to(tl.int64)[:, None] * EXPERTS + es[None, :], mask=inside, other=0).to(tl.int32)
    tl.store(block_counts_ptr + block * BLOCK_E + es, tl.sum(picked, axis=0))


@triton.jit
def _routing_rows_kernel(selected_ptr, probs_ptr, block_counts_ptr, counts_ptr, rows_ptr, row_probs_ptr, covered_ptr,
                         tokens, num_rows, num_blocks, EXPERTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                         CHUNK: tl.constexpr):
    """One block of tokens: a selected pair's row is its expert's start (all earlier experts' tokens) plus the expert's
    tokens in earlier blocks plus its rank among the block's own, so every block runs at once."""
    block = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    earlier = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK):
        bs = start + tl.arange(0, CHUNK)
        counts = tl.load(block_counts_ptr + bs[:, None] * BLOCK_E + es[None, :], mask=bs[:, None] < num_blocks, other=0)
        total += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where(bs[:, None] < block, counts, 0), axis=0)
    if block == 0:
        tl.store(counts_ptr + es, total.to(tl.int64), mask=es < EXPERTS)
        tl.store(covered_ptr, (tl.sum(total, axis=0) == num_rows).to(tl.uint8))
    first = tl.cumsum(total, axis=0) - total + earlier
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = (t[:, None] < tokens) & (es[None, :] < EXPERTS)
    at = t.to(tl.int64)[:, None] * EXPERTS + es[None, :]
    picked = tl.load(selected_ptr + at, mask=inside, other=0).to(tl.int32)
    row = first[None, :] + tl.cumsum(picked, axis=0) - 1
    tl.store(rows_ptr + at, tl.where(picked > 0, row, -1), mask=inside)
    # A map selecting more than num_rows pairs fails the device assertion; its excess rows are not written meanwhile.
    take = inside & (picked > 0) & (row < num_rows)
    tl.store(row_probs_ptr + row, tl.load(probs_ptr + at, mask=take, other=0.0), mask=take)
