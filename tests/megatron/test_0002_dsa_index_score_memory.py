"""Patch megatron-lm 0002: DSA index scores accumulate per head instead of materializing an fp32
[sq, b, h, sk] tensor; forward and backward must equal the pinned release within fp32 tolerance."""

from __future__ import annotations

import pytest
import torch

dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
DSA_PATH = "megatron/core/transformer/experimental_attention_variant/dsa.py"
SHAPES = [  # (sq, sk, b, index heads, head dim)
    (16, 16, 1, 1, 8),
    (24, 40, 2, 4, 16),
    (33, 17, 3, 8, 32),
]


def _inputs(sq: int, sk: int, b: int, h: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, h, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(sk, b, d, generator=gen).to(torch.bfloat16)
    weights = torch.randn(sq, b, h, generator=gen).to(torch.bfloat16)
    return q, weights, k


@pytest.mark.parametrize("use_relu", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_index_scores_match_pinned_release(pinned_release, shape, use_relu: bool) -> None:
    original = pinned_release.definition(dsa, DSA_PATH, "_compute_index_scores")
    q, weights, k = _inputs(*shape, seed=sum(shape))
    expected = original(q, weights, k, use_relu=use_relu)
    actual = dsa._compute_index_scores(q, weights, k, use_relu=use_relu)
    assert actual.shape == expected.shape == (shape[2], shape[0], shape[1])
    assert actual.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_base_materializes_the_per_head_product(pinned_release) -> None:
    """The memory bug itself: the pinned release builds the [sq, b, h, sk] einsum product."""
    product = "torch.einsum('sbhd,tbd->sbht', q.float(), k.float())"
    assert pinned_release.source(DSA_PATH).count(product) == 2  # forward and backward recompute
    with open(dsa.__file__) as handle:
        assert "torch.einsum('sbhd,tbd->sbht'" not in handle.read()


class _FakeGroup:
    def size(self) -> int:
        return 1


class _FakePG:
    tp = _FakeGroup()


@pytest.mark.parametrize("use_relu", [True, False])
@pytest.mark.parametrize("sparse_loss", [True, False])
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_backward_gradients_match_pinned_release(pinned_release, shape, use_relu: bool, sparse_loss: bool) -> None:
    original = pinned_release.definition(dsa, DSA_PATH, "bwd_fused_indexer_loss_naive")
    sq, sk, b, h, d = shape
    q, weights, k = _inputs(*shape, seed=7 * sum(shape))
    gen = torch.Generator().manual_seed(11)
    heads = 2
    query = torch.randn(sq, b, heads, d, generator=gen).to(torch.bfloat16)
    key = torch.randn(sk, b, heads, d, generator=gen).to(torch.bfloat16)
    topk = min(8, sk)
    # Causal additive mask in the dtype the index scores use.
    mask = torch.triu(torch.full((sq, sk), float("-inf")), diagonal=1 + max(sk - sq, 0))
    _, topk_indices = dsa.fused_qk_topk_naive(q, k, weights, topk, mask=mask, use_relu=use_relu)
    kwargs = dict(
        topk_indices=topk_indices, softmax_scale=d**-0.5, loss_coeff=0.5, sparse_loss=sparse_loss,
        mask=mask, grad_loss=torch.tensor(1.3), pg_collection=_FakePG(), use_relu=use_relu,
    )
    expected = original(q, weights, k, query, key, **kwargs)
    actual = dsa.bwd_fused_indexer_loss_naive(q, weights, k, query, key, **kwargs)
    for name, a, e in zip(("grad_q", "grad_weights", "grad_k"), actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert torch.isfinite(a.float()).all(), name
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
