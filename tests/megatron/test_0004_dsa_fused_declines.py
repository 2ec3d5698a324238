"""Patch megatron-lm 0004: a fused DSA path that declines says why, once, or raises in strict mode.

TileLang kernels cannot run on this CPU machine, so the tests use decline points evaluated before any
kernel launch (dtype, head dim, head count), reached through the real hooks the DSA layer calls.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
from megatron.core.transformer.experimental_attention_variant import dsa_kernels  # noqa: E402
from megatron.core.transformer.experimental_attention_variant.ops import (  # noqa: E402
    fused_decline,
    tilelang_dsa,
)
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

TILELANG_DSA_PATH = "megatron/core/transformer/experimental_attention_variant/ops/tilelang_dsa.py"
LOGGER = fused_decline.logger.name
SQ, B, HEADS, TOPK = 8, 2, 16, 64


@pytest.fixture(autouse=True)
def _fresh_warning_registry(monkeypatch) -> None:
    monkeypatch.setattr(fused_decline, "_WARNED", set())


def _config(*, strict: bool = False, backend: str = "tilelang") -> MLATransformerConfig:
    return MLATransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=HEADS, kv_lora_rank=128,
        dsa_kernel_backend=backend, dsa_strict_fused_paths=strict,
    )


def _sparse_attention_inputs(head_dim: int) -> dict:
    gen = torch.Generator().manual_seed(head_dim)
    return dict(
        absorbed_mla=True,
        query=torch.randn(SQ, B, HEADS, head_dim, generator=gen).to(torch.bfloat16),
        key=torch.randn(SQ, B, 1, head_dim, generator=gen).to(torch.bfloat16),
        value=None,
        up_v_weight=torch.randn(HEADS, 32, 128, generator=gen).to(torch.bfloat16),
        topk_indices=torch.randint(0, SQ, (B, SQ, TOPK), generator=gen),
        softmax_scale=head_dim**-0.5, mask=None, varlen_starts=None, varlen_ends=None, key_positions=None,
    )


def _indexer_inputs(dtype: torch.dtype, index_heads: int = 8) -> tuple:
    gen = torch.Generator().manual_seed(index_heads)
    q = torch.randn(SQ, B, index_heads, 32, generator=gen).to(dtype)
    k = torch.randn(SQ, B, 32, generator=gen).to(dtype)
    weights = torch.randn(SQ, B, index_heads, generator=gen)
    ends = torch.arange(1, SQ + 1, dtype=torch.int32)
    return q, k, weights, torch.zeros_like(ends), ends


def _decline_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_config_field_defaults_to_off() -> None:
    assert MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4).dsa_strict_fused_paths is False


def test_strict_sparse_mla_raises_naming_head_dim() -> None:
    """DSA layer's sparse attention, strict config: the TileLang SparseMLA decline is an error."""
    with pytest.raises(fused_decline.FusedDSAPathDeclined, match=r"sparse MLA declined: rope tail \(head dim - v_channels\) 72 is not"):
        dsa._run_sparse_attention(config=_config(strict=True), **_sparse_attention_inputs(200))


def test_strict_indexer_raises_naming_dtype() -> None:
    q, k, weights, starts, ends = _indexer_inputs(torch.float32)
    with pytest.raises(fused_decline.FusedDSAPathDeclined) as excinfo:
        dsa_kernels.run_fused_qk_topk(_config(strict=True), q, k, weights, 4, starts, ends, block_size=8)
    message = str(excinfo.value)
    assert message.startswith("fused TileLang DSA indexer declined: q and k must be bfloat16")
    assert "q.dtype=torch.float32, k.dtype=torch.float32" in message


def test_strict_indexer_loss_raises_naming_head_count() -> None:
    q, k, weights, starts, ends = _indexer_inputs(torch.bfloat16, index_heads=12)
    query = torch.randn(SQ, B, HEADS, 64).to(torch.bfloat16)
    key = torch.randn(SQ, B, 1, 64).to(torch.bfloat16)
    with pytest.raises(fused_decline.FusedDSAPathDeclined, match=r"indexer heads 12 unsupported"):
        dsa_kernels.run_fused_qk_topk_with_loss(
            _config(strict=True), q, k, weights, 4, starts, ends, block_size=8, query=query, key=key,
            softmax_scale=0.125, loss_coeff=1.0, pg_collection=None,
        )


def test_default_warns_once_per_reason_and_returns_the_pytorch_result(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    inputs = _sparse_attention_inputs(200)
    reference = dsa._run_sparse_attention(config=_config(backend="none"), **inputs)
    assert _decline_records(caplog) == []  # no fused backend selected: nothing declined

    for _ in range(3):
        output = dsa._run_sparse_attention(config=_config(), **inputs)
        torch.testing.assert_close(output, reference, rtol=0, atol=0)
    records = _decline_records(caplog)
    assert len(records) == 1
    assert records[0].startswith("fused sparse MLA declined: rope tail (head dim - v_channels) 72 is not a power of two >= 16")

    dsa._run_sparse_attention(config=_config(), **_sparse_attention_inputs(168))  # another reason: logged too
    records = _decline_records(caplog)
    assert len(records) == 2 and "rope tail (head dim - v_channels) 40 is not a power of two" in records[1]

    q, k, weights, starts, ends = _indexer_inputs(torch.float32)
    for _ in range(2):
        assert dsa_kernels.run_fused_qk_topk(_config(), q, k, weights, 4, starts, ends, block_size=8) is None
    records = _decline_records(caplog)
    assert len(records) == 3 and "q.dtype=torch.float32, k.dtype=torch.float32" in records[2]


def _sparse_mla_args() -> tuple:
    inputs = _sparse_attention_inputs(200)
    return inputs["query"], inputs["key"], inputs["topk_indices"], 0.1, 128


def _indexer_args() -> tuple:
    q, k, weights, starts, ends = _indexer_inputs(torch.float32)
    return q, k, weights, 4, starts, ends, 8


@pytest.mark.parametrize(
    "name, make_args, reason",
    [
        ("fused_sparse_mla_absorbed", _sparse_mla_args, "rope tail (head dim - v_channels) 72"),
        ("fused_qk_topk_lighting", _indexer_args, "q.dtype=torch.float32"),
    ],
)
def test_pinned_release_declines_silently(pinned_release, caplog, name: str, make_args, reason: str) -> None:
    caplog.set_level(logging.DEBUG)
    original = pinned_release.definition(tilelang_dsa, TILELANG_DSA_PATH, name)
    assert original(*make_args()) is None
    assert caplog.records == []  # the pinned release falls back without a word
    assert getattr(tilelang_dsa, name)(*make_args()) is None
    records = _decline_records(caplog)
    assert len(records) == 1 and reason in records[0]


def test_strict_mode_covers_backends_that_do_not_report(monkeypatch, caplog) -> None:
    """A backend returning None without a reason (cuDNN today) still raises in strict mode."""
    caplog.set_level(logging.DEBUG)
    silent = SimpleNamespace(run_fused_absorbed_sparse_attention=lambda *args, **kwargs: None)
    monkeypatch.setattr(dsa_kernels, "_load_backend", lambda config: silent)
    inputs = _sparse_attention_inputs(200)
    with pytest.raises(fused_decline.FusedDSAPathDeclined, match=r"the cudnn backend returned None"):
        dsa._run_sparse_attention(config=_config(strict=True, backend="cudnn"), **inputs)
    dsa._run_sparse_attention(config=_config(backend="cudnn"), **inputs)  # default: falls back
    assert _decline_records(caplog) == []
