"""N-gram hash embeddings for NAM56R, in PyTorch: the hash in int64 tensor ops, the gather with index_select
and masking, the projection to the model's hidden size with ``F.linear`` (cuBLAS). Runs on any device;
autograd flows into the tables and the projection weight.

Why: NAM56R adds to each token's embedding the embeddings of the n-grams ending at that token. A table
per n-gram would be vocab**n rows, so each n-gram is hashed into a fixed table instead, and several
independent hash functions ("heads") per order make collisions unlikely to hit the same rows for all
heads at once.

Contract:

- ``tokens``: int64 [b, s], values in [0, 2**31) (token ids; the bound keeps every product below 2**62).
- ``orders``: n-gram orders, e.g. ``(2, 3)``; O = len(orders). Each order n >= 1.
- ``mult``: int64 [O, H, max_order], ``offset``: int64 [O, H], values in [0, 2**31). H = heads per order.
  ``make_hash_params`` makes them deterministically from a seed (odd multipliers).
- ``tables``: floating [O, T, D]; the H heads of order o all hash into ``tables[o]`` (T rows).
- Hash of the n-gram of order n = orders[o] ending at position t, head h::

      id(o, h, t) = (sum_{i=0}^{n-1} tokens[t - i] * mult[o, h, i] + offset[o, h]) mod T

  computed exactly in int64 (each product is reduced mod T before it is added, so no sum overflows).
- Positions t < n - 1 (the n-gram would start before the sequence) have no id (-1 in
  ``ngram_hash_ids``): they contribute zeros to the output and no gradient to the tables.
- ``ngram_hash_embed``: [b, s, O * H * D] in the tables' dtype, order-major, then head, then dim:
  ``out[b, t, (o*H + h)*D : (o*H + h + 1)*D] = tables[o, id(o, h, t)]`` (or zeros where there is no id).
- ``ngram_hash_project``: those features projected to the hidden size, ``features @ proj_weight.T``
  with ``proj_weight`` [hidden, O*H*D]: [b, s, hidden].

Every input is checked (shapes, dtypes, devices, and the value bounds that keep the int64 hash exact); a
bad one raises naming the offending value.
"""

from __future__ import annotations

import torch

# Tokens and hash constants stay below 2**31 so that a token * multiplier product fits in int64 (< 2**62).
HASH_VALUE_LIMIT = 2**31


def make_hash_params(orders: tuple[int, ...], num_heads: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The hash constants for ``orders`` x ``num_heads`` hash functions, on CPU, the same for the same seed.

    Returns ``(mult, offset)``: ``mult`` int64 [len(orders), num_heads, max(orders)] of odd values in
    [1, 2**31), ``offset`` int64 [len(orders), num_heads] in [0, 2**31). Move them to the tokens' device.
    """
    orders = _check_orders(orders)
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (len(orders), num_heads, max(orders))
    mult = torch.randint(0, HASH_VALUE_LIMIT // 2, shape, generator=generator, dtype=torch.int64) * 2 + 1
    offset = torch.randint(0, HASH_VALUE_LIMIT, shape[:2], generator=generator, dtype=torch.int64)
    return mult, offset


def ngram_hash_ids(
    tokens: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor, table_size: int
) -> torch.Tensor:
    """Row ids int64 [b, s, len(orders), H] into each order's table, -1 where t < n - 1 (see the module docstring)."""
    orders = _check_hash_inputs(tokens, orders, mult, offset)
    if not isinstance(table_size, int) or table_size < 1:
        raise ValueError(f"table_size must be a positive int, got {table_size!r}")
    return _hash_ids(tokens, orders, mult, offset, table_size)


def ngram_hash_embed(
    tokens: torch.Tensor, tables: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """N-gram hash embeddings [b, s, O*H*D] with index_select and masking; autograd flows into ``tables``."""
    orders = _check_embed_inputs(tokens, tables, orders, mult, offset)
    num_orders, table_size, dim = tables.shape
    ids = _hash_ids(tokens, orders, mult, offset, table_size)  # [b, s, O, H]
    valid = ids >= 0
    # One index_select over the stacked tables: order o's rows start at o * T.
    row_base = torch.arange(num_orders, device=ids.device, dtype=torch.int64).view(1, 1, num_orders, 1) * table_size
    rows = torch.where(valid, ids + row_base, 0)
    gathered = tables.reshape(num_orders * table_size, dim).index_select(0, rows.reshape(-1)).view(*ids.shape, dim)
    out = torch.where(valid.unsqueeze(-1), gathered, torch.zeros((), dtype=tables.dtype, device=tables.device))
    return out.reshape(tokens.shape[0], tokens.shape[1], -1)


def ngram_hash_project(
    tokens: torch.Tensor,
    tables: torch.Tensor,
    orders: tuple[int, ...],
    mult: torch.Tensor,
    offset: torch.Tensor,
    proj_weight: torch.Tensor,
) -> torch.Tensor:
    """``F.linear(ngram_hash_embed(...), proj_weight)``: [b, s, hidden]; proj_weight is [hidden, O*H*D]."""
    _check_proj_weight(tables, mult, proj_weight)
    return torch.nn.functional.linear(ngram_hash_embed(tokens, tables, orders, mult, offset), proj_weight)


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


# ---------------------------------------------------------------------------- input checks


def _check_orders(orders: tuple[int, ...]) -> tuple[int, ...]:
    if not isinstance(orders, (tuple, list)) or not orders or not all(isinstance(n, int) and n >= 1 for n in orders):
        raise ValueError(f"orders must be a non-empty tuple of ints >= 1, got {orders!r}")
    return tuple(orders)


def _check_hash_inputs(tokens: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor) -> tuple[int, ...]:
    orders = _check_orders(orders)
    for name, value in (("tokens", tokens), ("mult", mult), ("offset", offset)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype != torch.int64:
            raise TypeError(f"{name} must be int64, got {value.dtype}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    if mult.ndim != 3 or mult.shape[0] != len(orders) or mult.shape[2] < max(orders):
        raise ValueError(f"mult must be [len(orders)={len(orders)}, heads, >= max(orders)={max(orders)}], got shape {tuple(mult.shape)}")
    if tuple(offset.shape) != tuple(mult.shape[:2]):
        raise ValueError(f"offset must be [len(orders), heads] = {tuple(mult.shape[:2])}, got shape {tuple(offset.shape)}")
    for name, value in (("mult", mult), ("offset", offset)):
        if value.device != tokens.device:
            raise ValueError(f"{name} is on {value.device} but tokens are on {tokens.device}; move the hash params with .to()")
    _check_value_ranges(tokens, mult, offset)
    return orders


def _check_value_ranges(tokens: torch.Tensor, mult: torch.Tensor, offset: torch.Tensor) -> None:
    # One host sync for all six bounds: the values decide whether the int64 hash can overflow.
    named = [("tokens", tokens), ("mult", mult), ("offset", offset)]
    named = [(name, value) for name, value in named if value.numel() > 0]
    if not named:
        return
    bounds = torch.stack([b for _, value in named for b in torch.aminmax(value)]).tolist()
    for k, (name, value) in enumerate(named):
        lo, hi = bounds[2 * k], bounds[2 * k + 1]
        if lo < 0 or hi >= HASH_VALUE_LIMIT:
            bad = lo if lo < 0 else hi
            where = tuple((value == bad).nonzero()[0].tolist())
            raise ValueError(f"{name} must be in [0, 2**31), got {bad} at {name}{list(where)}")


def _check_embed_inputs(
    tokens: torch.Tensor, tables: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor
) -> tuple[int, ...]:
    if not isinstance(tables, torch.Tensor):
        raise TypeError(f"tables must be a torch.Tensor, got {type(tables).__name__}")
    if not tables.dtype.is_floating_point:
        raise TypeError(f"tables must be floating point, got {tables.dtype}")
    if tables.ndim != 3:
        raise ValueError(f"tables must be [len(orders), table_size, embed_dim], got shape {tuple(tables.shape)} (ndim {tables.ndim})")
    orders = _check_orders(orders)
    if tables.shape[0] != len(orders):
        raise ValueError(f"tables has {tables.shape[0]} tables but orders {orders} needs {len(orders)}")
    if isinstance(tokens, torch.Tensor) and tables.device != tokens.device:
        raise ValueError(f"tables are on {tables.device} but tokens are on {tokens.device}")
    return _check_hash_inputs(tokens, orders, mult, offset)


def _check_proj_weight(tables: torch.Tensor, mult: torch.Tensor, proj_weight: torch.Tensor) -> None:
    if not isinstance(proj_weight, torch.Tensor):
        raise TypeError(f"proj_weight must be a torch.Tensor, got {type(proj_weight).__name__}")
    features = tables.shape[0] * mult.shape[1] * tables.shape[2] if tables.ndim == 3 and mult.ndim == 3 else None
    if proj_weight.ndim != 2 or proj_weight.shape[1] != features:
        raise ValueError(f"proj_weight must be [hidden, O*H*D = {features}], got shape {tuple(proj_weight.shape)}")
    if proj_weight.dtype != tables.dtype or proj_weight.device != tables.device:
        raise ValueError(
            f"proj_weight ({proj_weight.dtype}, {proj_weight.device}) must match the tables ({tables.dtype}, {tables.device})"
        )
