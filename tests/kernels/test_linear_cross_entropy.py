"""nam56r_kernels.linear_cross_entropy: the chunked path against the materialized reference (loss and both
gradients, under Triton's CPU interpreter here, at NAM56R's LM-head shape on a GPU), its argmax against the
exact logits within bf16's rounding (tests/kernels/logit_selection_testlib.py), the gradient-shape contract, and the
seam's errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels.linear_cross_entropy import _ROW_BLOCK, CHUNK_BYTES, linear_cross_entropy, linear_cross_entropy_reference

from tests.kernels.logit_selection_testlib import argmax_violations, predictions_without_the_last_vocab_block, selection_violations

INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

    g = torch.Generator().manual_seed(0)
    # V = 5000 spans two of the kernel's 4096-wide row blocks; 3-token chunks leave a 1-token tail.
    tokens, hidden_size, vocab = 10, 16, 5000
    hidden = torch.randn(tokens, hidden_size, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, hidden_size, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[[2, 7]] = -100
    mask = (torch.rand(tokens, generator=g) > 0.3).float()
    scale = 0.37
    for loss_weight in (None, mask):
        w = torch.ones(tokens) if loss_weight is None else loss_weight
        ref = linear_cross_entropy_reference(hidden, weight, labels)
        (ref * w * scale).sum().backward()
        ref_grads = hidden.grad.clone(), weight.grad.clone()
        hidden.grad = weight.grad = None
        loss, predictions = linear_cross_entropy(hidden, weight, labels, loss_weight, chunk_bytes=3 * vocab * 4)
        (loss * w * scale).sum().backward()
        assert torch.equal(predictions, (hidden @ weight.t()).argmax(-1)), predictions
        assert loss.dtype == torch.float32 and loss.shape == (tokens,) and float(loss[2]) == 0.0
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden.grad, ref_grads[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(weight.grad, ref_grads[1], atol=1e-5, rtol=1e-4)
        hidden.grad = weight.grad = None
        print("linear ce ok", loss_weight is None)

    # Evaluation: the logits GEMM per chunk only, no gradient GEMMs.
    real_matmul, calls = torch.matmul, []
    torch.matmul = lambda *args, **kwargs: calls.append(1) or real_matmul(*args, **kwargs)
    with torch.no_grad():
        evaluated = linear_cross_entropy(hidden, weight, labels, chunk_bytes=3 * vocab * 4).loss
    torch.matmul = real_matmul
    assert len(calls) == 4 and evaluated.grad_fn is None, calls  # 10 tokens in chunks of 3
    torch.testing.assert_close(evaluated, linear_cross_entropy_reference(hidden, weight, labels).detach(), atol=1e-5, rtol=1e-5)
    print("evaluation computes no gradients")

    loss = linear_cross_entropy(hidden, weight, labels).loss
    (loss * 0.5).sum().backward(retain_graph=True)
    try:
        (loss * 0.5).sum().backward()
    except RuntimeError as exc:
        assert "backward runs once" in str(exc), exc
        print("second backward refused")
    hidden.grad = weight.grad = None

    loss = linear_cross_entropy(hidden, weight, labels).loss
    try:
        (loss * torch.arange(tokens).float()).sum().backward()
    except RuntimeError as exc:
        assert "must be c * loss_weight" in str(exc), exc
        print("gradient shape refused")
    """
)


def test_chunked_linear_ce_matches_the_reference_under_the_triton_interpreter(run_interpreted) -> None:
    stdout = run_interpreted(INTERPRETER_SCRIPT, timeout=600)
    assert stdout.count("linear ce ok") == 2 and "gradient shape refused" in stdout, stdout
    assert "evaluation computes no gradients" in stdout and "second backward refused" in stdout, stdout


ARGMAX_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.linear_cross_entropy import linear_cross_entropy
    from tests.kernels.logit_selection_testlib import argmax_violations, predictions_without_the_last_vocab_block

    g = torch.Generator().manual_seed(0)
    # Two full 4096-wide row blocks, so one block short drops exactly the last; 12-token chunks leave a tail.
    tokens, hidden_size, vocab = 32, 64, 8192
    hidden = torch.randn(tokens, hidden_size, generator=g).bfloat16()
    weight = (0.1 * torch.randn(vocab, hidden_size, generator=g)).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    with torch.no_grad():
        predictions = linear_cross_entropy(hidden, weight, labels, chunk_bytes=12 * vocab * 2).predictions
    check = argmax_violations(hidden, weight, predictions)
    assert check.violations == 0 and check.decidable_mismatches == 0, check
    dropped = argmax_violations(hidden, weight, predictions_without_the_last_vocab_block(hidden, weight))
    assert dropped.violations > 0, dropped
    print(f"argmax ok decidable={check.decidable_share:.2f} dropped_block_violations={dropped.violations}")
    """
)


def test_the_interpreted_kernels_argmax_is_within_the_bound_and_a_dropped_vocab_block_is_not(run_interpreted) -> None:
    stdout = run_interpreted(ARGMAX_INTERPRETER_SCRIPT)
    assert "argmax ok" in stdout, stdout


def test_the_argmax_bound_accepts_rounding_and_rejects_what_rounding_cannot_explain() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 128, generator=g).bfloat16()
    weight = (0.1 * torch.randn(4096, 128, generator=g)).bfloat16()
    # Token 0's best logit (~128) has a twin about 0.05 below it, well inside bf16's rounding of ~0.5, and a
    # runner-up 5% (~6) below it, far outside.
    weight[0] = hidden[0]
    weight[1] = hidden[0]
    largest = hidden[0].float().abs().argmax()
    weight[1, largest] = (weight[1, largest].float() * (1 - 2**-7)).bfloat16()
    weight[2] = (0.95 * hidden[0].float()).bfloat16()
    exact = (hidden.double() @ weight.double().t()).argmax(-1)
    assert int(exact[0]) == 0

    # The modelled kernel: fp32 accumulation, logits rounded to bf16, then the first or the last of tied maxima.
    logits = (hidden.float() @ weight.float().t()).bfloat16()
    for predictions in (exact, logits.argmax(-1), logits.shape[1] - 1 - logits.flip(-1).argmax(-1)):
        check = argmax_violations(hidden, weight, predictions)
        assert check.violations == 0 and check.decidable_mismatches == 0, check
        assert check.decidable_share > 0.5, check.decidable_share

    twin = exact.clone()
    twin[0] = 1
    check = argmax_violations(hidden, weight, twin)
    assert check.violations == 0 and not check.decidable[0], check
    runner_up = exact.clone()
    runner_up[0] = 2
    assert argmax_violations(hidden, weight, runner_up).violations == 1
    # On a decidable row any other index is out of the bound.
    decided = int(check.decidable.nonzero()[0])
    other = exact.clone()
    other[decided] = (exact[decided] + 1) % weight.shape[0]
    check = argmax_violations(hidden, weight, other)
    assert check.violations == 1 and check.decidable_mismatches == 1, check
    outside = exact.clone()
    outside[3] = weight.shape[0]
    assert argmax_violations(hidden, weight, outside).violations == 1
    assert argmax_violations(hidden, weight, exact.roll(1)).violations > 0


def test_the_chunked_path_refuses_cpu_tensors_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use linear_cross_entropy_reference"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long))


def test_the_selection_bound_checks_a_top_k_as_a_set() -> None:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(32, 64, generator=g).bfloat16()
    weight = (0.1 * torch.randn(16, 64, generator=g)).bfloat16()
    logits = hidden.float() @ weight.float().t()
    top = logits.topk(4, dim=-1).indices
    check = selection_violations(hidden, weight, top.flip(-1), logits_dtype=torch.float32)
    assert check.violations == 0 and check.decidable_mismatches == 0 and check.decidable_share > 0.5, check
    lowest_for_best = top.clone()
    lowest_for_best[:, 0] = logits.argmin(-1)
    assert selection_violations(hidden, weight, lowest_for_best, logits_dtype=torch.float32).violations == 32
    repeated = top.clone()
    repeated[0, 1] = repeated[0, 0]
    assert selection_violations(hidden, weight, repeated, logits_dtype=torch.float32).violations == 1

@pytest.mark.parametrize(
    ("hidden", "weight", "labels", "error", "message"),
    [
        ((4, 8), (16, 4), (4,), ValueError, r"must be \[V, 8\]"),
        ((4, 8), (16, 8), (5,), ValueError, r"must be \[4\]"),
        ((4, 8), (16, 8, 1), (4,), ValueError, "expected hidden"),
    ],
)
def test_bad_shapes_are_named(hidden, weight, labels, error, message) -> None:
    with pytest.raises(error, match=message):
        linear_cross_entropy_reference(torch.randn(hidden), torch.randn(weight), torch.zeros(labels, dtype=torch.long))


def test_bad_dtypes_are_named() -> None:
    with pytest.raises(TypeError, match="share a floating dtype"):
        linear_cross_entropy_reference(torch.randn(4, 8), torch.randn(16, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        linear_cross_entropy_reference(torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the chunked path runs on CUDA only")
def test_chunked_linear_ce_matches_the_reference_on_gpu_at_the_lm_head_shape() -> None:
    # 4096 tokens of NAM56R's LM head (hidden 4096, vocab 131072), bf16; the reference holds 2 GiB of fp32 logits.
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(4096, 4096, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(131072, 4096, generator=g, device="cuda") * 0.02).bfloat16().requires_grad_()
    labels = torch.randint(0, 131072, (4096,), generator=g, device="cuda")
    scale = 1.0 / 4096
    ref = linear_cross_entropy_reference(hidden, weight, labels)
    (ref * scale).sum().backward()
    ref_grads = hidden.grad.float(), weight.grad.float()
    hidden.grad = weight.grad = None
    loss, predictions = linear_cross_entropy(hidden, weight, labels)
    (loss * scale).sum().backward()
    assert hidden.grad is not None and weight.grad is not None
    loss_err = (loss - ref).abs().max().item()
    grad_errs = [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip((hidden.grad, weight.grad), ref_grads, strict=True)]
    assert loss_err < 2e-2 and max(grad_errs) < 2e-2, (loss_err, grad_errs)

    # The argmax is of bf16-rounded logits, so it need not be the exact one: with ℓ the exact logits (fp64),
    # S_j = Σ_k |h_k w_jk| and γ = K·u/(1 - K·u), a logit the kernel sees is within δ_j = γ·S_j + 2^-8·(|ℓ_j| +
    # γ·S_j) of ℓ_j (fp32 accumulation in any order, then bf16 rounding). A correct argmax p has ℓ̂_p ≥ ℓ̂_j*,
    # so ℓ_j* - ℓ_p ≤ δ_p + δ_j* on every row (no violation), and p = j* wherever j*'s interval clears every
    # other logit's (the decidable rows). logit_selection_testlib derives u (tensor cores: 2^-22).
    check = argmax_violations(hidden, weight, predictions)
    assert check.violations == 0 and check.decidable_mismatches == 0, check
    # Whether the check decides enough rows to mean anything depends on the data alone: at this shape δ_j is
    # ~0.04 at the top logits, and most tokens' top-1/top-2 gaps exceed the ~0.08 that two such δ can close
    # (59% of the rows on an H200).
    assert check.decidable_share > 0.5, check.decidable_share

    # A real defect must fail it: the row kernel dropping its last vocab block on the first token chunk's
    # logits, predictions one token chunk off (the two chunks swapped), and predictions one vocab block off.
    chunk = CHUNK_BYTES // (weight.shape[0] * hidden.element_size())
    dropped = predictions.clone()
    dropped[:chunk] = predictions_without_the_last_vocab_block(hidden[:chunk], weight)
    defects = {
        "dropped_block": dropped,
        "chunk_shift": predictions.roll(chunk),
        "block_shift": (predictions + _ROW_BLOCK) % weight.shape[0],
    }
    defect_violations = {name: argmax_violations(hidden, weight, wrong).violations for name, wrong in defects.items()}
    assert all(count > 0 for count in defect_violations.values()), defect_violations
    print(f"LINEAR_CE_GPU_OK loss_err={loss_err:.2e} grad_hidden_rel={grad_errs[0]:.2e} grad_weight_rel={grad_errs[1]:.2e} "
          f"argmax_decidable={check.decidable_share:.3f} argmax_violations={check.violations} "
          + " ".join(f"{name}_violations={count}" for name, count in defect_violations.items()))
