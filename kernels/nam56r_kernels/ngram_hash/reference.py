"""The PyTorch reference of the n-gram hash embedding: the hash in int64 tensor ops, the gather with
index_select and masking, the projection with ``F.linear``. Runs on any device; autograd flows into the
tables (and the projection weight)."""

from __future__ import annotations

import torch

from nam56r_kernels.ngram_hash.contract import check_embed_inputs, check_hash_inputs, check_proj_weight


def ngram_hash_ids(
    tokens: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor, table_size: int
) -> torch.Tensor:
    """Row ids int64 [b, s, len(orders), H] into each order's table, -1 where t < n - 1 (see the package docstring)."""
    orders = check_hash_inputs(tokens, orders, mult, offset)
    if not isinstance(table_size, int) or table_size < 1:
        raise ValueError(f"table_size must be a positive int, got {table_size!r}")
    return _hash_ids(tokens, orders, mult, offset, table_size)


def ngram_hash_embed_reference(
    tokens: torch.Tensor, tables: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """N-gram hash embeddings [b, s, O*H*D] with index_select and masking; autograd flows into ``tables``."""
    orders = check_embed_inputs(tokens, tables, orders, mult, offset)
    num_orders, table_size, dim = tables.shape
    ids = _hash_ids(tokens, orders, mult, offset, table_size)  # [b, s, O, H]
    valid = ids >= 0
    # One index_select over the stacked tables: order o's rows start at o * T.
    row_base = torch.arange(num_orders, device=ids.device, dtype=torch.int64).view(1, 1, num_orders, 1) * table_size
    rows = torch.where(valid, ids + row_base, 0)
    gathered = tables.reshape(num_orders * table_size, dim).index_select(0, rows.reshape(-1)).view(*ids.shape, dim)
    out = torch.where(valid.unsqueeze(-1), gathered, torch.zeros((), dtype=tables.dtype, device=tables.device))
    return out.reshape(tokens.shape[0], tokens.shape[1], -1)


def ngram_hash_project_reference(
    tokens: torch.Tensor,
    tables: torch.Tensor,
    orders: tuple[int, ...],
    mult: torch.Tensor,
    offset: torch.Tensor,
    proj_weight: torch.Tensor,
) -> torch.Tensor:
    """``F.linear(ngram_hash_embed_reference(...), proj_weight)``: [b, s, hidden]; proj_weight is [hidden, O*H*D]."""
    check_proj_weight(tables, mult, proj_weight)
    return torch.nn.functional.linear(ngram_hash_embed_reference(tokens, tables, orders, mult, offset), proj_weight)


def _hash_ids(tokens: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor, table_size: int) -> torch.Tensor:
    batch, seq = tokens.shape
    per_order = []
    for o, n in enumerate(orders):
        acc = offset[o].remainder(table_size).expand(batch, seq, -1)  # [b, s, H]
        for i in range(n):
            # tokens[t - i]; the zero padding only reaches positions t < i, which are masked below.
            shifted = torch.nn.functional.pad(tokens, (i, 0))[:, :seq]
            acc = (acc + (shifted.unsqueeze(-1) * mult[o, :, i]).remainder(table_size)).remainder(table_size)
        acc = acc.clone()
        acc[:, : n - 1] = -1
        per_order.append(acc)
    return torch.stack(per_order, dim=2)

