"""The architecture preflight (nam56r.training.launcher.gpu_arch) on CPU with faked compute capabilities, reading the
real @tilelang.jit factories of mamba_ssm's Mamba-3 MIMO kernels and Megatron's TileLang DSA kernels."""

from __future__ import annotations

import pytest

from nam56r.model.presets import get_preset
from nam56r.training.launcher.gpu_arch import SHARED_MEMORY_MERGE, arch_check, merges_shared_memory, tilelang_kernels

MIMO = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_fwd.mamba_mimo_fwd"
SPARSE_MLA_BWD = "megatron.core.transformer.experimental_attention_variant.ops.tilelang_sparse_mla_bwd.bwd"


@pytest.fixture(scope="module")
def proxy(megatron_built):
    return get_preset("nam56r-proxy")


def test_the_kernels_in_use_are_the_real_tilelang_factories(proxy) -> None:
    from tilelang.jit import JITImpl

    kernels = tilelang_kernels(proxy)
    assert MIMO in kernels and SPARSE_MLA_BWD in kernels and all(isinstance(k, JITImpl) for k in kernels.values())
    assert merges_shared_memory(kernels[SPARSE_MLA_BWD])  # Megatron builds its sparse-MLA backward with the merge
    assert not merges_shared_memory(kernels[MIMO])


def test_hopper_passes_as_built(proxy) -> None:
    ok, detail = arch_check(proxy, (9, 0), "NVIDIA H200")
    assert ok and detail == "NVIDIA H200, sm_90 (Hopper (H100/H200), 227 KiB shared memory per block)"


def test_gb10_is_refused_naming_every_kernel_built_without_the_merge(proxy) -> None:
    ok, detail = arch_check(proxy, (12, 1), "NVIDIA GB10")
    assert not ok
    assert "NVIDIA GB10, sm_121 (GB10) gives a block 99 KiB of shared memory" in detail and SHARED_MEMORY_MERGE in detail
    named = detail.rsplit("first launch: ", 1)[1].split("; build them")[0].split(", ")
    assert MIMO in named and SPARSE_MLA_BWD not in named
    assert set(named) == {name for name, kernel in tilelang_kernels(proxy).items() if not merges_shared_memory(kernel)}


def test_gb10_passes_once_every_kernel_merges_shared_memory(proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    for kernel in tilelang_kernels(proxy).values():
        monkeypatch.setattr(kernel, "pass_configs", {**(kernel.pass_configs or {}), SHARED_MEMORY_MERGE: True})
    ok, detail = arch_check(proxy, (12, 1), "NVIDIA GB10")
    assert ok and "TileLang kernels merge shared memory" in detail


def test_an_unknown_architecture_is_refused(proxy) -> None:
    ok, detail = arch_check(proxy, (8, 0), "NVIDIA A100")
    assert not ok and "not supported; NAM56R trains on Hopper (H100/H200) (sm_90), GB10 (sm_121)" in detail


def test_the_preflight_reports_a_faked_gb10(proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from nam56r.training.launcher.preflight import run_preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 1))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GB10")
    (gpu,) = [check for check in run_preflight(proxy).checks if check.name == "gpu"]
    assert not gpu.ok and MIMO in gpu.detail
