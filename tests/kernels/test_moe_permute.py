"""nam56r_kernels.moe_permute: the expert-order rows against Megatron's own unfused permute (same order, same
tokens and probs), the Triton kernels against the references under Triton's CPU interpreter (forward and
backward, bf16 and fp32, experts with no tokens), and the seam's errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels.moe_permute import expert_rows, permute_probs, permute_tokens_reference, unpermute_tokens_reference


def routing(tokens: int, experts: int, topk: int, seed: int, idle_experts: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """A dropless routing map (exactly topk experts per token, none of `idle_experts`) and its probs [T, E]."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, list(idle_experts)] = -1.0
    chosen = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.where(routing_map, torch.rand(tokens, experts, generator=g), torch.zeros(()))
    return routing_map, probs


def test_rows_are_megatrons_permutation_order(megatron_built) -> None:
    from megatron.core.transformer.moe.moe_utils import permute

    routing_map, probs = routing(37, 8, 3, seed=0, idle_experts=(5,))
    tokens = torch.randn(37, 16, generator=torch.Generator().manual_seed(1))
    num_rows = 37 * 3
    want_tokens, want_probs, sorted_indices, _, _ = permute(tokens, routing_map, probs=probs, num_out_tokens=num_rows)
    rows, per_expert = expert_rows(routing_map)
    assert rows.dtype == torch.int32 and rows.shape == (37, 8) and per_expert.tolist() == routing_map.sum(0).tolist()
    assert per_expert[5] == 0 and bool((rows[:, 5] == -1).all())
    assert sorted(rows[rows >= 0].tolist()) == list(range(num_rows))  # every row exactly once
    assert torch.equal(permute_tokens_reference(tokens, rows, num_rows), want_tokens)
    assert torch.equal(permute_probs(probs, rows, num_rows), want_probs)


def test_the_references_undo_each_other_and_sum_a_tokens_rows() -> None:
    routing_map, _ = routing(20, 6, 2, seed=2)
    rows, _ = expert_rows(routing_map)
    tokens = torch.randn(20, 8, generator=torch.Generator().manual_seed(3))
    permuted = permute_tokens_reference(tokens, rows, 40)
    torch.testing.assert_close(unpermute_tokens_reference(permuted, rows), 2 * tokens)


def test_the_probs_gradient_reaches_only_the_selected_pairs() -> None:
    routing_map, probs = routing(10, 4, 2, seed=4)
    rows, _ = expert_rows(routing_map)
    probs.requires_grad_()
    permute_probs(probs, rows, 20).sum().backward()
    assert torch.equal(probs.grad, routing_map.float())


KERNEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.moe_permute import (expert_rows, permute_tokens, permute_tokens_reference, unpermute_tokens,
                                            unpermute_tokens_reference)
    from tests.kernels.test_moe_permute import routing

    for dtype in (torch.float32, torch.bfloat16):
        routing_map, _ = routing(29, 8, 3, seed=5, idle_experts=(2, 6))
        rows, _ = expert_rows(routing_map)
        num_rows, hidden = 29 * 3, 1100  # hidden spans two column blocks, the second partial
        g = torch.Generator().manual_seed(6)
        tokens = torch.randn(29, hidden, generator=g).to(dtype)
        grad_rows = torch.randn(num_rows, hidden, generator=g).to(dtype)
        grad_tokens = torch.randn(29, hidden, generator=g).to(dtype)
        results = []
        for permute, unpermute in ((permute_tokens, unpermute_tokens), (permute_tokens_reference, unpermute_tokens_reference)):
            x = tokens.clone().requires_grad_()
            permuted = permute(x, rows, num_rows)
            permuted.backward(grad_rows)
            y = permuted.detach().clone().requires_grad_()
            restored = unpermute(y, rows)
            restored.backward(grad_tokens)
            results.append((permuted.detach(), x.grad, restored.detach(), y.grad))
        (p, gx, r, gy), (p_ref, gx_ref, r_ref, gy_ref) = results
        assert p.dtype == r.dtype == dtype and p.shape == (num_rows, hidden) and r.shape == (29, hidden)
        assert torch.equal(p, p_ref) and torch.equal(gy, gy_ref)  # copies
        tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(gx.float(), gx_ref.float(), **tol)  # fp32 sums of 3 rows
        torch.testing.assert_close(r.float(), r_ref.float(), **tol)
        torch.testing.assert_close(r.float(), 3 * tokens.float(), rtol=1e-2, atol=1e-2)
        addend = torch.randn(29, hidden, generator=g).to(dtype)
        sums = []
        for unpermute in (unpermute_tokens, unpermute_tokens_reference):
            y, a = p.clone().requires_grad_(), addend.clone().requires_grad_()
            out = unpermute(y, rows, a)
            out.backward(grad_tokens)
            sums.append((out.detach(), y.grad, a.grad))
        (s, gy_s, ga), (s_ref, gy_s_ref, ga_ref) = sums
        torch.testing.assert_close(s.float(), s_ref.float(), **tol)  # the addend joins the fp32 sum
        assert torch.equal(gy_s, gy_s_ref) and torch.equal(ga, grad_tokens) and torch.equal(ga_ref, grad_tokens)
        print("moe permute ok", dtype)
    """
)


FAN_OUT_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels import moe_permute
    from nam56r_kernels.moe_permute import expert_rows, fan_out, permute_tokens, permute_tokens_reference
    from tests.kernels.test_moe_permute import routing

    routing_map, _ = routing(29, 8, 3, seed=5, idle_experts=(2,))
    rows, _ = expert_rows(routing_map)
    num_rows, hidden = 29 * 3, 1100
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(29, hidden, generator=g)
    grad_rows = torch.randn(num_rows, hidden, generator=g)
    grad_a, grad_b = torch.randn(2, 29, hidden, generator=g)
    passes = []
    sum_rows = moe_permute._sum_rows
    moe_permute._sum_rows = lambda src, rows, addends=(): passes.append(len(addends)) or sum_rows(src, rows, addends)

    def loss(x, fanned: bool, rows_used: bool = True):
        if fanned:
            (a, b, c), sink = fan_out(x, 3)
            permuted = permute_tokens(c, rows, num_rows, rows_gradient=sink)
        else:
            a = b = x
            permuted = permute_tokens_reference(x, rows, num_rows)
        total = (a.float() * grad_a).sum() + (b.float() * 2 * grad_b).sum()
        return total + (permuted.float() * grad_rows).sum() if rows_used else total

    for dtype in (torch.float32, torch.bfloat16):
        for rows_used in (True, False):
            x, y = tokens.to(dtype).clone().requires_grad_(), tokens.to(dtype).clone().requires_grad_()
            passes.clear()
            loss(x, True, rows_used).backward()
            loss(y, False, rows_used).backward()
            # With the rows in the loss, the rows and both aliases' gradients are one pass; without, no rows pass at all.
            assert passes == ([2] if rows_used else []), passes
            assert x.grad.dtype == dtype
            # Ours is the exact sum of the gradients each use hands back (in the tokens' dtype), rounded once; the
            # reference's index_add and autograd's adds round at each step.
            selected = rows >= 0
            terms = [grad_a.to(dtype).double(), (2 * grad_b).to(dtype).double()]
            exact, magnitude = terms[0] + terms[1], terms[0].abs() + terms[1].abs()
            if rows_used:
                row_grads = grad_rows.to(dtype).double()[rows[selected].long()]
                exact.index_add_(0, selected.nonzero()[:, 0], row_grads)
                magnitude.index_add_(0, selected.nonzero()[:, 0], row_grads.abs())
            # One rounding to the tokens' dtype over fp32 accumulation error: a whole unit in the last place, as Triton's
            # interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest, half a unit).
            bound = exact.abs() * torch.finfo(dtype).eps + magnitude * 2.0 ** -22
            assert bool(((x.grad.double() - exact).abs() <= bound).all()), ((x.grad.double() - exact).abs() / bound).max()
            tol = dict(rtol=1e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=8e-2)
            torch.testing.assert_close(x.grad.float(), y.grad.float(), **tol)
        print("fan out ok", dtype)

    # No gradient recorded: plain aliases, nothing left in the sink.
    with torch.no_grad():
        (a, b, c), sink = fan_out(tokens, 3)
        permute_tokens(c, rows, num_rows, rows_gradient=sink)
    assert sink.grad is None and not a.requires_grad
    # The sink is emptied by the backward that reads it.
    x = tokens.clone().requires_grad_()
    (a, b, c), sink = fan_out(x, 3)
    (permute_tokens(c, rows, num_rows, rows_gradient=sink).sum() + a.sum()).backward()
    assert sink.grad is None and sink.rows is None
    torch.testing.assert_close(x.grad, torch.full_like(tokens, 4.0))  # 3 rows per token and one alias
    print("fan out edges ok")
    """
)


TABLE_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.moe_permute import expert_rows, permute_probs, routing_table
    from tests.kernels.test_moe_permute import routing

    from nam56r_kernels import moe_permute

    # 2500 tokens span ten table blocks, the last partial, read as one prefix chunk and (a chunk of 4 blocks) as three;
    # one expert gets no token.
    for tokens, experts, topk, idle, chunk in ((2500, 16, 4, (9,), 64), (2500, 16, 4, (9,), 4), (29, 8, 3, (), 64),
                                              (7, 6, 2, (0, 5), 64)):
        moe_permute._TABLE_CHUNK = chunk
        routing_map, probs = routing(tokens, experts, topk, seed=tokens, idle_experts=idle)
        want_rows, want_counts = expert_rows(routing_map)
        p_ref, p = probs.clone().requires_grad_(), probs.clone().requires_grad_()
        want_probs = permute_probs(p_ref, want_rows, tokens * topk)
        rows, counts, row_probs = routing_table(routing_map, p, tokens * topk)
        assert torch.equal(rows, want_rows) and torch.equal(counts, want_counts) and counts.dtype == torch.int64
        assert torch.equal(row_probs, want_probs)
        grad = torch.randn(tokens * topk, generator=torch.Generator().manual_seed(1))
        want_probs.backward(grad)
        row_probs.backward(grad)
        assert torch.equal(p.grad, p_ref.grad)
        print("routing table ok", tokens)
    rows, counts, row_probs = routing_table(torch.zeros(0, 4, dtype=torch.bool), torch.zeros(0, 4), 0)  # no tokens
    assert rows.shape == (0, 4) and torch.equal(counts, torch.zeros(4, dtype=torch.int64)) and row_probs.shape == (0,)
    routing_map, probs = routing(12, 4, 2, seed=9)
    try:
        routing_table(routing_map, probs, 12 * 3)  # the map selects 2 per token, not 3
    except RuntimeError as exc:
        assert "does not select exactly top-k experts per token" in str(exc), exc
        print("routing table refuses a short map")
    """
)


def test_the_routing_table_kernels_match_the_references_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(TABLE_SCRIPT, timeout=600)
    assert stdout.count("routing table ok") == 4 and "routing table refuses a short map" in stdout, stdout


def test_the_kernels_match_the_references_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(KERNEL_SCRIPT, timeout=600)
    assert stdout.count("moe permute ok") == 2, stdout


def test_fan_out_sums_every_uses_gradient_in_one_pass_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(FAN_OUT_SCRIPT, timeout=600)
    assert stdout.count("fan out ok") == 2 and "fan out edges ok" in stdout, stdout


def test_bad_inputs_raise_naming_the_problem(monkeypatch) -> None:
    from nam56r_kernels.moe_permute import fan_out, permute_tokens, routing_table, unpermute_tokens

    routing_map, probs = routing(6, 4, 2, seed=7)
    rows, _ = expert_rows(routing_map)
    with pytest.raises(ValueError, match="routing_map must be bool"):
        expert_rows(routing_map.int())
    with pytest.raises(ValueError, match=r"rows must be int32 \[T, E\]"):
        permute_tokens(torch.randn(5, 8), rows, 12)
    with pytest.raises(ValueError, match=r"rows must be int32 \[T, E\]"):
        unpermute_tokens(torch.randn(12, 8), rows.long())
    with pytest.raises(ValueError, match=r"addend must be \[T, H\] = \[6, 8\] torch.float32"):
        unpermute_tokens(torch.randn(12, 8), rows, torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"probs \(6, 3\) and rows \(6, 4\)"):
        permute_probs(probs[:, :3], rows, 12)
    with pytest.raises(ValueError, match=r"probs must be floating and shaped as routing_map \(6, 4\)"):
        routing_table(routing_map, probs[:, :3], 12)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"fan_out takes 1 to 3 uses, got 4"):
        fan_out(torch.randn(6, 8), 4)
    with pytest.raises(ValueError, match=r"tokens must be \[T, H\]"):
        fan_out(torch.randn(6, 2, 8), 2)
    tokens = torch.randn(6, 8, requires_grad=True)
    (alias,), sink = fan_out(tokens, 1)
    with pytest.raises(ValueError, match="rows_gradient belongs to other tokens: pass one of the aliases fan_out returned"):
        permute_tokens(tokens, rows, 12, rows_gradient=sink)
    sink.attach(alias)  # what a permute of the alias does before its kernel runs
    with pytest.raises(ValueError, match="already takes another permute_tokens' gradient; fan_out once per permute"):
        permute_tokens(alias, rows, 12, rows_gradient=sink)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use the tokens themselves for every use"):
        fan_out(torch.randn(6, 8), 2)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use permute_tokens_reference"):
        permute_tokens(torch.randn(6, 8), rows, 12)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use expert_rows and permute_probs"):
        routing_table(routing_map, probs, 12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the permute kernels run on CUDA only")
def test_the_kernels_match_the_references_on_gpu_at_nam56rs_moe_shape() -> None:
    """32768 tokens of hidden 4096, top-4 of 16 experts, bf16: the routing table and copies exact, sums within one bf16
    rounding."""
    from nam56r_kernels.moe_permute import fan_out, permute_tokens, routing_table, unpermute_tokens

    routing_map, probs = routing(32768, 16, 4, seed=8)
    rows, counts = expert_rows(routing_map.cuda())
    table = routing_table(routing_map.cuda(), probs.cuda(), 32768 * 4)
    assert torch.equal(table[0], rows) and torch.equal(table[1], counts)
    assert torch.equal(table[2], permute_probs(probs.cuda(), rows, 32768 * 4))
    tokens = torch.randn(32768, 4096, device="cuda").bfloat16()
    permuted = permute_tokens(tokens, rows, 32768 * 4)
    assert torch.equal(permuted, permute_tokens_reference(tokens, rows, 32768 * 4))
    restored = unpermute_tokens(permuted, rows)
    # fp32 sums of the same 4 rows, the reference's in the order its atomics land: equal up to one bf16 rounding
    torch.testing.assert_close(restored.float(), unpermute_tokens_reference(permuted, rows).float(), rtol=2**-8, atol=1e-6)
    # The fanned-out backward: the rows' and two other uses' gradients, one fp32 sum rounded to nearest once.
    grad_rows = torch.randn(32768 * 4, 4096, device="cuda").bfloat16()
    grad_a, grad_b = torch.randn(2, 32768, 4096, device="cuda").bfloat16()
    x = tokens.clone().requires_grad_()
    (a, b, c), sink = fan_out(x, 3)
    torch.autograd.backward([permute_tokens(c, rows, 32768 * 4, rows_gradient=sink), a, b], [grad_rows, grad_a, grad_b])
    selected = rows >= 0
    row_grads = grad_rows.double()[rows[selected].long()]
    exact = (grad_a.double() + grad_b.double()).index_add_(0, selected.nonzero()[:, 0], row_grads)
    magnitude = (grad_a.double().abs() + grad_b.double().abs()).index_add_(0, selected.nonzero()[:, 0], row_grads.abs())
    assert bool(((x.grad.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * 2**-22).all())
    print("MOE_PERMUTE_GPU_OK")
