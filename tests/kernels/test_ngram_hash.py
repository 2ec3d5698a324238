"""nam56r_kernels.ngram_hash: the hash ids and the reference against plain Python loops, the fused Triton
kernel against the reference (under Triton's CPU interpreter here, on a GPU where there is one), and the
seam's errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels.ngram_hash import (
    make_hash_params,
    ngram_hash_embed_fused,
    ngram_hash_embed_reference,
    ngram_hash_ids,
    ngram_hash_project_fused,
    ngram_hash_project_reference,
)


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


# ---------------------------------------------------------------------------- reference


@pytest.mark.parametrize("seed", [0, 1])
def test_reference_matches_the_naive_loops_forward_and_backward(seed: int) -> None:
    tokens, tables, orders, mult, offset = random_case(seed)
    out = ngram_hash_embed_reference(tokens, tables, orders, mult, offset)
    expected = naive_embed(tokens, tables, orders, mult, offset)
    assert out.shape == (2, 9, 2 * 3 * 4) and out.dtype == tables.dtype
    assert torch.equal(out, expected)

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100))
    (grad,) = torch.autograd.grad(out, tables, grad_out)
    (expected_grad,) = torch.autograd.grad(expected, tables, grad_out)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_reference_is_exactly_zero_where_the_ngram_does_not_fit() -> None:
    tokens, tables, orders, mult, offset = random_case(0)
    with torch.no_grad():
        tables += 10.0  # no row is zero, so a zero can only come from the mask
    out = ngram_hash_embed_reference(tokens, tables, orders, mult, offset).view(2, 9, len(orders), 3, 4)
    assert bool((out[:, 0] == 0).all())  # t=0: neither the bigram nor the trigram fits
    assert bool((out[:, 1, 1] == 0).all()) and bool((out[:, 1, 0] != 0).all())  # t=1: the bigram fits, the trigram does not
    assert bool((out[:, 2:] != 0).all())


# ---------------------------------------------------------------------------- fused, on Triton's CPU interpreter

# TRITON_INTERPRET must be set before triton is imported, so the comparison runs in a fresh interpreter.
INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.ngram_hash import make_hash_params, ngram_hash_embed_fused, ngram_hash_embed_reference

    def compare(batch, seq, orders, heads, rows, dim, dtype, seed, extreme=False):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 50_000, (batch, seq), generator=g)
        tables = torch.randn(len(orders), rows, dim, generator=g).to(dtype).requires_grad_()
        mult, offset = make_hash_params(orders, heads, seed=seed)
        if extreme:  # tokens and multipliers near 2**31: a plain int64 sum of the products would wrap
            tokens = 2**31 - 1 - torch.randint(0, 100, tokens.shape, generator=g)
            mult = 2**31 - 1 - 2 * torch.randint(0, 100, mult.shape, generator=g)
        ref = ngram_hash_embed_reference(tokens, tables, orders, mult, offset)
        fused = ngram_hash_embed_fused(tokens, tables, orders, mult, offset)
        assert fused.dtype == dtype and fused.shape == ref.shape, (fused.dtype, fused.shape, ref.shape)
        assert torch.equal(fused, ref), (fused - ref).abs().max()
        grad_out = torch.randn(ref.shape, generator=g).to(dtype)
        (grad_fused,) = torch.autograd.grad(fused, tables, grad_out)
        # Ground truth: the reference in fp32, as the fused backward accumulates in fp32.
        tables32 = tables.detach().float().requires_grad_()
        ref32 = ngram_hash_embed_reference(tokens, tables32, orders, mult, offset)
        (grad_ref,) = torch.autograd.grad(ref32, tables32, grad_out.float())
        assert grad_fused.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(grad_fused.float(), grad_ref.to(dtype).float(), rtol=tol, atol=tol)
        print("ok", batch, seq, orders, heads, rows, dim, dtype)

    compare(2, 9, (2, 3), 3, 37, 4, torch.float32, seed=0)   # 37 rows for 48 bigram and 42 trigram lookups: rows collide
    compare(2, 9, (2, 3), 3, 37, 4, torch.float32, seed=1)
    compare(3, 50, (1, 2, 4), 2, 11, 5, torch.float32, seed=2)  # dim not a power of 2, 150 tokens > one block
    compare(2, 9, (2, 3), 3, 37, 4, torch.bfloat16, seed=3)
    compare(2, 9, (2, 3), 3, 37, 4, torch.float32, seed=4, extreme=True)
    """
)


def test_fused_matches_reference_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(INTERPRETER_SCRIPT, timeout=120)
    assert stdout.count("ok ") == 5, stdout


# Hash + gather + projection in one kernel. fp32 only on the CPU: Triton 3.6's interpreter multiplies bf16
# tiles as raw bits; the GPU test below covers bf16 at NAM56R's size.
PROJECT_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.ngram_hash import make_hash_params, ngram_hash_project_fused, ngram_hash_project_reference

    def compare(batch, seq, orders, heads, rows, dim, hidden, seed):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 50_000, (batch, seq), generator=g)
        tables = torch.randn(len(orders), rows, dim, generator=g).requires_grad_()
        weight = (0.1 * torch.randn(hidden, len(orders) * heads * dim, generator=g)).requires_grad_()
        mult, offset = make_hash_params(orders, heads, seed=seed)
        ref = ngram_hash_project_reference(tokens, tables, orders, mult, offset, weight)
        fused = ngram_hash_project_fused(tokens, tables, orders, mult, offset, weight)
        assert fused.shape == (batch, seq, hidden) and fused.dtype == torch.float32
        torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
        grad_out = torch.randn(ref.shape, generator=g)
        for got, want, name in zip(torch.autograd.grad(fused, (tables, weight), grad_out),
                                   torch.autograd.grad(ref, (tables, weight), grad_out), ("tables", "weight")):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=name)
        print("ok", batch, seq, orders, heads, rows, dim, hidden)

    compare(2, 9, (2, 3), 3, 37, 4, 70, seed=0)       # 6 (order, head) pairs padded to 8, dim 4 padded to 16, rows collide
    compare(2, 40, (2, 3), 8, 37, 16, 128, seed=1)    # NAM56R's pairs and dim; 80 tokens over three token blocks
    compare(1, 33, (1, 2, 4), 2, 11, 5, 20, seed=2)   # hidden below one column tile
    """
)


def test_fused_projection_matches_reference_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(PROJECT_SCRIPT, timeout=120)
    assert stdout.count("ok ") == 3, stdout


def test_projection_reference_is_the_embedding_then_a_linear_layer() -> None:
    tokens, tables, orders, mult, offset = random_case(0)
    weight = torch.randn(10, tables.shape[0] * mult.shape[1] * tables.shape[2])
    features = ngram_hash_embed_reference(tokens, tables, orders, mult, offset)
    assert torch.equal(ngram_hash_project_reference(tokens, tables, orders, mult, offset, weight), features @ weight.T)


@pytest.mark.parametrize("project", [ngram_hash_project_reference, ngram_hash_project_fused])
def test_projection_refuses_a_weight_of_the_wrong_width_or_dtype(project) -> None:
    tokens, tables, orders, mult, offset = random_case(0)
    with pytest.raises(ValueError, match=r"proj_weight must be \[hidden, O\*H\*D = 24\], got shape \(10, 23\)"):
        project(tokens, tables, orders, mult, offset, torch.randn(10, 23))
    with pytest.raises(ValueError, match=r"proj_weight \(torch.float64, cpu\) must match the tables \(torch.float32, cpu\)"):
        project(tokens, tables, orders, mult, offset, torch.randn(10, 24, dtype=torch.float64))


# ---------------------------------------------------------------------------- the seam


def test_fused_refuses_cpu_tensors_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tokens, tables, orders, mult, offset = random_case(0)
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors, got device cpu; use ngram_hash_embed_reference for CPU"):
        ngram_hash_embed_fused(tokens, tables, orders, mult, offset)
    weight = torch.randn(10, 24)
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors, got device cpu; use ngram_hash_project_reference for CPU"):
        ngram_hash_project_fused(tokens, tables, orders, mult, offset, weight)


@pytest.mark.parametrize("embed", [ngram_hash_embed_reference, ngram_hash_embed_fused])
def test_bad_inputs_raise_naming_the_offending_value(embed) -> None:
    tokens, tables, orders, mult, offset = random_case(0)

    negative = tokens.clone()
    negative[1, 4] = -3
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 2\*\*31\), got -3 at tokens\[1, 4\]"):
        embed(negative, tables, orders, mult, offset)

    too_large = tokens.clone()
    too_large[0, 2] = 2**31
    with pytest.raises(ValueError, match=r"got 2147483648 at tokens\[0, 2\]"):
        embed(too_large, tables, orders, mult, offset)

    with pytest.raises(TypeError, match=r"tokens must be int64, got torch.float32"):
        embed(tokens.float(), tables, orders, mult, offset)

    with pytest.raises(ValueError, match=r"tables must be \[len\(orders\), table_size, embed_dim\], got shape \(2, 37\)"):
        embed(tokens, tables[:, :, 0], orders, mult, offset)

    with pytest.raises(TypeError, match=r"tables must be floating point, got torch.int64"):
        embed(tokens, tables.detach().long(), orders, mult, offset)

    with pytest.raises(ValueError, match=r"tables has 2 tables but orders \(2, 3, 4\) needs 3"):
        embed(tokens, tables, (2, 3, 4), mult, offset)

    with pytest.raises(ValueError, match=r"mult must be .* got shape \(2, 3, 2\)"):
        embed(tokens, tables, orders, mult[:, :, :2], offset)

    with pytest.raises(ValueError, match=r"offset must be \[len\(orders\), heads\] = \(2, 3\), got shape \(2, 2\)"):
        embed(tokens, tables, orders, mult, offset[:, :2])


def test_ids_reject_a_bad_table_size_and_bad_orders() -> None:
    tokens = torch.zeros(1, 4, dtype=torch.int64)
    mult, offset = make_hash_params((2,), 1)
    with pytest.raises(ValueError, match=r"table_size must be a positive int, got 0"):
        ngram_hash_ids(tokens, (2,), mult, offset, 0)
    with pytest.raises(ValueError, match=r"orders must be a non-empty tuple of ints >= 1, got \(0,\)"):
        ngram_hash_ids(tokens, (0,), mult, offset, 7)


# ---------------------------------------------------------------------------- fused on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the fused kernel at NAM56R's size runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_reference_on_gpu_at_nam56r_size(dtype: torch.dtype) -> None:
    batch, seq, orders, heads, rows, dim = 2, 4096, (2, 3), 8, 500_000, 16
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, 256_000, (batch, seq), device="cuda", generator=generator)
    # A few repeated n-grams so that rows really collide in the backward's atomics.
    tokens[1, 100:200] = tokens[0, 100:200]
    tables = torch.randn(len(orders), rows, dim, device="cuda", generator=generator).to(dtype).requires_grad_()
    mult, offset = (p.cuda() for p in make_hash_params(orders, heads))

    ref = ngram_hash_embed_reference(tokens, tables, orders, mult, offset)
    fused = ngram_hash_embed_fused(tokens, tables, orders, mult, offset)
    assert fused.dtype == dtype and fused.shape == (batch, seq, len(orders) * heads * dim)
    assert torch.equal(fused, ref)  # a gather is a copy: bitwise equal

    grad_out = torch.randn(ref.shape, device="cuda", generator=generator).to(dtype)
    (grad_fused,) = torch.autograd.grad(fused, tables, grad_out)
    tables32 = tables.detach().float().requires_grad_()
    (grad_ref,) = torch.autograd.grad(ngram_hash_embed_reference(tokens, tables32, orders, mult, offset), tables32, grad_out.float())
    assert grad_fused.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(grad_fused.float(), grad_ref.to(dtype).float(), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the fused kernel at NAM56R's size runs on CUDA only")
def test_fused_projection_matches_reference_on_gpu_at_nam56r_size() -> None:
    # NAM56R: orders (2, 3), 8 heads, 500k rows of 16, hidden 4096; bf16 as trained, compared with an fp32 reference.
    batch, seq, orders, heads, rows, dim, hidden = 2, 4096, (2, 3), 8, 500_000, 16, 4096
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, 131_072, (batch, seq), device="cuda", generator=generator)
    tokens[1, 100:200] = tokens[0, 100:200]
    tables = torch.randn(len(orders), rows, dim, device="cuda", generator=generator).bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(hidden, len(orders) * heads * dim, device="cuda", generator=generator)).bfloat16().requires_grad_()
    mult, offset = (p.cuda() for p in make_hash_params(orders, heads))
    fused = ngram_hash_project_fused(tokens, tables, orders, mult, offset, weight)
    tables32, weight32 = (t.detach().float().requires_grad_() for t in (tables, weight))
    ref = ngram_hash_project_reference(tokens, tables32, orders, mult, offset, weight32)
    out_err = ((fused.float() - ref).abs().max() / ref.abs().max()).item()
    grad_out = torch.randn(ref.shape, device="cuda", generator=generator).bfloat16()
    got = torch.autograd.grad(fused, (tables, weight), grad_out)
    want = torch.autograd.grad(ref, (tables32, weight32), grad_out.float())
    errs = [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want, strict=True)]
    assert out_err < 1e-2 and max(errs) < 1e-2, (out_err, errs)
    print(f"NGRAM_PROJECT_GPU_OK out_rel_err={out_err:.2e} dtables_rel_err={errs[0]:.2e} dweight_rel_err={errs[1]:.2e}")
