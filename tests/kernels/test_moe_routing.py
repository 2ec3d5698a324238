"""nam56r_kernels.moe_routing: the reference against Megatron's TopKRouter.routing and against the sequence-level aux
loss written out per sequence; the Triton kernels against the reference under Triton's CPU interpreter (forward,
backward through either output or both, several shapes, ties, determinism) and on a GPU at NAM56R's router shape; the
launch and host-op budget; and the seam's errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nam56r_kernels import moe_routing
from nam56r_kernels.moe_routing import sigmoid_topk_routing, sigmoid_topk_routing_reference

AUX_GRAD = 7.0


def inputs(seq_len: int, batch: int, experts: int, bias: bool, seed: int, device: str = "cpu"):
    """Logits [S * B, E] (randn * 2: no two keys tie), an expert bias or None, and the probs' incoming gradient."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = 2 * torch.randn(seq_len * batch, experts, generator=g, device=device)
    expert_bias = 0.1 * torch.randn(experts, generator=g, device=device) if bias else None
    grad = torch.randn(seq_len * batch, experts, generator=g, device=device)
    return logits, expert_bias, grad


def run(fn, logits: torch.Tensor, grad: torch.Tensor | None, aux_grad: bool = True, **kwargs):
    """fn's four outputs and dlogits of (probs * grad).sum() + aux_loss * AUX_GRAD (either term left out: grad=None,
    aux_grad=False; dlogits None when neither is there)."""
    x = logits.clone().requires_grad_()
    probs, routing_map, aux_loss, tokens_per_expert = fn(x, **kwargs)
    terms = ([(probs * grad).sum()] if grad is not None else []) + ([aux_loss * AUX_GRAD] if aux_grad and aux_loss is not None else [])
    if terms:
        sum(terms).backward()
    return probs.detach(), routing_map, None if aux_loss is None else aux_loss.detach(), tokens_per_expert, x.grad


def assert_matches(got, want, coeff: float) -> None:
    """Kernel against reference. probs: the same fp32 quotients but for the order of a topk-term sum (rtol 1e-6, a few
    ulps). aux_loss: fp32 sums over S and B * E in another order (rtol 1e-5). dlogits: g/D - (sum g s)/D^2 cancels, so
    its error is absolute, a few ulps of terms up to ~10x the largest gradient; both implementations measured within
    4e-7 * max|dlogits| of an fp64 evaluation, so they agree to 2e-6 * max|dlogits| (rtol 1e-5 for the rest)."""
    probs, routing_map, aux_loss, tokens_per_expert, dlogits = got
    ref_probs, ref_map, ref_aux, ref_tokens, ref_dlogits = want
    assert probs.dtype == torch.float32 and routing_map.dtype == torch.bool and tokens_per_expert.dtype == torch.int64
    assert torch.equal(routing_map, ref_map) and torch.equal(tokens_per_expert, ref_tokens)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=0)
    if coeff:
        assert aux_loss.shape == () and aux_loss.dtype == torch.float32
        torch.testing.assert_close(aux_loss, ref_aux, rtol=1e-5, atol=0)
    else:
        assert aux_loss is None and ref_aux is None
    if ref_dlogits is None:
        assert dlogits is None
    else:
        torch.testing.assert_close(dlogits, ref_dlogits, rtol=1e-5, atol=2e-6 * ref_dlogits.abs().max().item())


def test_the_sequence_aux_loss_is_the_switch_loss_of_each_sequence_averaged(megatron_built) -> None:
    """The reference's aux loss, written out independently: per sequence b, E * coeff * sum_e f_e P_e with f_e the share
    of its S * topk aux selections on e and P_e its mean normalized score; averaged over the B sequences."""
    seq_len, batch, experts, topk, coeff = 11, 3, 6, 2, 1e-2
    logits, expert_bias, _ = inputs(seq_len, batch, experts, bias=True, seed=0)
    _, _, aux_loss, _ = sigmoid_topk_routing_reference(logits, topk, expert_bias, None, coeff, batch)
    losses = []
    for b in range(batch):
        scores = torch.sigmoid(logits.view(seq_len, batch, experts)[:, b].double())
        q = scores / scores.sum(dim=-1, keepdim=True)
        chosen = torch.zeros_like(q).scatter_(1, q.topk(topk, dim=-1).indices, 1.0)
        losses.append(experts * coeff * (chosen.sum(0) / (seq_len * topk) * q.mean(0)).sum())
    torch.testing.assert_close(aux_loss.double(), torch.stack(losses).mean(), rtol=1e-6, atol=0)


ROUTER_SCRIPT = textwrap.dedent(
    """
    import torch
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig
    from nam56r_kernels.moe_routing import sigmoid_topk_routing_reference
    from tests.kernels.test_moe_routing import inputs

    seq_len, batch, experts, topk, coeff, scaling = 12, 3, 16, 4, 1e-4, 2.5
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_moe_experts=experts,
                               moe_router_topk=topk, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                               moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=coeff,
                               moe_router_topk_scaling_factor=scaling, moe_router_dtype="fp32", use_cpu_initialization=True)
    cuda_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # the router's buffers, on a CPU host
    try:
        router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    finally:
        torch.cuda.current_device = cuda_device
    router.set_layer_number(1)
    router.train()
    logits, expert_bias, grad = inputs(seq_len, batch, experts, bias=True, seed=1)
    router.expert_bias.copy_(expert_bias)

    x = logits.view(seq_len, batch, experts).clone().requires_grad_()
    probs, routing_map = router.routing(x)
    (probs * grad).sum().backward()  # MoEAuxLossAutoScaler adds d aux_loss = 1 (its default scale)
    aux_logged = get_moe_metrics_tracker()._metrics["seq_load_balancing_loss"].values[0] * coeff  # aux_loss / coeff

    y = logits.clone().requires_grad_()
    ref_probs, ref_map, aux_loss, tokens_per_expert = sigmoid_topk_routing_reference(y, topk, expert_bias, scaling, coeff, batch)
    ((ref_probs * grad).sum() + aux_loss).backward()
    assert torch.equal(probs, ref_probs) and torch.equal(routing_map, ref_map)
    assert torch.equal(router.local_tokens_per_expert, tokens_per_expert.float())
    torch.testing.assert_close(aux_loss, aux_logged, rtol=1e-6, atol=0)
    assert torch.equal(x.grad.view(-1, experts), y.grad)
    print("reference is TopKRouter.routing")
    """
)


def test_the_reference_is_megatrons_topk_router(run_interpreted, megatron_built) -> None:
    """A real TopKRouter (sigmoid, expert bias, seq_aux_loss, scaling factor) on a one-rank gloo world, in a fresh process
    (the run_interpreted fixture's; no kernel runs): the same probs, map, logged aux loss, expert-load update and logits
    gradient, bit for bit but the logged loss (divided by coeff and multiplied back)."""
    stdout = run_interpreted(ROUTER_SCRIPT, timeout=600)
    assert "reference is TopKRouter.routing" in stdout, stdout


KERNEL_SCRIPT = textwrap.dedent(
    """
    import torch
    from nam56r_kernels.moe_routing import sigmoid_topk_routing, sigmoid_topk_routing_reference
    from tests.kernels.test_moe_routing import assert_matches, inputs, run

    # (S, B, E, topk, bias, scaling, coeff): B of 1, 3 and 4; 16 experts and 6 or 200 (padded to 8 and 256); topk 1, 4
    # and 8; S = 70 spans two 64-position blocks and S = 20 at E = 200 three 8-position blocks, the last partial.
    cases = [(10, 3, 16, 4, True, 2.5, 1e-4), (7, 4, 6, 1, False, None, 1e-4), (5, 1, 6, 4, True, None, 0.0),
             (9, 4, 16, 1, True, 1.5, 1e-4), (70, 1, 16, 4, False, None, 1e-4), (20, 2, 200, 8, True, 2.5, 1e-4),
             (6, 3, 16, 4, False, 2.5, 0.0)]
    for seed, (seq_len, batch, experts, topk, bias, scaling, coeff) in enumerate(cases):
        logits, expert_bias, grad = inputs(seq_len, batch, experts, bias, seed)
        kwargs = dict(topk=topk, expert_bias=expert_bias, scaling_factor=scaling, seq_aux_coeff=coeff, seq_aux_batch=batch)
        got = run(sigmoid_topk_routing, logits, grad, **kwargs)
        assert_matches(got, run(sigmoid_topk_routing_reference, logits, grad, **kwargs), coeff)
        if seed == 0:
            # The gradient through one output alone (autograd passes None for the other), and through neither.
            for grad_probs, aux_grad in ((grad, False), (None, True), (None, False)):
                assert_matches(run(sigmoid_topk_routing, logits, grad_probs, aux_grad, **kwargs),
                               run(sigmoid_topk_routing_reference, logits, grad_probs, aux_grad, **kwargs), coeff)
            again = run(sigmoid_topk_routing, logits, grad, **kwargs)
            assert torch.equal(again[2], got[2]) and torch.equal(again[4], got[4])  # fixed-order sums, no atomics
        print("moe routing ok", seq_len, batch, experts, topk)

    # Exact ties: the lower expert index wins, among equal biased keys for the routing (experts 2, 3, then 0) and among
    # equal scores for the aux selection (experts 0, 1, 2: with q = 1/6 everywhere, the aux gradient alone is positive
    # exactly on the aux-selected experts).
    kwargs = dict(topk=3, expert_bias=torch.tensor([0.0, 0, 1, 1, 0, 0]), seq_aux_coeff=1e-2, seq_aux_batch=2)
    _, routing_map, aux_loss, tokens, dlogits = run(sigmoid_topk_routing, torch.zeros(4 * 2, 6), None, **kwargs)
    assert routing_map.tolist() == [[True, False, True, True, False, False]] * 8 and tokens.tolist() == [8, 0, 8, 8, 0, 0]
    assert (dlogits > 0).tolist() == [[True, True, True, False, False, False]] * 8
    # sum P F = B * 3 * (S / 6) * S, times E * coeff / (topk * S * S) / B.
    torch.testing.assert_close(aux_loss, torch.tensor(2 * 3 * (4 / 6) * 4 * 6 * 1e-2 / (3 * 4 * 4) / 2))
    print("moe routing ties ok")
    """
)


def test_the_kernels_match_the_reference_under_the_triton_interpreter(run_interpreted, megatron_built) -> None:
    stdout = run_interpreted(KERNEL_SCRIPT, timeout=600)
    assert stdout.count("moe routing ok") == 7 and "moe routing ties ok" in stdout, stdout


def test_forward_is_two_launches_and_backward_one_with_only_allocations_besides(monkeypatch) -> None:
    """The host's work, kernels stubbed out: the forward launches the routing and reduction kernels, the backward one
    kernel, and neither calls a torch op that runs on the device (no copies, fills or reductions; no .item())."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    launches: list[str] = []

    class Stub:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(self.name)

    for name in ("_routing_fwd", "_routing_reduce", "_routing_bwd"):
        monkeypatch.setattr(moe_routing, name, Stub(name))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits, expert_bias, grad = inputs(8, 2, 16, bias=True, seed=0)
    x = logits.requires_grad_()
    no_device_work = {"aten.empty.memory_format", "aten.empty_like.default", "aten.view.dtype", "aten.detach.default"}
    with HostOps() as forward:
        probs, _, aux_loss, _ = sigmoid_topk_routing(x, 4, expert_bias, 2.5, 1e-4, 2)
    assert launches == ["_routing_fwd", "_routing_reduce"] and forward.ops <= no_device_work, forward.ops
    aux_grad = torch.tensor(AUX_GRAD)
    with HostOps() as backward:
        torch.autograd.grad([probs, aux_loss], [x], [grad, aux_grad])
    assert launches[2:] == ["_routing_bwd"] and backward.ops <= no_device_work, backward.ops


def test_the_kernels_package_does_not_import_megatron(run_interpreted) -> None:
    script = "import sys, nam56r_kernels.moe_routing\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))"
    stdout = run_interpreted(script)
    assert stdout.strip() == "[]", stdout


def test_bad_inputs_raise_naming_the_problem(monkeypatch) -> None:
    logits, expert_bias, _ = inputs(4, 2, 6, bias=True, seed=0)
    for fn in (sigmoid_topk_routing, sigmoid_topk_routing_reference):
        with pytest.raises(ValueError, match=r"logits must be an fp32 \[T, E\] tensor, got torch.bfloat16 \(8, 6\)"):
            fn(logits.bfloat16(), 2)
        with pytest.raises(ValueError, match=r"logits must be an fp32 \[T, E\] tensor, got torch.float32 \(8, 6, 1\)"):
            fn(logits[..., None], 2)
        with pytest.raises(ValueError, match=r"1 to 256 experts and at least one token, got \[T, E\] = \[8, 300\]"):
            fn(torch.zeros(8, 300), 2)
        with pytest.raises(ValueError, match=r"at least one token, got \[T, E\] = \[0, 6\]"):
            fn(logits[:0], 2)
        for topk in (0, 7, 2.0):
            with pytest.raises(ValueError, match=rf"topk must be an int in \[1, E = 6\], got {topk}"):
                fn(logits, topk)
        with pytest.raises(ValueError, match=r"expert_bias must be fp32 \[E\] = \[6\] on cpu or None, got torch.float32 \(5,\)"):
            fn(logits, 2, expert_bias[:5])
        with pytest.raises(ValueError, match=r"expert_bias must be fp32 \[E\] = \[6\] on cpu or None, got torch.float64 \(6,\)"):
            fn(logits, 2, expert_bias.double())
        with pytest.raises(ValueError, match="scaling_factor must be a finite number or None, got 'x'"):
            fn(logits, 2, scaling_factor="x")
        with pytest.raises(ValueError, match="seq_aux_coeff must be a finite number >= 0, got -0.1"):
            fn(logits, 2, seq_aux_coeff=-0.1)
        with pytest.raises(ValueError, match="seq_aux_batch must be an int >= 1 \\(the micro batch\\), got 0"):
            fn(logits, 2, seq_aux_batch=0)
        with pytest.raises(ValueError, match="T = 8 tokens is not S \\* B for seq_aux_batch B = 3"):
            fn(logits, 2, seq_aux_batch=3)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use sigmoid_topk_routing_reference"):
        sigmoid_topk_routing(logits, 2, expert_bias, seq_aux_coeff=1e-4, seq_aux_batch=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the MoE routing kernels run on CUDA only")
def test_the_kernels_match_the_reference_on_gpu_at_nam56rs_router_shape(megatron_built) -> None:
    """32768 tokens (S = 4096, B = 8), 16 experts, top-4, expert bias, seq aux coeff 1e-4: the same selections and counts,
    values within the interpreter test's tolerances, bit-identical reruns; two kernels forward, one backward."""
    seq_len, batch, experts, topk, coeff = 4096, 8, 16, 4, 1e-4
    logits, expert_bias, grad = inputs(seq_len, batch, experts, bias=True, seed=3, device="cuda")
    kwargs = dict(topk=topk, expert_bias=expert_bias, scaling_factor=None, seq_aux_coeff=coeff, seq_aux_batch=batch)
    got = run(sigmoid_topk_routing, logits, grad, **kwargs)
    assert_matches(got, run(sigmoid_topk_routing_reference, logits, grad, **kwargs), coeff)
    again = run(sigmoid_topk_routing, logits, grad, **kwargs)
    assert torch.equal(again[2], got[2]) and torch.equal(again[4], got[4])

    x = logits.clone().requires_grad_()
    aux_grad = torch.tensor(AUX_GRAD, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as forward:
        probs, _, aux_loss, _ = sigmoid_topk_routing(x, **kwargs)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as backward:
        torch.autograd.grad([probs, aux_loss], [x], [grad, aux_grad])
        torch.cuda.synchronize()
    kernels = [[e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA] for prof in (forward, backward)]
    assert [len(k) for k in kernels] == [2, 1], kernels
    print("MOE_ROUTING_GPU_OK")
