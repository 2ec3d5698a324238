"""nam56r_kernels.expert_activation: the fused GELU x router-prob kernel against the eager expression, forward and
backward, under Triton's CPU interpreter (fp32 to fp32 rounding; the interpreter truncates where a GPU rounds to
nearest when it narrows to bf16, so bf16 is held to two bf16 steps there) and on a GPU within one bf16 step; h's
gradient bit for bit against the contract's rounding steps (fp16 under the interpreter, bf16 on a GPU); and the
seam's errors."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

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


def grad_h_by_the_steps(h: torch.Tensor, scale: torch.Tensor, grad: torch.Tensor, round_grad_act: bool = True,
                        erf: Callable[[torch.Tensor], torch.Tensor] = torch.erf,
                        exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp) -> torch.Tensor:
    """h's gradient by the contract's rounding steps, in the kernel's fp32 operation order: the activation's gradient
    (grad x scale in the product's dtype) rounded to h's dtype, times GELU's derivative, rounded to h's dtype.
    `round_grad_act=False` leaves out the first rounding; `erf` and `exp` are the fp32 elementary functions to use."""
    h32, grad32 = h.float(), grad.float()
    product_fp32 = torch.promote_types(h.dtype, scale.dtype) == torch.float32
    scale32 = (scale.float() if product_fp32 else scale.to(h.dtype).float())[:, None]
    cdf = 0.5 * (1.0 + erf(h32 * 0.7071067811865476))
    grad_act = grad32 * scale32
    if round_grad_act:
        grad_act = grad_act.to(h.dtype).float()
    slope = cdf + h32 * exp(-0.5 * h32 * h32) * 0.3989422804014327
    return (grad_act * slope).to(h.dtype)

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



# fp16, not bf16: the interpreter narrows fp32 to fp16 with numpy's round-to-nearest-even, as a GPU and torch do, but
# truncates to bf16. Its erf and exp are math.erf rounded to fp32 and numpy's fp32 exp (triton/runtime/interpreter.py:
# create_erf, create_exp); given those, every other step is one IEEE fp32 operation or one rounding to fp16, so the
# kernel's h gradient must equal the steps' bit for bit. Without the activation gradient's rounding to fp16, about a
# fifth of the elements land one fp16 step away.
ROUNDING_SCRIPT = textwrap.dedent(
    """
    import math
    import numpy as np
    import torch
    from nam56r_kernels.expert_activation import scaled_gelu
    from tests.kernels.test_expert_activation import grad_h_by_the_steps, inputs, run

    erf_fp32 = np.vectorize(math.erf, otypes=[np.float32])
    steps = dict(erf=lambda x: torch.from_numpy(erf_fp32(x.numpy())), exp=lambda x: torch.from_numpy(np.exp(x.numpy())))
    for scale_dtype in (torch.float32, torch.float16):
        h, scale, grad = inputs(37, 300, torch.float16, scale_dtype)
        _, gh, _ = run(scaled_gelu, h, scale, grad)
        want = grad_h_by_the_steps(h, scale, grad, **steps)
        unrounded = grad_h_by_the_steps(h, scale, grad, round_grad_act=False, **steps)
        assert (want != unrounded).float().mean().item() > 0.1, "these inputs do not test the rounding"
        differ = (gh != want).sum().item()
        assert differ == 0, f"{differ} of {gh.numel()} h gradients differ from the rounding steps ({scale_dtype} scale)"
        print("scaled gelu rounding ok", scale_dtype)
    """
)


def test_h_gradient_rounds_the_activation_gradient_as_autograd_does_under_the_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(ROUNDING_SCRIPT, timeout=600)
    assert stdout.count("scaled gelu rounding ok") == 2, stdout

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
    step of torch's (libdevice's erf against torch's), nearly all of them equal; h's gradient bit-equal to the contract's
    rounding steps wherever GELU's derivative is well conditioned; the probs' gradient within what those steps move a
    row sum."""
    h, scale, grad = inputs(8192, 896, torch.bfloat16, device="cuda")
    (out, gh, gs), (out_ref, gh_ref, gs_ref) = run(scaled_gelu, h, scale, grad), run(scaled_gelu_reference, h, scale, grad)
    for got, want in ((out, out_ref), (gh, gh_ref)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)
        assert (got != want).float().mean().item() < 0.02
    # For h >= 0, GELU's derivative is cdf (>= 1/2) plus h * pdf (>= 0), a sum without cancellation: the kernel's
    # (libdevice erff, Triton's ex2-based exp, a possibly fused multiply-add) and torch's fp32 one differ by a few fp32
    # steps, at most about 2**-21 relative. Rounding a product to bf16 (steps of 2**-8 to 2**-7 of its value) then
    # comes out differently only when it lies that close to a midpoint: at most about 2**-21 / 2**-8 = 2**-13 of the
    # elements. 2**-10 leaves a factor 8 for the elementary functions' error tails. Leaving the activation gradient
    # unrounded moves it by up to half a bf16 step, which changes about a fifth of the results (more than 2**-4).
    well_conditioned = h >= 0
    want = grad_h_by_the_steps(h, scale, grad)
    unrounded = grad_h_by_the_steps(h, scale, grad, round_grad_act=False)
    assert (want != unrounded)[well_conditioned].float().mean().item() > 2**-4, "these inputs do not test the rounding"
    assert (gh != want)[well_conditioned].float().mean().item() <= 2**-10
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
