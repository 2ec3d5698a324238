"""nam56r_kernels.dsa_indexer: the references against Megatron's patched naive indexer, the fused Triton
kernels against the references (under Triton's CPU interpreter here, at NAM56R's shape on a GPU), and the
seam's errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels.dsa_indexer import (
    index_scores_fused,
    index_scores_reference,
    index_topk_fused,
    index_topk_reference,
)


def random_indexer_inputs(sq: int, batch: int, heads: int, dim: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    generator = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(sq, batch, heads, dim, generator=generator, device=device).to(dtype)
    k = torch.randn(sq, batch, dim, generator=generator, device=device).to(dtype)
    weights = torch.randn(sq, batch, heads, generator=generator, device=device).to(dtype)
    return q, k, weights


def assert_same_topk(ref_all_scores, ref_scores, scores, indices, atol: float) -> None:
    """The fused selection equals the reference's except where scores tie (within the fp32 summation-order
    error): the kept scores match the reference's rank by rank, in descending order, and each kept index is a
    distinct key whose reference score (``ref_all_scores``, the full masked [b, sq, sk] scores) is its kept score."""
    assert scores.shape == ref_scores.shape and indices.shape == ref_scores.shape, (scores.shape, ref_scores.shape)
    assert indices.dtype == torch.int32 and scores.dtype == torch.float32, (indices.dtype, scores.dtype)
    empty = torch.isneginf(ref_scores)
    assert torch.equal(torch.isneginf(scores), empty), "slots without a visible key differ"
    assert torch.equal(indices == -1, empty), "an index must be -1 exactly where its slot found no visible key"
    torch.testing.assert_close(scores[~empty], ref_scores[~empty], atol=atol, rtol=0)
    assert bool((scores[..., :-1] >= scores[..., 1:]).all()), "kept scores are not in descending order"
    ordered = indices.sort(dim=-1).values
    assert not bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()), "duplicate keys in a row"
    at_kept = ref_all_scores.gather(-1, indices.clamp(min=0).long())
    torch.testing.assert_close(at_kept[~empty], scores[~empty], atol=atol, rtol=0)


# ---------------------------------------------------------------------------- references vs Megatron's naive path


def _causal_float_mask(seq: int) -> torch.Tensor:
    return torch.zeros(seq, seq).masked_fill_(torch.ones(seq, seq, dtype=torch.bool).triu_(1), float("-inf"))


@pytest.mark.parametrize("use_relu", [True, False])
def test_scores_reference_is_megatrons_patched_naive_scores(use_relu: bool) -> None:
    dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
    q, k, weights = random_indexer_inputs(23, 2, 4, 16, torch.bfloat16, seed=0)
    expected = dsa._compute_index_scores(q, weights, k, use_relu=use_relu)
    assert torch.equal(index_scores_reference(q, k, weights, use_relu=use_relu), expected)
    causal = index_scores_reference(q, k, weights, use_relu=use_relu, causal=True)
    assert torch.equal(causal, expected + _causal_float_mask(23))


def test_topk_reference_is_megatrons_naive_causal_topk() -> None:
    dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
    # 4 heads of continuous values: no exact ties, so the selections must be identical, not just equivalent.
    q, k, weights = random_indexer_inputs(40, 2, 4, 16, torch.float32, seed=1)
    _, expected = dsa.fused_qk_topk_naive(q, k, weights, 8, mask=_causal_float_mask(40), use_relu=False)
    scores, indices = index_topk_reference(q, k, weights, 8, use_relu=False)
    assert torch.equal(indices.long(), expected)
    assert torch.equal(indices[:, :7] == -1, torch.isneginf(scores[:, :7]))
    assert bool((indices[:, 0, 1:] == -1).all()) and bool((indices[:, 0, 0] == 0).all()), "query 0 sees key 0 only"


# ---------------------------------------------------------------------------- fused, on Triton's CPU interpreter

# Triton 3.6's interpreter multiplies bf16 tiles as raw bits, so the CPU comparison runs fp32 and fp16;
# the GPU test below covers bf16 at NAM56R's shape. Shapes are off the block sizes on purpose.
INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.dsa_indexer import index_scores_fused, index_scores_reference, index_topk_fused, index_topk_reference
    from tests.kernels.test_dsa_indexer import assert_same_topk, random_indexer_inputs

    for dtype, atol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
        q, k, w = random_indexer_inputs(70, 2, 3, 16, dtype, seed=0)
        for causal in (False, True):
            for use_relu in (True, False):
                ref = index_scores_reference(q, k, w, use_relu=use_relu, causal=causal)
                fused = index_scores_fused(q, k, w, use_relu=use_relu, causal=causal)
                assert fused.dtype == torch.float32 and fused.shape == (2, 70, 70)
                assert torch.equal(torch.isneginf(fused), torch.isneginf(ref))
                torch.testing.assert_close(fused.nan_to_num(neginf=0.0), ref.nan_to_num(neginf=0.0), atol=atol, rtol=1e-4)
                print("scores ok", dtype, causal, use_relu)

    q, k, w = random_indexer_inputs(37, 2, 2, 16, torch.float32, seed=1)
    # topk 16: one running block; 5: fewer kept than a block, queries 0..3 short of keys; 40 > sk: all keys kept.
    for topk, causal, use_relu in ((16, True, False), (5, True, True), (40, True, False), (9, False, False)):
        ref_scores, _ = index_topk_reference(q, k, w, topk, use_relu=use_relu, causal=causal)
        scores, idx = index_topk_fused(q, k, w, topk, use_relu=use_relu, causal=causal)
        ref_all = index_scores_reference(q, k, w, use_relu=use_relu, causal=causal)
        assert_same_topk(ref_all, ref_scores, scores, idx, atol=1e-4)
        print("topk ok", topk, causal, use_relu)

    # Small integers make every score exact and tie often: the selection must be exactly a stable sort's
    # (score descending, equal scores in ascending key order), with -inf / -1 past the visible keys.
    g = torch.Generator().manual_seed(2)
    q, k, w = (torch.randint(-2, 3, shape, generator=g).float() for shape in ((45, 2, 2, 16), (45, 2, 16), (45, 2, 2)))
    for topk, causal in ((7, True), (20, False), (45, True)):
        all_scores = index_scores_reference(q, k, w, use_relu=False, causal=causal)
        expected_scores, expected = all_scores.sort(dim=-1, descending=True, stable=True)
        expected_scores, expected = expected_scores[..., :topk], expected[..., :topk].to(torch.int32)
        expected = expected.masked_fill(torch.isneginf(expected_scores), -1)
        scores, idx = index_topk_fused(q, k, w, topk, use_relu=False, causal=causal)
        assert torch.equal(idx, expected) and torch.equal(scores, expected_scores), (topk, causal)
        print("ties ok", topk, causal)
    """
)


def test_fused_kernels_match_references_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(INTERPRETER_SCRIPT, timeout=600)
    assert stdout.count("scores ok") == 8 and stdout.count("topk ok") == 4 and stdout.count("ties ok") == 3, stdout


def test_same_topk_check_catches_a_wrong_selection() -> None:
    q, k, w = random_indexer_inputs(12, 1, 2, 16, torch.float32, seed=2)
    everything = index_scores_reference(q, k, w, use_relu=False, causal=True)
    scores, indices = index_topk_reference(q, k, w, 4, use_relu=False)
    assert_same_topk(everything, scores, scores, indices, atol=1e-4)
    duplicated = indices.clone()
    duplicated[0, 11, 1] = duplicated[0, 11, 0]
    with pytest.raises(AssertionError, match="duplicate keys"):
        assert_same_topk(everything, scores, scores, duplicated, atol=1e-4)
    swapped = indices.clone()
    swapped[0, 11, 0] = int(everything[0, 11, :12].argmin())  # a visible key that was not kept
    with pytest.raises(AssertionError):
        assert_same_topk(everything, scores, scores, swapped, atol=1e-4)
    with pytest.raises(AssertionError, match="found no visible key"):
        assert_same_topk(everything, scores, scores, indices.masked_fill(indices == 0, -1), atol=1e-4)


# ---------------------------------------------------------------------------- the seam


@pytest.mark.parametrize("fused", [index_scores_fused, index_topk_fused])
def test_fused_refuses_cpu_tensors_without_the_interpreter(fused, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, w = random_indexer_inputs(8, 1, 2, 16, torch.float32, seed=0)
    args = (q, k, w) if fused is index_scores_fused else (q, k, w, 4)
    with pytest.raises(RuntimeError, match=r"needs CUDA tensors, got device cpu; use index_(scores|topk)_reference for CPU"):
        fused(*args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, w: (q[..., :12], k[..., :12], w), r"power of two >= 16, got 12"),
        (lambda q, k, w: (q, k[:, :1], w), r"k must be \[sk, b=2, D=16\]"),
        (lambda q, k, w: (q, k, w[:, :, :1]), r"weights must be \[sq, b, H\] = \(8, 2, 2\)"),
        (lambda q, k, w: (q, k.half(), w), r"q and k must share a dtype"),
        (lambda q, k, w: (q[0], k, w), r"expected q \[sq, b, H, D\]"),
        (lambda q, k, w: (q, k[:5], w), r"causal scores need sq == sk, got sq=8, sk=5"),
    ],
)
def test_bad_inputs_raise_naming_the_problem(change, message: str) -> None:
    q, k, w = change(*random_indexer_inputs(8, 2, 2, 16, torch.float32, seed=0))
    with pytest.raises((ValueError, TypeError), match=message):
        index_topk_reference(q, k, w, 4)


def test_topk_must_be_a_positive_int() -> None:
    q, k, w = random_indexer_inputs(8, 1, 2, 16, torch.float32, seed=0)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="topk must be a positive int"):
            index_topk_reference(q, k, w, bad)


# ---------------------------------------------------------------------------- GPU, NAM56R's indexer shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the fused indexer kernels run on CUDA only")
def test_fused_indexer_matches_reference_on_gpu_at_nam56r_shape() -> None:
    # seq 4096, 32 index heads of 64, bf16, relu, top-256 (micro-batch 1 keeps the fp32 reference in memory).
    q, k, w = random_indexer_inputs(4096, 1, 32, 64, torch.bfloat16, seed=0, device="cuda")
    ref = index_scores_reference(q, k, w, causal=True)
    fused = index_scores_fused(q, k, w, causal=True)
    visible = ~torch.isneginf(ref)
    assert torch.equal(visible, ~torch.isneginf(fused))
    rel = ((fused - ref)[visible].abs().max() / ref[visible].abs().max()).item()
    assert rel < 1e-5, rel
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    scores, indices = index_topk_fused(q, k, w, 256)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    outputs = scores.numel() * 4 + indices.numel() * 4
    one_sequence_scores = 4096 * 4096 * 4
    assert extra <= outputs + one_sequence_scores + (1 << 20), f"top-k used {extra} bytes beyond its inputs for {outputs} bytes of output"
    ref_scores, ref_indices = index_topk_reference(q, k, w, 256)
    ref_scores, ref_indices, scores, indices = (t.cpu() for t in (ref_scores, ref_indices, scores, indices))
    torch.testing.assert_close(scores[~torch.isneginf(ref_scores)], ref_scores[~torch.isneginf(ref_scores)],
                               atol=1e-5 * float(ref.abs().max()), rtol=0)
    same = (scores.sort(-1).values == ref_scores.sort(-1).values).all(-1)
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) for a, b in zip(indices[0], ref_indices[0], strict=True)])
    print(f"DSA_INDEXER_GPU_OK rel_err={rel:.2e} topk_extra_bytes={extra} rows_identical={same.float().mean():.4f} "
          f"min_overlap={int(overlap.min())}/256")
