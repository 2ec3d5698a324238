"""The n-gram hash contract both implementations share: the hash constants and the checks of every input
(shapes, dtypes, devices, and the value bounds that keep the int64 hash exact). See the package docstring."""

from __future__ import annotations

import torch

# Tokens and hash constants stay below 2**31 so that a token * multiplier product fits in int64 (< 2**62).
HASH_VALUE_LIMIT = 2**31


def make_hash_params(orders: tuple[int, ...], num_heads: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The hash constants for ``orders`` x ``num_heads`` hash functions, on CPU, the same for the same seed.

    Returns ``(mult, offset)``: ``mult`` int64 [len(orders), num_heads, max(orders)] of odd values in
    [1, 2**31), ``offset`` int64 [len(orders), num_heads] in [0, 2**31). Move them to the tokens' device.
    """
    orders = check_orders(orders)
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (len(orders), num_heads, max(orders))
    mult = torch.randint(0, HASH_VALUE_LIMIT // 2, shape, generator=generator, dtype=torch.int64) * 2 + 1
    offset = torch.randint(0, HASH_VALUE_LIMIT, shape[:2], generator=generator, dtype=torch.int64)
    return mult, offset


def check_orders(orders: tuple[int, ...]) -> tuple[int, ...]:
    if not isinstance(orders, (tuple, list)) or not orders or not all(isinstance(n, int) and n >= 1 for n in orders):
        raise ValueError(f"orders must be a non-empty tuple of ints >= 1, got {orders!r}")
    return tuple(orders)


def check_hash_inputs(tokens: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor) -> tuple[int, ...]:
    orders = check_orders(orders)
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


def check_embed_inputs(
    tokens: torch.Tensor, tables: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor
) -> tuple[int, ...]:
    if not isinstance(tables, torch.Tensor):
        raise TypeError(f"tables must be a torch.Tensor, got {type(tables).__name__}")
    if not tables.dtype.is_floating_point:
        raise TypeError(f"tables must be floating point, got {tables.dtype}")
    if tables.ndim != 3:
        raise ValueError(f"tables must be [len(orders), table_size, embed_dim], got shape {tuple(tables.shape)} (ndim {tables.ndim})")
    orders = check_orders(orders)
    if tables.shape[0] != len(orders):
        raise ValueError(f"tables has {tables.shape[0]} tables but orders {orders} needs {len(orders)}")
    if isinstance(tokens, torch.Tensor) and tables.device != tokens.device:
        raise ValueError(f"tables are on {tables.device} but tokens are on {tokens.device}")
    return check_hash_inputs(tokens, orders, mult, offset)


def check_proj_weight(tables: torch.Tensor, mult: torch.Tensor, proj_weight: torch.Tensor) -> None:
    if not isinstance(proj_weight, torch.Tensor):
        raise TypeError(f"proj_weight must be a torch.Tensor, got {type(proj_weight).__name__}")
    features = tables.shape[0] * mult.shape[1] * tables.shape[2] if tables.ndim == 3 and mult.ndim == 3 else None
    if proj_weight.ndim != 2 or proj_weight.shape[1] != features:
        raise ValueError(f"proj_weight must be [hidden, O*H*D = {features}], got shape {tuple(proj_weight.shape)}")
    if proj_weight.dtype != tables.dtype or proj_weight.device != tables.device:
        raise ValueError(
            f"proj_weight ({proj_weight.dtype}, {proj_weight.device}) must match the tables ({tables.dtype}, {tables.device})"
        )
