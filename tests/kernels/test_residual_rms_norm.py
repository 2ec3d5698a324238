"""nam56r_kernels.residual_rms_norm: the layer input norm whose backward sums the residual's gradient, against torch's
RMSNorm with autograd's residual add, under Triton's CPU interpreter (fp32 tight; bf16 within the interpreter's
truncation) and on a GPU against an fp64 reference at NAM56R's hidden size, and the seam's errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels.residual_rms_norm import rms_norm_residual, rms_norm_residual_reference


def inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (2 * torch.randn(rows, hidden, generator=g, device=device)).to(dtype)
    weight = (1 + 0.3 * torch.randn(hidden, generator=g, device=device)).to(dtype)
    grad_normed, grad_residual = (torch.randn(rows, hidden, generator=g, device=device).to(dtype) for _ in range(2))
    return x, weight, grad_normed, grad_residual


def run(fn, x: torch.Tensor, weight: torch.Tensor, grad_normed: torch.Tensor, grad_residual: torch.Tensor | None):
    """(normed, x's gradient, weight's gradient) with the residual's gradient summed into x's when given; x goes through
    a view first, as a layer's input is a non-leaf, so autograd adds the two gradients as it does in a layer."""
    leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    normed, residual = fn(leaf.view_as(leaf), w, 1e-5)
    outputs, grads = ((normed, residual), (grad_normed, grad_residual)) if grad_residual is not None else ((normed,), (grad_normed,))
    torch.autograd.backward(outputs, grads)
    return normed.detach(), leaf.grad, w.grad


def exact(x: torch.Tensor, weight: torch.Tensor, grad_normed: torch.Tensor, grad_residual: torch.Tensor | None):
    """The fp64 values both paths round: normed, x's gradient (with the residual's), weight's gradient."""
    x, w, g = x.double(), weight.double(), grad_normed.double()
    rstd = torch.rsqrt(x.square().mean(1, keepdim=True) + 1e-5)
    xhat = x * rstd
    gw = g * w
    dx = rstd * (gw - xhat * (gw * xhat).mean(1, keepdim=True))
    if grad_residual is not None:
        dx = dx + grad_residual.double()
    return xhat * w, dx, (g * xhat).sum(0)


KERNEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.residual_rms_norm import rms_norm_residual, rms_norm_residual_reference
    from tests.kernels.test_residual_rms_norm import exact, inputs, run

    # 37 rows over 512 backward programs' worth (fewer rows than programs) and 700 (several rows a program); 300 columns:
    # a masked tail of the 512-wide row tile.
    for rows in (37, 700):
        for dtype in (torch.float32, torch.bfloat16):
            x, w, gy, gr = inputs(rows, 300, dtype)
            for residual in (gr, None):
                got, ref = run(rms_norm_residual, x, w, gy, residual), run(rms_norm_residual_reference, x, w, gy, residual)
                assert all(t.dtype == dtype for t in got)
                truth = exact(x, w, gy, residual)
                # fp32: both within a few fp32 rounding steps of the exact values. bf16: the interpreter truncates where a
                # GPU rounds to nearest, so ours is held to two bf16 steps of the exact value (the GPU test holds it to half).
                step = 1e-4 if dtype == torch.float32 else 2**-7
                for name, a, b, t in zip(("normed", "x grad", "weight grad"), got, ref, truth):
                    scale = t.abs().max().item()
                    err = ((a.double() - t).abs() / (t.abs() + scale * 1e-3)).max().item()
                    assert err <= step * 2, (rows, dtype, name, err)
                    torch.testing.assert_close(a.float(), b.float(), rtol=4 * step, atol=4 * step * scale)
                print("residual norm ok", rows, dtype, residual is not None)
    x, w, gy, gr = inputs(0, 64, torch.bfloat16)
    normed, gx, gw = run(rms_norm_residual, x, w, gy, gr)
    assert normed.shape == (0, 64) and gx.shape == (0, 64) and bool((gw == 0).all())
    print("residual norm empty ok")
    """
)


def test_the_kernels_match_the_reference_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(KERNEL_SCRIPT, timeout=600)
    assert stdout.count("residual norm ok") == 8 and "residual norm empty ok" in stdout, stdout


def test_the_residual_is_the_input_and_the_reference_is_torchs_rms_norm() -> None:
    x, w, _, _ = inputs(5, 16, torch.float32)
    normed, residual = rms_norm_residual_reference(x, w, 1e-5)
    assert residual is x
    assert torch.equal(normed, torch.nn.functional.rms_norm(x, (16,), w, 1e-5))


def test_bad_inputs_raise_naming_the_problem(monkeypatch) -> None:
    x, w, _, _ = inputs(4, 8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be floating \[T, H\]"):
        rms_norm_residual(x[0], w, 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[H\] = \[8\] torch.bfloat16"):
        rms_norm_residual(x, w.float(), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be \[H\] = \[8\]"):
        rms_norm_residual_reference(x, w[:4], 1e-5)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use rms_norm_residual_reference"):
        rms_norm_residual(x, w, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the kernels run on CUDA only")
def test_the_kernels_round_the_exact_values_once_on_gpu() -> None:
    """NAM56R's hidden size (4096) on 32768 bf16 tokens: the normed rows and x's gradient (the residual's summed in) within
    half a bf16 step of the fp64 values plus fp32 noise (one rounding), where autograd's add of the rounded norm
    gradient and the residual's lands further; the weight's gradient within fp32 summation error of the fp64 sum;
    the normed rows as torch's for nearly all elements."""
    x, w, gy, gr = inputs(32768, 4096, torch.bfloat16, device="cuda")
    got, ref = run(rms_norm_residual, x, w, gy, gr), run(rms_norm_residual_reference, x, w, gy, gr)
    truth = exact(x, w, gy, gr)
    for name, a, t in (("normed", got[0], truth[0]), ("x grad", got[1], truth[1])):
        ulp = 2.0 ** (torch.floor(torch.log2(t.abs().clamp_min(2**-126))) - 7)  # a bf16 step at each value
        assert bool(((a.double() - t).abs() <= 0.5 * ulp + 1e-5 * t.abs().max()).all()), name
    torch.testing.assert_close(got[2].double(), truth[2].to(torch.bfloat16).double(), rtol=2**-7, atol=1e-3)
    assert (got[0] == ref[0]).float().mean().item() > 0.999
    assert bool(((ref[1].double() - truth[1]).abs() > (got[1].double() - truth[1]).abs()).any())  # autograd's add rounds twice
    print("RESIDUAL_NORM_GPU_OK")
