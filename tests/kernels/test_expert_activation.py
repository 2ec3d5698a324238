"""nam56r_kernels.expert_activation: the fused GELU x router-prob kernel against the eager expression, forward and
backward, under Triton's CPU interpreter (fp32 to fp32 rounding; the interpreter truncates where a GPU rounds to
nearest when it narrows to bf16, so bf16 is held to two bf16 steps there) and on a GPU within one bf16 step, and
the seam's errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels.expert_activation import scaled_gelu, scaled_gelu_reference


def inputs(rows: int, cols: int, dtype: torch.dtype, scale_dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    h = (3 * torch.randn(rows, cols, generator=g, device=device)).to(dtype)
    scale = torch.rand(rows, generator=g, device=device).to(scale_dtype)
    grad = torch.randn(rows, cols, generator=g, device=device).to(dtype)
    return h, scale, grad


def run(fn, h: torch.Tensor, scale: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h, scale = h.clone().requires_grad_(), scale.clone().requires_grad_()
    out = fn(h, scale)
    out.backward(grad)
    return out.detach(), h.grad, scale.grad


def test_the_reference_is_megatrons_mlp_scale_path() -> None:
    """Megatron's MLP with per_token_scale: activation, then `(x * scale.unsqueeze(-1)).to(x.dtype)`."""
    h, scale, _ = inputs(5, 16, torch.bfloat16)
    activated = torch.nn.functional.gelu(h)
    assert torch.equal(scaled_gelu_reference(h, scale), (activated * scale.unsqueeze(-1)).to(activated.dtype))


KERNEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.expert_activation import scaled_gelu, scaled_gelu_reference
    from tests.kernels.test_expert_activation import inputs, run

    # 37 rows: a partial last row block; 300 columns: a partial second column block.
    for dtype, scale_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        h, scale, grad = inputs(37, 300, dtype, scale_dtype)
        (out, gh, gs), (out_ref, gh_ref, gs_ref) = run(scaled_gelu, h, scale, grad), run(scaled_gelu_reference, h, scale, grad)
        assert out.dtype == dtype and gh.dtype == dtype and gs.dtype == scale_dtype
        step = 1e-6 if dtype == torch.float32 else 2**-6  # bf16: the interpreter's truncation, at most two steps
        for got, want in ((out, out_ref), (gh, gh_ref)):
            torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=step)
        # The probs' gradient is a row sum: ours in fp32, torch's of products rounded to the probs' dtype; held to a
        # share of the row's absolute sum.
        magnitude = (grad.float() * torch.nn.functional.gelu(h.float())).abs().sum(1)
        assert bool(((gs.float() - gs_ref.float()).abs() <= step * magnitude + 1e-6).all()), (gs, gs_ref)
        print("scaled gelu ok", dtype, scale_dtype)
    empty = run(scaled_gelu, *inputs(0, 8, torch.bfloat16))
    assert empty[0].shape == (0, 8) and empty[2].shape == (0,)
    print("scaled gelu empty ok")
    """
)


def test_the_kernel_matches_the_reference_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(KERNEL_SCRIPT, timeout=600)
    assert stdout.count("scaled gelu ok") == 3 and "scaled gelu empty ok" in stdout, stdout


def test_bad_inputs_raise_naming_the_problem(monkeypatch) -> None:
    h, scale, _ = inputs(4, 8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"h must be \[N, F\]"):
        scaled_gelu_reference(h[0], scale)
    with pytest.raises(ValueError, match=r"scale must be \[N\] = \[4\]"):
        scaled_gelu(h, scale[:3])
    with pytest.raises(ValueError, match="must be floating"):
        scaled_gelu(h, torch.ones(4, dtype=torch.int32))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use scaled_gelu_reference"):
        scaled_gelu(h, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the kernels run on CUDA only")
def test_the_kernel_matches_the_reference_on_gpu_within_one_bf16_step() -> None:
    """NAM56R's expert FFN (896) on 8192 permuted rows, bf16 with fp32 probs: output and h's gradient within one bf16
    step of torch's (libdevice's erf against torch's), nearly all of them equal; the probs' gradient within what
    those steps move a row sum."""
    h, scale, grad = inputs(8192, 896, torch.bfloat16, device="cuda")
    (out, gh, gs), (out_ref, gh_ref, gs_ref) = run(scaled_gelu, h, scale, grad), run(scaled_gelu_reference, h, scale, grad)
    for got, want in ((out, out_ref), (gh, gh_ref)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)
        assert (got != want).float().mean().item() < 0.02
    # Each product's activation may sit one bf16 step from torch's: the row sums differ by at most that share of
    # the row's absolute sum.
    magnitude = (grad.float() * torch.nn.functional.gelu(h.float())).abs().sum(1)
    assert bool(((gs - gs_ref).abs() <= 2**-8 * magnitude + 1e-6).all())
    print("EXPERT_ACTIVATION_GPU_OK")


def test_grouped_mlp_takes_the_fused_activation_only_for_gelu_with_probs() -> None:
    import torch.nn.functional as F
    from nam56r_kernels.grouped_mlp import grouped_mlp

    x, fc1, fc2 = torch.randn(6, 16), torch.randn(2, 8, 16), torch.randn(2, 16, 8)
    counts, probs = torch.tensor([4, 2]), torch.rand(6)
    with pytest.raises(ValueError, match="fused_activation needs activation F.gelu and a per_token_scale"):
        grouped_mlp(x, fc1, fc2, counts, F.relu, per_token_scale=probs, fused_activation=True)
    with pytest.raises(ValueError, match="got .* and no scale"):
        grouped_mlp(x, fc1, fc2, counts, F.gelu, fused_activation=True)
