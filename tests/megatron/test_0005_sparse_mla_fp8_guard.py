"""Patch megatron-lm 0005: the fused sparse MLA path no longer takes a quantized (FP8) tensor wrapper
for a bf16 tensor. TransformerEngine is not installed here; a minimal torch.Tensor subclass stands in
for TE's Float8Tensor (logical dtype bf16, FP8 payload in `_data`, `_scale_inv`, `dequantize`, and a
__torch_dispatch__ that, like TE's fallback, runs other ops on the dequantized value). The TileLang
kernel cannot run on CPU, so SparseMLA is replaced by a recorder of what the kernel would receive."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._pytree import tree_map

tilelang_dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.ops.tilelang_dsa")
from megatron.core.transformer.experimental_attention_variant import dsa_tilelang_kernels  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

TILELANG_DSA_PATH = "megatron/core/transformer/experimental_attention_variant/ops/tilelang_dsa.py"
SQ, B, HEADS, DIM, V_CHANNELS, TOPK = 8, 2, 16, 576, 512, 64


class StandInFloat8Tensor(torch.Tensor):
    """Reports bf16 like TE's Float8Tensor; the values live in an FP8 `_data` times `_scale_inv`."""

    @staticmethod
    def __new__(cls, value: torch.Tensor):
        self = torch.Tensor._make_wrapper_subclass(cls, value.shape, dtype=torch.bfloat16, device=value.device)
        scale = 448.0 / value.abs().max().clamp_min(1e-12).float()
        self._data = (value.float() * scale).to(torch.float8_e4m3fn)
        self._scale_inv = scale.reciprocal()
        return self

    def dequantize(self) -> torch.Tensor:
        return (self._data.float() * self._scale_inv).to(torch.bfloat16)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class RecordingSparseMLA:
    """Records the tensors handed to the kernel and returns a correctly shaped output."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def apply(self, query_bshd, key_bshd, indices, softmax_scale, d_v=V_CHANNELS):
        self.calls.append((query_bshd, key_bshd))
        b, s, h, _ = query_bshd.shape
        return torch.zeros(b, s, h, d_v, dtype=torch.bfloat16), None


@pytest.fixture
def kernel(monkeypatch) -> RecordingSparseMLA:
    recorder = RecordingSparseMLA()
    monkeypatch.setattr(tilelang_dsa, "SparseMLA", recorder)
    monkeypatch.setattr(tilelang_dsa, "_DEQUANTIZE_WARNED", set())
    return recorder


def _inputs() -> tuple[StandInFloat8Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    query = StandInFloat8Tensor(torch.randn(SQ, B, HEADS, DIM, generator=gen))
    key = torch.randn(SQ, B, 1, DIM, generator=gen).to(torch.bfloat16)
    topk_indices = torch.randint(0, SQ, (B, SQ, TOPK), generator=gen)
    return query, key, topk_indices


def _config(**fp8) -> MLATransformerConfig:
    return MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=HEADS, kv_lora_rank=V_CHANNELS, **fp8)


def test_stand_in_passes_the_dtype_check() -> None:
    query, _, _ = _inputs()
    assert query.dtype == torch.bfloat16 and query._data.dtype == torch.float8_e4m3fn
    assert tilelang_dsa._quantized_tensor_class(query) == "StandInFloat8Tensor"
    assert tilelang_dsa._quantized_tensor_class(query.dequantize()) is None
    assert tilelang_dsa._quantized_tensor_class(torch.nn.Parameter(torch.zeros(2))) is None


def test_pinned_release_accepts_the_stand_in_silently(pinned_release, kernel, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    original = pinned_release.definition(tilelang_dsa, TILELANG_DSA_PATH, "fused_sparse_mla_absorbed")
    query, key, topk_indices = _inputs()
    out = original(query, key, topk_indices, DIM**-0.5, V_CHANNELS)
    assert out is not None and out.shape == (SQ, B, HEADS, V_CHANNELS)
    (query_bshd, _), = kernel.calls  # the wrapper went on to the kernel launch ...
    assert type(query_bshd) is torch.Tensor  # ... its FP8 storage dropped by the wrapper's own fallback
    assert caplog.records == []  # ... without a word


def test_default_dequantizes_with_one_warning_naming_the_cost(kernel, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=tilelang_dsa.logger.name)
    query, key, topk_indices = _inputs()
    for _ in range(3):
        out = dsa_tilelang_kernels.run_fused_absorbed_sparse_attention(
            query, key, topk_indices, DIM**-0.5, V_CHANNELS, config=_config()
        )
        assert out is not None and out.shape == (SQ, B, HEADS, V_CHANNELS)
    assert len(kernel.calls) == 3
    for query_bshd, key_bshd in kernel.calls:
        assert type(query_bshd) is torch.Tensor and type(key_bshd) is torch.Tensor
        assert query_bshd.dtype == torch.bfloat16
        torch.testing.assert_close(query_bshd, query.dequantize().permute(1, 0, 2, 3), rtol=0, atol=0)
    messages = [r.getMessage() for r in caplog.records if r.name == tilelang_dsa.logger.name]
    assert len(messages) == 1
    expected_mib = SQ * B * HEADS * DIM * 2 / 2**20
    assert "query is a quantized StandInFloat8Tensor and FP8 attention was not requested" in messages[0]
    assert f"extra dequantize kernel and a full torch.bfloat16 copy on every call ({expected_mib:.1f} MiB" in messages[0]


@pytest.mark.parametrize("knob", ["fp8_dot_product_attention", "fp8_multi_head_attention"])
def test_fp8_attention_requested_raises(kernel, knob: str) -> None:
    query, key, topk_indices = _inputs()
    with pytest.raises(NotImplementedError, match=r"query is a quantized StandInFloat8Tensor .* FP8 attention is requested"):
        dsa_tilelang_kernels.run_fused_absorbed_sparse_attention(
            query, key, topk_indices, DIM**-0.5, V_CHANNELS, config=_config(**{knob: True})
        )
    assert kernel.calls == []


def test_plain_bf16_inputs_are_untouched(kernel, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    query, key, topk_indices = _inputs()
    query = query.dequantize()
    dsa_tilelang_kernels.run_fused_absorbed_sparse_attention(
        query, key, topk_indices, DIM**-0.5, V_CHANNELS, config=_config(fp8_dot_product_attention=True)
    )
    (query_bshd, _), = kernel.calls
    torch.testing.assert_close(query_bshd, query.permute(1, 0, 2, 3), rtol=0, atol=0)
    assert caplog.records == []
