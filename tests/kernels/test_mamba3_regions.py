"""nam56r_kernels.mamba3_regions: the data-dependent-A region is what mamba_ssm's Mamba3.forward computes
(captured at its kernel call on CPU), and its compiled form (on a GPU) matches it."""

from __future__ import annotations

import pytest
import torch
from nam56r_kernels.mamba3_regions import adt_dt_compiled, adt_dt_reference


def test_region_is_what_mamba3_forward_passes_to_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    mamba3 = pytest.importorskip("mamba_ssm.modules.mamba3")
    torch.manual_seed(0)
    layer = mamba3.Mamba3(d_model=64, d_state=16, headdim=16, is_mimo=True, mimo_rank=2, chunk_size=8, dtype=torch.float32)
    layer.B_norm = layer.C_norm = torch.nn.Identity()  # Triton RMSNorms; the region comes before them
    captured = {}

    def capture_kernel_inputs(**kwargs):
        captured.update(kwargs)
        raise StopIteration  # stop at the kernel call: everything the region produced is in `captured`

    monkeypatch.setattr(mamba3, "mamba3_mimo_combined", capture_kernel_inputs)
    u = torch.randn(2, 10, 64)
    with pytest.raises(StopIteration):
        layer(u)
    projected = layer.in_proj(u)
    sizes = [layer.d_inner, layer.d_inner, *[layer.d_state * layer.num_bc_heads * layer.mimo_rank] * 2,
             layer.nheads, layer.nheads, layer.nheads, layer.num_rope_angles]
    _, _, _, _, dd_dt, dd_A, _, _ = torch.split(projected, sizes, dim=-1)
    dt, adt = adt_dt_reference(dd_A, dd_dt, layer.dt_bias, layer.A_floor)
    assert dt.dtype == adt.dtype == torch.float32 and dt.shape == (2, layer.nheads, 10)
    assert torch.equal(dt, captured["DT"]) and torch.equal(adt, captured["ADT"])
    assert bool((adt < 0).all()), "A is clamped below -A_floor and DT is positive"


def test_region_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"dd_A and dd_dt must both be \[B, L, H\]"):
        adt_dt_reference(torch.zeros(1, 4, 3), torch.zeros(1, 4, 2), torch.zeros(3), 1e-4)
    with pytest.raises(ValueError, match=r"dt_bias must be \[H=3\], got \(2,\)"):
        adt_dt_reference(torch.zeros(1, 4, 3), torch.zeros(1, 4, 3), torch.zeros(2), 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the compiled region is measured on CUDA")
def test_compiled_region_matches_eager_on_gpu_at_nam56r_shape() -> None:
    # NAM56R: micro-batch 8 x seq 4096, 128 Mamba-3 heads (d_inner 8192 / head dim 64), bf16 projections.
    dd_A, dd_dt = (torch.randn(8, 4096, 128, device="cuda").bfloat16() for _ in range(2))
    dt_bias = torch.randn(128, device="cuda")
    eager = adt_dt_reference(dd_A, dd_dt, dt_bias, 1e-4)
    compiled = adt_dt_compiled()(dd_A, dd_dt, dt_bias, 1e-4)
    errs = [(a - b).abs().max().item() for a, b in zip(eager, compiled, strict=True)]
    assert max(errs) < 1e-5, errs
    print(f"MAMBA3_REGION_GPU_OK max_abs_err={max(errs):.2e}")
