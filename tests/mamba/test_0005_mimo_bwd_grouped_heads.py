"""Patch mamba 0005: the Mamba-3 MIMO backward accepts 1 < ngroups < nheads (NAM56R: 8 groups, 128 heads).

The TileLang kernels return dq/dk per head ([B, S, R, H, N]); the Python epilogue of
mamba_mimo_bwd_combined(_varlen) turns them into per-head bias gradients and per-group q/k gradients.
That epilogue is what the patch changes, so here the kernels and Triton helpers are replaced by
stand-ins that write known per-head gradients, and the epilogue runs for real on CPU, patched and as
pinned. The GPU reproducer runs the real kernels against a G == H module with weights tied per group."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo_bwd, mamba3_mimo_bwd_varlen

B, S, R, N, H, P, CHUNK = 2, 32, 4, 16, 8, 8, 16
DQ_ARG, DK_ARG = 12, 8  # positions of the dq/dk views among the bwd_bwd kernel's arguments


def _fake_kernel_factory(per_head: dict[str, torch.Tensor] | None):
    """A stand-in for a @tilelang.jit factory. Its kernels zero what they would write (every tensor
    after the eight inputs) and, for the bwd_bwd kernel (per_head given), write the per-head dq/dk."""

    def factory(*args, **kwargs):
        def kernel(*tensors):
            for t in tensors[8:]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.zero_()
            if per_head is not None:
                tensors[DQ_ARG].copy_(per_head["dq"].view_as(tensors[DQ_ARG]))
                tensors[DK_ARG].copy_(per_head["dk"].view_as(tensors[DK_ARG]))

        return kernel

    return factory


def _zeros_like_first(*args, **kwargs):
    return torch.zeros_like(args[0]), torch.zeros_like(args[0])


def _bwd_inputs(groups: int, varlen: bool) -> tuple[list, dict]:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    nchunks = S // CHUNK
    args = [
        r(B, S, H, P),  # dout
        r(B, S, R, groups, N), r(B, S, R, groups, N), r(B, S, H, P),  # q, k, v
        r(H, R, N), r(H, R, N),  # q_bias, k_bias
        r(H, R, P), r(H, R, P),  # mimo_v, mimo_o
        None, None,  # z, mimo_z
        r(B, S, H, N // 4),  # angles
        r(B, H, S), r(B, H, S), r(B, H, S), r(B, H, S),  # dA_cs, dA_cs_rev, dt, trap
        r(H),  # D
        r(B, H, nchunks + (2 if varlen else 0), CHUNK, CHUNK),  # segsum
        CHUNK, 4, "float32",
    ]
    kwargs = {"cu_seqlens": torch.tensor([0, 16, 32], dtype=torch.int32)} if varlen else {}
    return args, kwargs


def _run(module: ModuleType, function, groups: int, varlen: bool, monkeypatch: pytest.MonkeyPatch):
    g = torch.Generator().manual_seed(1)
    per_head = {"dq": torch.randn(B, S, R, H, N, generator=g), "dk": torch.randn(B, S, R, H, N, generator=g)}
    monkeypatch.setitem(function.__globals__, "mamba_mimo_bwd_fwd", _fake_kernel_factory(None))
    monkeypatch.setitem(function.__globals__, "mamba_mimo_bwd_bwd", _fake_kernel_factory(per_head))
    for name in ("bwd_dtrap_ddt_triton", "bwd_dtrap_ddt_triton_varlen"):
        if name in function.__globals__:
            monkeypatch.setitem(function.__globals__, name, _zeros_like_first)
    for name in ("bwd_dadt_fused_triton", "bwd_dadt_fused_triton_varlen"):
        if name in function.__globals__:
            monkeypatch.setitem(function.__globals__, name, lambda *a, **k: torch.zeros_like(a[2]))  # ddA_cs: [B, H, S]
    args, kwargs = _bwd_inputs(groups, varlen)
    return per_head, function(*args, **kwargs)


CASES = [
    (mamba3_mimo_bwd, "mamba_ssm/ops/tilelang/mamba3/mamba3_mimo_bwd.py", "mamba_mimo_bwd_combined", False),
    (mamba3_mimo_bwd_varlen, "mamba_ssm/ops/tilelang/mamba3/mamba3_mimo_bwd_varlen.py", "mamba_mimo_bwd_combined_varlen", True),
]


@pytest.mark.parametrize("module, path, name, varlen", CASES, ids=["dense", "varlen"])
@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_heads_reduce_within_each_group(module, path, name, varlen, groups, monkeypatch) -> None:
    per_head, out = _run(module, getattr(module, name), groups, varlen, monkeypatch)
    dq, dk, dq_bias, dk_bias = out[0], out[1], out[6], out[7]
    assert dq.shape == dk.shape == (B, S, R, groups, N)
    # head h reads group h // (H // G): the group's gradient is the sum over its contiguous heads
    for group in range(groups):
        heads = slice(group * H // groups, (group + 1) * H // groups)
        torch.testing.assert_close(dq[:, :, :, group], per_head["dq"][:, :, :, heads].sum(dim=3))
        torch.testing.assert_close(dk[:, :, :, group], per_head["dk"][:, :, :, heads].sum(dim=3))
    # bias gradients stay per head, from the unreduced per-head gradients
    torch.testing.assert_close(dq_bias, per_head["dq"].sum(dim=(0, 1)).permute(1, 0, 2))
    torch.testing.assert_close(dk_bias, per_head["dk"].sum(dim=(0, 1)).permute(1, 0, 2))


@pytest.mark.parametrize("module, path, name, varlen", CASES, ids=["dense", "varlen"])
@pytest.mark.parametrize("groups", [1, H])
def test_groups_the_release_supported_are_unchanged(pinned_release, module, path, name, varlen, groups, monkeypatch) -> None:
    _, patched = _run(module, getattr(module, name), groups, varlen, monkeypatch)
    _, pinned = _run(module, pinned_release.definition(module, path, name), groups, varlen, monkeypatch)
    for ours, theirs in zip(patched, pinned, strict=True):
        if ours is None or theirs is None:
            assert ours is theirs
        else:
            assert torch.equal(ours, theirs)


@pytest.mark.parametrize("module, path, name, varlen", CASES, ids=["dense", "varlen"])
def test_pinned_release_rejects_grouped_heads(pinned_release, module, path, name, varlen, monkeypatch) -> None:
    with pytest.raises(ValueError, match="G value of 4 is not currently supported"):
        _run(module, pinned_release.definition(module, path, name), 4, varlen, monkeypatch)


def test_heads_not_divisible_by_groups_is_a_clear_error(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"nheads \(8\) must be a multiple of ngroups \(3\)"):
        _run(mamba3_mimo_bwd, mamba3_mimo_bwd.mamba_mimo_bwd_combined, 3, False, monkeypatch)
