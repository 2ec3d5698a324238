"""nam56r.model.moe_experts.GroupedMLPExperts against Megatron's SequentialMLP, built from one TransformerConfig on
CPU: same state-dict keys (strict load), same outputs and input/weight gradients, and the settings it rejects."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

NUM_EXPERTS = 4
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


@pytest.fixture(scope="module")
def groups(megatron_built):
    from nam56r.model.model import single_process_groups

    return single_process_groups()


def make_config(dtype: torch.dtype = torch.float32, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=32,
        moe_ffn_hidden_size=32,
        num_moe_experts=NUM_EXPERTS,
        add_bias_linear=False,
        gated_linear_unit=False,
        activation_func=F.gelu,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
    )
    return TransformerConfig(**{**fields, **overrides})


def build_pair(groups, config):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from nam56r.model.moe_experts import GroupedMLPExperts

    backend = LocalSpecProvider()
    submodules = MLPSubmodules(linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear())
    torch.manual_seed(0)
    sequential = SequentialMLP(NUM_EXPERTS, config, submodules, pg_collection=groups)
    torch.manual_seed(1)  # different init, so the strict load below is what makes them equal
    grouped = GroupedMLPExperts(NUM_EXPERTS, config, submodules, pg_collection=groups)
    return sequential, grouped


def test_same_state_dict_keys_and_shapes(groups):
    sequential, grouped = build_pair(groups, make_config())

    def shapes(module):  # the linears' _extra_state entries are None
        return {k: getattr(v, "shape", v) for k, v in module.state_dict().items()}

    assert shapes(sequential) == shapes(grouped)
    assert "local_experts.3.linear_fc2.weight" in shapes(grouped)
    assert [n for n, _ in sequential.named_parameters()] == [n for n, _ in grouped.named_parameters()]
    grouped.load_state_dict(sequential.state_dict(), strict=True)


def test_same_sharded_state_dict(groups):
    sequential, grouped = build_pair(groups, make_config())
    ref = sequential.sharded_state_dict(prefix="mlp.experts.")
    got = grouped.sharded_state_dict(prefix="mlp.experts.")
    assert ref.keys() == got.keys()
    for key, ref_ten in ref.items():
        assert (got[key].key, got[key].global_shape, got[key].global_offset) == (ref_ten.key, ref_ten.global_shape, ref_ten.global_offset)


def run(module, x, tokens_per_expert, probs, grad_out):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    output, bias = module(x, tokens_per_expert, probs)
    assert bias is None
    output.backward(grad_out)
    return output.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[5, 7, 3, 9], [0, 11, 0, 6]])
@pytest.mark.parametrize("probs_on_input", [False, True])
def test_matches_sequential_mlp(groups, dtype, counts, probs_on_input):
    overrides = dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True) if probs_on_input else {}
    sequential, grouped = build_pair(groups, make_config(dtype, **overrides))
    grouped.load_state_dict(sequential.state_dict(), strict=True)

    gen = torch.Generator().manual_seed(2)
    num_tokens = sum(counts)
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    probs = torch.rand(num_tokens, generator=gen)  # Megatron's router hands fp32 probs
    grad_out = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    tokens_per_expert = torch.tensor(counts)

    ref_out, ref_grad_x, ref_grads = run(sequential, x, tokens_per_expert, probs, grad_out)
    out, grad_x, grads = run(grouped, x, tokens_per_expert, probs, grad_out)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(grad_x, ref_grad_x, atol=atol, rtol=rtol)
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name], ref_grad, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(gated_linear_unit=True), "gated_linear_unit=True"),
        (dict(add_bias_linear=True), "add_bias_linear=True"),
        (dict(moe_latent_size=16), "moe_latent_size=16"),
    ],
)
def test_rejects_unsupported_settings(groups, overrides, message):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules

    from nam56r.model.moe_experts import GroupedMLPExperts

    backend = LocalSpecProvider()
    submodules = MLPSubmodules(linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear())
    config = dataclasses.replace(make_config(), **overrides)
    with pytest.raises(ValueError, match=message):
        GroupedMLPExperts(NUM_EXPERTS, config, submodules, pg_collection=groups)


def test_runs_the_forward_pre_hooks_sequential_mlp_runs(groups):
    """Megatron's DDP waits for a module's all-gathered parameters in that module's forward pre-hook. The grouped
    experts read their experts' weights without running the experts' forward, so they run those hooks themselves:
    every module that holds parameters has its pre-hook run, as under SequentialMLP."""
    sequential, grouped = build_pair(groups, make_config())
    counts = [5, 7, 3, 9]
    x, probs = torch.randn(sum(counts), 64), torch.rand(sum(counts))
    for module in (sequential, grouped):
        names = {sub: name for name, sub in module.named_modules()}
        ran: list[str] = []
        for sub in module.modules():
            sub.register_forward_pre_hook(lambda m, args, ran=ran, names=names: ran.append(names[m]))
        module(x, torch.tensor(counts), probs)
        holders = {name for name, sub in module.named_modules() if any(True for _ in sub.parameters(recurse=False))}
        assert holders and holders <= set(ran), f"{type(module).__name__}: no pre-hook ran for {sorted(holders - set(ran))}"


def test_megatron_ddp_with_overlapped_param_gather_waits_for_the_experts_weights(groups, monkeypatch):
    """Megatron's real DistributedDataParallel with --overlap-param-gather around the grouped experts (a one-rank gloo
    group on CPU; its CUDA device and type-name queries answered for CPU as tests/nam56r/checkpoint_worker.py does).
    Each step dispatches the parameter all-gathers, then the forward must wait for them: without the experts' pre-hooks
    the next dispatch fails Megatron's bare `assert self.param_gather_handle is None`."""
    from checkpoint_worker import CudaNamesOnCpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    config = make_config()
    _, grouped = build_pair(groups, config)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True)
    with CudaNamesOnCpu():
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=grouped)
    assert ddp.use_forward_hook
    counts = [8, 8, 8, 8]
    x, probs = torch.randn(sum(counts), 64), torch.rand(sum(counts))
    for _ in range(3):
        with CudaNamesOnCpu():
            ddp.start_param_sync()  # what the step after an optimizer step does first
        output, _ = ddp(x, torch.tensor(counts), probs)
        assert output.shape == x.shape
    assert all(group.param_gather_handle is None for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups)
