"""Patch megatron-lm 0006: the fused sparse MLA path takes any absorbed head whose value part
(v_channels) and rope tail are powers of two >= 16, and hands the value dimension to the kernels.
The TileLang kernels cannot run on CPU: SparseMLA is replaced by a recorder; the GPU reproducer
(patches/packs/10-sparse-mla-dims/repro.py) runs the real kernels against a float32 reference."""

from __future__ import annotations

import pytest
import torch

tilelang_dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.ops.tilelang_dsa")
from megatron.core.transformer.experimental_attention_variant.ops import fused_decline, tilelang_utils  # noqa: E402

TILELANG_DSA_PATH = "megatron/core/transformer/experimental_attention_variant/ops/tilelang_dsa.py"
SQ, B, HEADS, TOPK = 8, 2, 16, 64


class RecordingSparseMLA:
    def __init__(self) -> None:
        self.d_v: list[int] = []

    def apply(self, query_bshd, key_bshd, indices, softmax_scale, d_v=512):
        self.d_v.append(d_v)
        b, s, h, _ = query_bshd.shape
        return torch.zeros(b, s, h, d_v, dtype=torch.bfloat16), None


def _inputs(head_dim: int):
    gen = torch.Generator().manual_seed(head_dim)
    query = torch.randn(SQ, B, HEADS, head_dim, generator=gen).to(torch.bfloat16)
    key = torch.randn(SQ, B, 1, head_dim, generator=gen).to(torch.bfloat16)
    return query, key, torch.randint(0, SQ, (B, SQ, TOPK), generator=gen)


@pytest.mark.parametrize("v_channels, tail", [(64, 64), (512, 64), (128, 32)])
def test_power_of_two_heads_reach_the_kernel_with_their_value_dim(monkeypatch, v_channels: int, tail: int) -> None:
    kernel = RecordingSparseMLA()
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", kernel)
    query, key, indices = _inputs(v_channels + tail)
    out = tilelang_dsa.fused_sparse_mla_absorbed(query, key, indices, 0.1, v_channels, strict_fused_paths=True)
    assert out is not None and out.shape == (SQ, B, HEADS, v_channels)
    assert kernel.d_v == [v_channels]


@pytest.mark.parametrize("v_channels, tail, culprit", [(64, 48, "rope tail"), (96, 64, "v_channels 96"), (64, 8, "rope tail")])
def test_other_heads_decline_naming_the_dimension(monkeypatch, v_channels: int, tail: int, culprit: str) -> None:
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", RecordingSparseMLA())
    query, key, indices = _inputs(v_channels + tail)
    with pytest.raises(fused_decline.FusedDSAPathDeclined, match=culprit):
        tilelang_dsa.fused_sparse_mla_absorbed(query, key, indices, 0.1, v_channels, strict_fused_paths=True)


def test_kernel_dimension_check_names_the_requirement() -> None:
    tilelang_utils._check_sparse_mla_dims(64, 64)
    with pytest.raises(AssertionError, match="rope tail dim to be a power of two >= 16, got 48"):
        tilelang_utils._check_sparse_mla_dims(64, 48)


def test_pinned_release_declines_nam56r_head(pinned_release, monkeypatch) -> None:
    """The bug: the pinned release's gate only takes the 576 = 512 + 64 head."""
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", RecordingSparseMLA())
    base = pinned_release.definition(tilelang_dsa, TILELANG_DSA_PATH, "fused_sparse_mla_absorbed")
    query, key, indices = _inputs(128)
    assert base(query, key, indices, 0.1, 64) is None
    assert "dim_plus_tail_dim == 576" in pinned_release.source(
        "megatron/core/transformer/experimental_attention_variant/ops/tilelang_sparse_mla_fwd.py")
