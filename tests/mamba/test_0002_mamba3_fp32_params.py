"""Patch mamba 0002: Mamba-3 hands its kernels float32 D, DT, Q/K biases and MIMO projections even when
the module's parameters are stored in bf16 (what Megatron's Float16Module does).

The TileLang/Triton kernels need a GPU; here the kernel seam is checked on CPU by recording what the
module passes to them (the B/C RMSNorms, Triton-only, are replaced by identities). The GPU reproducer
runs the real kernels."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

m3 = pytest.importorskip("mamba_ssm.modules.mamba3")
TREE = Path(__file__).resolve().parents[2] / "third_party" / "mamba"
FP32_INPUTS = {"mimo": ("Q_bias", "K_bias", "MIMO_V", "MIMO_Z", "MIMO_Out", "D", "DT"), "siso": ("Q_bias", "K_bias", "D", "DT")}


def _run_recording(module_ns: dict, is_mimo: bool, param_dtype: torch.dtype) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}

    def kernel(**kwargs):
        seen.update({k: v.dtype for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        v = kwargs["V"]
        return torch.zeros(*v.shape, dtype=v.dtype)

    module_ns["mamba3_mimo_combined" if is_mimo else "mamba3_siso_combined"] = kernel
    torch.manual_seed(0)
    layer = module_ns["Mamba3"](d_model=32, d_state=16, expand=2, headdim=16, is_mimo=is_mimo, mimo_rank=2, chunk_size=8, device="cpu")
    layer.B_norm, layer.C_norm = torch.nn.Identity(), torch.nn.Identity()
    layer = layer.to(param_dtype)
    out = layer(torch.randn(2, 8, 32, dtype=param_dtype))
    assert out.shape == (2, 8, 32)
    return seen


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mimo", "siso"])
def test_kernels_get_fp32_parameters(monkeypatch, kind: str, param_dtype: torch.dtype) -> None:
    namespace = vars(m3)
    for name in ("mamba3_mimo_combined", "mamba3_siso_combined"):
        monkeypatch.setitem(namespace, name, namespace[name])  # restored after the test
    seen = _run_recording(namespace, kind == "mimo", param_dtype)
    wrong = {k: seen[k] for k in FP32_INPUTS[kind] if seen.get(k) != torch.float32}
    assert not wrong, f"kernel inputs not float32 with {param_dtype} parameters: {wrong}"


def test_pinned_release_passes_bf16_parameters_to_the_mimo_kernel() -> None:
    """The bug: the pinned release passes the stored parameters through, so a bf16 module hands the MIMO kernel
    bf16 biases (the kernel raises 'Q_BIAS dtype expected float32' on the GPU)."""
    source = subprocess.run(["git", "-C", str(TREE), "show", "upstream:mamba_ssm/modules/mamba3.py"],
                            capture_output=True, text=True, check=True).stdout
    namespace: dict = {"__name__": "mamba3_pinned"}
    exec(compile(source, "upstream:mamba_ssm/modules/mamba3.py", "exec"), namespace)
    seen = _run_recording(namespace, True, torch.bfloat16)
    assert seen["Q_bias"] == torch.bfloat16 and seen["D"] == torch.bfloat16
