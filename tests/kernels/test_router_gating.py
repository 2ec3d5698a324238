"""nam56r_kernels.router_gating: fp32 router logits from bf16 operands against Megatron's local computation (fp32 copies,
fp32 GEMMs), forward and backward, under Triton's CPU interpreter and on a GPU at NAM56R's router shape, and the seam's
errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels.router_gating import router_gating, router_gating_reference

from tests.kernels.logit_selection_testlib import selection_violations


def inputs(tokens: int, hidden: int, experts: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, 2, hidden, generator=g, device=device).to(dtype)
    weight = (0.05 * torch.randn(experts, hidden, generator=g, device=device)).to(dtype)
    grad = torch.randn(tokens, 2, experts, generator=g, device=device)
    return x, weight, grad


def run(fn, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = fn(x, weight)
    logits.backward(grad)
    return logits.detach(), x.grad, weight.grad


def test_the_reference_is_megatrons_local_router_gemm(megatron_built) -> None:
    """Megatron's RouterGatingLinearFunction without TransformerEngine, router_dtype fp32: same logits and gradients."""
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.te_general_gemm is not None:
        pytest.skip("TransformerEngine is installed: Megatron's router GEMM is TE's here, not the local path")
    x, weight, grad = inputs(12, 64, 6)
    want = run(lambda a, w: moe_utils.router_gating_linear(a, w, None, torch.float32), x, weight, grad)
    got = run(router_gating_reference, x, weight, grad)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


KERNEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.router_gating import router_gating, router_gating_reference
    from tests.kernels.test_router_gating import inputs, run

    # tokens span two row blocks and two weight-gradient blocks, the last partial; hidden two column blocks, the
    # second partial; 6 experts pad to a 16-wide tile.
    for tokens, hidden, experts in ((1100, 200, 6), (70, 256, 16)):
        x, weight, grad = inputs(tokens, hidden, experts, seed=tokens)
        logits, gx, gw = run(router_gating, x, weight, grad)
        ref_logits, ref_gx, ref_gw = run(router_gating_reference, x, weight, grad)
        assert logits.dtype == torch.float32 and gx.dtype == x.dtype and gw.dtype == weight.dtype
        torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-5)  # fp32 sums of the same exact products
        # The interpreter truncates where a GPU rounds to nearest when it narrows to bf16: within one bf16 step.
        torch.testing.assert_close(gx.float(), ref_gx.float(), rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(gw.float(), ref_gw.float(), rtol=2**-7, atol=1e-6)
        again = run(router_gating, x, weight, grad)
        assert torch.equal(again[2], gw)  # fixed-order block sums, no atomics
        print("router gating ok", tokens, hidden, experts)
    """
)


def test_the_kernels_match_megatrons_local_path_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(KERNEL_SCRIPT, timeout=600)
    assert stdout.count("router gating ok") == 2, stdout


def test_bad_inputs_raise_naming_the_problem(monkeypatch) -> None:
    x, weight, _ = inputs(4, 32, 4)
    with pytest.raises(ValueError, match=r"weight must be \[E, H\] with H = x's last dim"):
        router_gating(x, weight[:, :16])
    with pytest.raises(ValueError, match="x and weight must be bf16, got torch.float32 and torch.float32"):
        router_gating(x.float(), weight.float())
    with pytest.raises(ValueError, match="x and weight must be bf16, got torch.bfloat16 and torch.float16"):
        router_gating(x, weight.half())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use router_gating_reference"):
        router_gating(x, weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the router gating kernels run on CUDA only")
def test_the_kernels_match_megatrons_local_path_on_gpu_at_nam56rs_router_shape() -> None:
    """32768 tokens of hidden 4096, 16 experts, bf16: fp32 logits within fp32 summation order, a routing that fp32
    summation's bound allows; the input gradient within one bf16 step; the weight gradient, a sum over 32768 tokens whose
    fp32 rounding depends on the order, within one bf16 step or 1e-4 of its scale (where the sum cancels to near zero)."""
    x, weight, grad = inputs(16384, 4096, 16, seed=3, device="cuda")
    logits, gx, gw = run(router_gating, x, weight, grad)
    ref_logits, ref_gx, ref_gw = run(router_gating_reference, x, weight, grad)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-4)
    # Two correct fp32 GEMMs may rank two logits within their summation error of each other either way, so the
    # routing is checked against the exact logits: each within δ = γ_K·S of them (S = Σ_k |x_k w_jk|, fp32
    # accumulation in any order), a selected logit's interval never wholly below an unselected one's, and the exact
    # top-4 wherever the intervals separate it (logit_selection_testlib derives the bound).
    routing = selection_violations(x.flatten(0, 1), weight, logits.flatten(0, 1).topk(4, dim=-1).indices,
                                   logits_dtype=torch.float32)
    assert routing.violations == 0 and routing.decidable_mismatches == 0, routing
    # The share the bound decides depends on the data alone: δ is ~0.13 here against logits of spread ~3.2.
    assert routing.decidable_share > 0.5, routing.decidable_share
    torch.testing.assert_close(gx.float(), ref_gx.float(), rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(gw.float(), ref_gw.float(), rtol=2**-7, atol=1e-4 * ref_gw.float().abs().max().item())
    print(f"ROUTER_GATING_GPU_OK routing_decidable={routing.decidable_share:.3f} routing_violations={routing.violations}")


def test_three_bf16_terms_sum_to_an_fp32_value_exactly() -> None:
    """The split the GPU backward multiplies by (router_gating._dot_fp32_bf16), in torch with the same round-to-nearest
    conversions: high + mid + low == a for fp32 values across the exponent range the gradients take."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(100_000, generator=g) * torch.logspace(-30, 30, 100_000)
    high = a.bfloat16()
    rest = a - high.float()
    mid = rest.bfloat16()
    low = (rest - mid.float()).bfloat16()
    assert torch.equal((high.float() + mid.float()) + low.float(), a)
