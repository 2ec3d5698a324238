"""nam56r_kernels.ngram_hash: the hash ids and the embedding against plain Python loops, the projection as
the embedding then a linear layer, and the errors that name a bad input."""

from __future__ import annotations

import pytest
import torch
from nam56r_kernels.ngram_hash import make_hash_params, ngram_hash_embed, ngram_hash_ids, ngram_hash_project


def naive_embed(
    tokens: torch.Tensor, tables: torch.Tensor, orders: tuple[int, ...], mult: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """The contract spelled out with Python ints (no int64 wrap-around to hide) and one row at a time."""
    batch, seq = tokens.shape
    _, table_size, dim = tables.shape
    tok, mul, off = tokens.tolist(), mult.tolist(), offset.tolist()
    rows = []
    for b in range(batch):
        for t in range(seq):
            for o, n in enumerate(orders):
                for h in range(mult.shape[1]):
                    if t < n - 1:
                        rows.append(torch.zeros(dim, dtype=tables.dtype))
                        continue
                    row = (sum(tok[b][t - i] * mul[o][h][i] for i in range(n)) + off[o][h]) % table_size
                    rows.append(tables[o, row])
    return torch.stack(rows).view(batch, seq, -1)


def random_case(seed: int, batch: int = 2, seq: int = 9, orders: tuple[int, ...] = (2, 3), heads: int = 3, rows: int = 37, dim: int = 4):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (batch, seq), generator=generator)
    tables = torch.randn(len(orders), rows, dim, generator=generator, requires_grad=True)
    mult, offset = make_hash_params(orders, heads, seed=seed)
    return tokens, tables, orders, mult, offset


# ---------------------------------------------------------------------------- hash params and ids


def test_hash_params_are_deterministic_odd_and_in_range() -> None:
    mult, offset = make_hash_params((2, 3), 8, seed=0)
    again_mult, again_offset = make_hash_params((2, 3), 8, seed=0)
    other_mult, _ = make_hash_params((2, 3), 8, seed=1)
    assert mult.shape == (2, 8, 3) and offset.shape == (2, 8)
    assert mult.dtype == offset.dtype == torch.int64
    assert torch.equal(mult, again_mult) and torch.equal(offset, again_offset)
    assert not torch.equal(mult, other_mult)
    assert bool((mult % 2 == 1).all()) and int(mult.max()) < 2**31 and int(offset.min()) >= 0 and int(offset.max()) < 2**31


def test_ids_match_a_hand_computed_example() -> None:
    tokens = torch.tensor([[5, 7, 11]])
    mult = torch.tensor([[[3, 5], [1, 9]]])  # one order, two heads; mult[o, h, i] multiplies tokens[t - i]
    offset = torch.tensor([[1, 4]])
    ids = ngram_hash_ids(tokens, (2,), mult, offset, table_size=10)
    # t=1: head 0: 7*3 + 5*5 + 1 = 47 -> 7; head 1: 7*1 + 5*9 + 4 = 56 -> 6
    # t=2: head 0: 11*3 + 7*5 + 1 = 69 -> 9; head 1: 11*1 + 7*9 + 4 = 78 -> 8
    assert ids.tolist() == [[[[-1, -1]], [[7, 6]], [[9, 8]]]]


def test_ids_are_minus_one_before_the_ngram_fits_and_in_table_elsewhere() -> None:
    tokens = torch.randint(0, 256_000, (3, 40), generator=torch.Generator().manual_seed(0))
    orders = (1, 2, 4)
    mult, offset = make_hash_params(orders, 5)
    ids = ngram_hash_ids(tokens, orders, mult, offset, table_size=1009)
    assert ids.shape == (3, 40, 3, 5)
    for o, n in enumerate(orders):
        assert bool((ids[:, : n - 1, o] == -1).all())
        assert bool(((ids[:, n - 1 :, o] >= 0) & (ids[:, n - 1 :, o] < 1009)).all())


def test_ids_are_exact_at_the_largest_allowed_values() -> None:
    # Three products near 2**62 would wrap an int64 sum; the contract is the exact integer result mod T.
    tokens = torch.full((1, 4), 2**31 - 1)
    mult = torch.full((1, 2, 3), 2**31 - 1)
    mult[0, 1, 1] = 2**31 - 3
    offset = torch.tensor([[2**31 - 1, 12345]])
    table_size = 2**31 - 19
    ids = ngram_hash_ids(tokens, (3,), mult, offset, table_size)
    for h in range(2):
        expected = (sum((2**31 - 1) * int(mult[0, h, i]) for i in range(3)) + int(offset[0, h])) % table_size
        assert ids[0, 2:, 0, h].tolist() == [expected, expected]


# ---------------------------------------------------------------------------- embedding


@pytest.mark.parametrize("seed", [0, 1])
def test_embedding_matches_the_naive_loops_forward_and_backward(seed: int) -> None:
    tokens, tables, orders, mult, offset = random_case(seed)
    out = ngram_hash_embed(tokens, tables, orders, mult, offset)
    expected = naive_embed(tokens, tables, orders, mult, offset)
    assert out.shape == (2, 9, 2 * 3 * 4) and out.dtype == tables.dtype
    assert torch.equal(out, expected)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100))
    (grad,) = torch.autograd.grad(out, tables, grad_out)
    (expected_grad,) = torch.autograd.grad(expected, tables, grad_out)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_embedding_is_exactly_zero_where_the_ngram_does_not_fit() -> None:
    tokens, tables, orders, mult, offset = random_case(0)
    with torch.no_grad():
        tables += 10.0  # no row is zero, so a zero can only come from the mask
    out = ngram_hash_embed(tokens, tables, orders, mult, offset).view(2, 9, len(orders), 3, 4)
    assert bool((out[:, 0] == 0).all())  # t=0: neither the bigram nor the trigram fits
    assert bool((out[:, 1, 1] == 0).all()) and bool((out[:, 1, 0] != 0).all())  # t=1: the bigram fits, the trigram does not
    assert bool((out[:, 2:] != 0).all())


# ---------------------------------------------------------------------------- projection


def test_projection_is_the_embedding_then_a_linear_layer() -> None:
    tokens, tables, orders, mult, offset = random_case(0)
    weight = torch.randn(10, tables.shape[0] * mult.shape[1] * tables.shape[2])
    features = ngram_hash_embed(tokens, tables, orders, mult, offset)
    assert torch.equal(ngram_hash_project(tokens, tables, orders, mult, offset, weight), features @ weight.T)


def test_projection_refuses_a_weight_of_the_wrong_width_or_dtype() -> None:
    tokens, tables, orders, mult, offset = random_case(0)
    with pytest.raises(ValueError, match=r"proj_weight must be \[hidden, O\*H\*D = 24\], got shape \(10, 23\)"):
        ngram_hash_project(tokens, tables, orders, mult, offset, torch.randn(10, 23))
    with pytest.raises(ValueError, match=r"proj_weight \(torch.float64, cpu\) must match the tables \(torch.float32, cpu\)"):
        ngram_hash_project(tokens, tables, orders, mult, offset, torch.randn(10, 24, dtype=torch.float64))


# ---------------------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_naming_the_offending_value() -> None:
    tokens, tables, orders, mult, offset = random_case(0)

    negative = tokens.clone()
    negative[1, 4] = -3
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 2\*\*31\), got -3 at tokens\[1, 4\]"):
        ngram_hash_embed(negative, tables, orders, mult, offset)

    too_large = tokens.clone()
    too_large[0, 2] = 2**31
    with pytest.raises(ValueError, match=r"got 2147483648 at tokens\[0, 2\]"):
        ngram_hash_embed(too_large, tables, orders, mult, offset)

    with pytest.raises(TypeError, match=r"tokens must be int64, got torch.float32"):
        ngram_hash_embed(tokens.float(), tables, orders, mult, offset)

    with pytest.raises(ValueError, match=r"tables must be \[len\(orders\), table_size, embed_dim\], got shape \(2, 37\)"):
        ngram_hash_embed(tokens, tables[:, :, 0], orders, mult, offset)

    with pytest.raises(TypeError, match=r"tables must be floating point, got torch.int64"):
        ngram_hash_embed(tokens, tables.detach().long(), orders, mult, offset)

    with pytest.raises(ValueError, match=r"tables has 2 tables but orders \(2, 3, 4\) needs 3"):
        ngram_hash_embed(tokens, tables, (2, 3, 4), mult, offset)

    with pytest.raises(ValueError, match=r"mult must be .* got shape \(2, 3, 2\)"):
        ngram_hash_embed(tokens, tables, orders, mult[:, :, :2], offset)

    with pytest.raises(ValueError, match=r"offset must be \[len\(orders\), heads\] = \(2, 3\), got shape \(2, 2\)"):
        ngram_hash_embed(tokens, tables, orders, mult, offset[:, :2])


def test_ids_reject_a_bad_table_size_and_bad_orders() -> None:
    tokens = torch.zeros(1, 4, dtype=torch.int64)
    mult, offset = make_hash_params((2,), 1)
    with pytest.raises(ValueError, match=r"table_size must be a positive int, got 0"):
        ngram_hash_ids(tokens, (2,), mult, offset, 0)
    with pytest.raises(ValueError, match=r"orders must be a non-empty tuple of ints >= 1, got \(0,\)"):
        ngram_hash_ids(tokens, (0,), mult, offset, 7)
