"""nam56r_kernels.linear_cross_entropy: the chunked path against the materialized reference (loss and both
gradients, under Triton's CPU interpreter here, at NAM56R's LM-head shape on a GPU), the gradient-shape
contract, and the seam's errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

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


def test_the_chunked_path_refuses_cpu_tensors_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use linear_cross_entropy_reference"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long))


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
    assert (predictions == (hidden.detach() @ weight.detach().t()).argmax(-1)).float().mean() > 0.99
    loss_err = (loss - ref).abs().max().item()
    grad_errs = [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip((hidden.grad, weight.grad), ref_grads, strict=True)]
    assert loss_err < 2e-2 and max(grad_errs) < 2e-2, (loss_err, grad_errs)
    print(f"LINEAR_CE_GPU_OK loss_err={loss_err:.2e} grad_hidden_rel={grad_errs[0]:.2e} grad_weight_rel={grad_errs[1]:.2e}")
