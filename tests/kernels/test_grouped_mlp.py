"""nam56r_kernels.grouped_mlp: the grouped_mm op against the per-expert loop (forward and gradients, bf16,
fp16 and fp32, zero-token experts, an expanded grad_output) and the seam's errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from nam56r_kernels.grouped_mlp import grouped_mlp, grouped_mlp_reference

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def make_inputs(dtype: torch.dtype, counts: list[int], hidden: int = 64, ffn: int = 32, scale: bool = True):
    gen = torch.Generator().manual_seed(0)
    num_experts, num_tokens = len(counts), sum(counts)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    fc1 = (torch.randn(num_experts, ffn, hidden, generator=gen) / hidden**0.5).to(dtype)
    fc2 = (torch.randn(num_experts, hidden, ffn, generator=gen) / ffn**0.5).to(dtype)
    probs = torch.rand(num_tokens, generator=gen) if scale else None
    return x, fc1, fc2, torch.tensor(counts), probs


def run(op, x, fc1, fc2, tokens_per_expert, probs, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (x, fc1, fc2)]
    scale = probs.detach().clone().requires_grad_() if probs is not None else None
    out = op(*leaves, tokens_per_expert, F.gelu, per_token_scale=scale)
    out.backward(grad_out)
    grads = [t.grad for t in leaves] + ([scale.grad] if scale is not None else [])
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("counts", [[5, 7, 3, 9], [0, 8, 0, 5], [6, 0, 0, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("scale", [True, False])
def test_matches_reference(dtype, counts, scale):
    x, fc1, fc2, tpe, probs = make_inputs(dtype, counts, scale=scale)
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, grads = run(grouped_mlp, x, fc1, fc2, tpe, probs, grad_out)
    ref_out, ref_grads = run(grouped_mlp_reference, x, fc1, fc2, tpe, probs, grad_out)
    assert out.dtype == dtype and out.shape == x.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, atol=atol, rtol=rtol)


def test_zero_token_expert_gets_zero_weight_grad():
    x, fc1, fc2, tpe, probs = make_inputs(torch.float32, [4, 0, 4, 0])
    _, (_, grad_fc1, grad_fc2, _) = run(grouped_mlp, x, fc1, fc2, tpe, probs, torch.ones(x.shape))
    for expert in (1, 3):
        assert torch.count_nonzero(grad_fc1[expert]) == 0 and torch.count_nonzero(grad_fc2[expert]) == 0


def test_expanded_grad_output():
    # grouped_mm's CPU backward rejects a zero-stride grad_output (what .sum().backward() produces).
    x, fc1, fc2, tpe, _ = make_inputs(torch.bfloat16, [3, 5, 0, 8], scale=False)
    x.requires_grad_()
    grouped_mlp(x, fc1, fc2, tpe, F.gelu).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_tokens_per_expert_on_another_device_dtype():
    x, fc1, fc2, tpe, probs = make_inputs(torch.float32, [2, 2, 2, 2])
    expected = grouped_mlp_reference(x, fc1, fc2, tpe, F.gelu, per_token_scale=probs)
    torch.testing.assert_close(grouped_mlp(x, fc1, fc2, tpe.to(torch.int32), F.gelu, per_token_scale=probs), expected)


@pytest.mark.parametrize("op", [grouped_mlp, grouped_mlp_reference])
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "x": a["x"][:, :32]}, r"fc1_weight \(4, 32, 64\) must be \[E, F, H\] with H = x's 32"),
        (lambda a: {**a, "x": a["x"][None]}, r"x must be \[T, H\], got shape \(1, 8, 64\)"),
        (lambda a: {**a, "fc2_weight": a["fc2_weight"][:, :, :16]}, r"fc2_weight must be \[E, H, F\] = \(4, 64, 32\)"),
        (lambda a: {**a, "tokens_per_expert": torch.tensor([8, 0, 0])}, r"tokens_per_expert must be \[E\] = \[4\]"),
        (lambda a: {**a, "tokens_per_expert": torch.tensor([2, 2, 2, 1])}, r"sums to 7 but x has T = 8"),
        (lambda a: {**a, "tokens_per_expert": torch.tensor([2, 2, 6, -2])}, r"non-negative"),
        (lambda a: {**a, "tokens_per_expert": torch.tensor([2.0, 2, 2, 2])}, r"integer tensor"),
        (lambda a: {**a, "per_token_scale": torch.ones(7)}, r"per_token_scale must be \[T\] = \[8\]"),
        (lambda a: {**a, "fc1_weight": a["fc1_weight"].double()}, r"must share a dtype"),
    ],
)
def test_shape_errors(op, change, message):
    x, fc1, fc2, tpe, probs = make_inputs(torch.float32, [2, 2, 2, 2])
    args = {"x": x, "fc1_weight": fc1, "fc2_weight": fc2, "tokens_per_expert": tpe, "per_token_scale": probs}
    args = change(args)
    with pytest.raises(ValueError, match=message):
        op(args.pop("x"), args.pop("fc1_weight"), args.pop("fc2_weight"), args.pop("tokens_per_expert"), F.gelu, **args)


def test_unaligned_sizes_raise_and_reference_handles_them():
    x, fc1, fc2, tpe, probs = make_inputs(torch.bfloat16, [3, 3], hidden=60, ffn=32)
    with pytest.raises(ValueError, match="H = 60 and F = 32 must be multiples of 8 for torch.bfloat16"):
        grouped_mlp(x, fc1, fc2, tpe, F.gelu)
    assert grouped_mlp_reference(x, fc1, fc2, tpe, F.gelu).shape == (6, 60)
