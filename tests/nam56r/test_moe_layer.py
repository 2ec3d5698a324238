"""nam56r.model.model.build_moe_layer: one of NAM56R's MoE layers whole (norm, router, dispatcher, experts, shared
expert) with Megatron's SequentialMLP experts and with our GroupedMLPExperts, and with our fused-permute dispatcher
(`MoEConfig.dispatch`), built on CPU from the model's spec at nam56r-tiny's widths: the same parameters, and with
the same weights the same output and gradients in fp32. The kernels bench's `moe layer` case times these layers
at the nam56r preset on a GPU."""

from __future__ import annotations

import pytest
import torch

TOKENS = (24, 2)  # [seq, batch]


@pytest.fixture(scope="module")
def layers(megatron_built):
    from nam56r.model.model import build_moe_layer
    from nam56r.model.presets import get_preset

    config = get_preset("nam56r-tiny")
    torch.manual_seed(0)
    sequential = build_moe_layer(config, "local", experts="sequential")
    torch.manual_seed(1)  # a different init: the load below is what makes them equal
    grouped = build_moe_layer(config, "local", experts="grouped")
    grouped.load_state_dict(sequential.state_dict(), strict=True)
    return config, sequential, grouped


def test_the_baseline_is_megatrons_sequential_mlp_and_ours_the_grouped_experts(layers) -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from nam56r.model.moe_experts import GroupedMLPExperts
    from nam56r.model.pattern import LayerKind, layout_of

    config, sequential, grouped = layers
    assert type(sequential.mlp.experts) is SequentialMLP and type(grouped.mlp.experts) is GroupedMLPExperts
    for layer in (sequential, grouped):
        assert isinstance(layer.mlp, MoELayer) and layer.mlp.dispatch_path == "megatron"
        assert isinstance(layer.mlp.shared_experts, SharedExpertMLP)
        assert layer.layer_number == layout_of(config).layer_numbers(LayerKind.MOE)[0]
        assert len(layer.mlp.experts.local_experts) == config.moe.num_experts
        assert layer.mlp.router.topk == config.moe.topk
    assert [n for n, _ in sequential.named_parameters()] == [n for n, _ in grouped.named_parameters()]


def test_an_unknown_experts_kind_is_refused(megatron_built) -> None:
    from nam56r.model.model import build_moe_layer
    from nam56r.model.presets import get_preset

    with pytest.raises(ValueError, match="experts must be one of .* got 'loop'"):
        build_moe_layer(get_preset("nam56r-tiny"), "local", experts="loop")


def step(layer, x: torch.Tensor, grad_out: torch.Tensor):
    from nam56r.model.model import cuda_buffers_on

    layer.train()
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with cuda_buffers_on("cpu"):  # the router moves its weight to torch.cuda.current_device()
        out, _ = layer(x, attention_mask=None)
    out.backward(grad_out)
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def assert_same_step(want_layer, got_layer, config, dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> None:
    """One `step` of each layer on the same input and output gradient: the same output, input gradient and every
    parameter gradient within `tol`."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*TOKENS, config.hidden_size, generator=g).to(dtype)
    grad_out = torch.randn(*TOKENS, config.hidden_size, generator=g).to(dtype)
    want, got = step(want_layer, x, grad_out), step(got_layer, x, grad_out)
    assert got[2].keys() == want[2].keys()
    for name, a, b in (("output", got[0], want[0]), ("input grad", got[1], want[1]), *((n, got[2][n], r) for n, r in want[2].items())):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_same_weights_same_output_and_gradients_in_fp32(layers) -> None:
    config, sequential, grouped = layers
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*TOKENS, config.hidden_size, generator=g)
    grad_out = torch.randn(*TOKENS, config.hidden_size, generator=g)
    ref_out, ref_x_grad, ref_grads = step(sequential, x, grad_out)
    out, x_grad, grads = step(grouped, x, grad_out)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        assert ref_grad is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], ref_grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    routed = [name for name in ref_grads if ".local_experts." in name]
    assert sum(bool(ref_grads[name].abs().sum() > 0) for name in routed) > len(routed) // 2  # the tokens reached the experts


def test_the_bench_step_runs_both_layers_to_the_same_result(layers) -> None:
    from nam56r_bench.layer_cases import _layers_step

    from nam56r.model.model import cuda_buffers_on

    _, sequential, grouped = layers
    results = []
    for layer in (sequential, grouped):
        layer.train()
        with cuda_buffers_on("cpu"):
            results.append(_layers_step([layer], TOKENS[1], TOKENS[0])())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


FUSED_DISPATCH_SCRIPT = """
from dataclasses import replace
import torch
from nam56r_kernels import moe_permute
from nam56r.model.model import build_moe_layer
from nam56r.model.moe_dispatch import FusedPermuteDispatcher
from nam56r.model.presets import get_preset
from tests.nam56r.test_moe_layer import TOKENS, step

config = get_preset("nam56r-tiny")
fused_config = replace(config, moe=replace(config.moe, dispatch="fused-permute"))
torch.manual_seed(0)
megatron = build_moe_layer(config, "local", experts="sequential")
results = {}
passes = []  # the addends of each row-sum pass
sum_rows = moe_permute._sum_rows
moe_permute._sum_rows = lambda src, rows, addends=(): passes.append(len(addends)) or sum_rows(src, rows, addends)
for experts in ("grouped", "sequential"):
    fused = build_moe_layer(fused_config, "local", experts=experts)
    assert type(fused.mlp.token_dispatcher) is FusedPermuteDispatcher and fused.mlp.dispatch_path == "fused-permute"
    fused.load_state_dict(megatron.state_dict(), strict=True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*TOKENS, config.hidden_size, generator=g)
    grad_out = torch.randn(*TOKENS, config.hidden_size, generator=g)
    want = step(megatron, x, grad_out)
    passes.clear()
    got = step(fused, x, grad_out)
    # The combine sums the rows and the shared expert's output; the backward sums the rows' gradient with the router's
    # and the shared expert's input gradients (the layer input fanned out): one pass each.
    assert passes == [1, 2], passes
    for name, a, b in (("output", got[0], want[0]), ("input grad", got[1], want[1])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert got[2].keys() == want[2].keys()
    for name, ref in want[2].items():
        torch.testing.assert_close(got[2][name], ref, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert fused.mlp.token_dispatcher.rows is None  # the pass's table is not kept past the combine
    assert fused.mlp.token_dispatcher.combine_addend is None  # nor the shared expert's output it summed in
    assert fused.mlp.token_dispatcher._fanned is None  # nor the fanned-out input
    print("fused dispatch ok", experts)
"""


def test_the_fused_permute_dispatcher_gives_megatrons_layer_output_and_gradients(run_interpreted, megatron_built) -> None:
    """The same layer with `MoEConfig.dispatch="fused-permute"` (its Triton kernels under the interpreter), with our
    grouped experts and with Megatron's SequentialMLP, against Megatron's own dispatch and experts: same weights, same
    output, input gradient and every parameter gradient in fp32."""
    stdout = run_interpreted(FUSED_DISPATCH_SCRIPT, timeout=600)
    assert stdout.count("fused dispatch ok") == 2, stdout


def test_the_fused_permute_dispatcher_refuses_what_it_does_not_cover(megatron_built) -> None:
    from dataclasses import replace

    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    from nam56r.model.model import build_moe_layer, cuda_buffers_on
    from nam56r.model.moe_dispatch import DispatchMoELayer, FusedPermuteDispatcher
    from nam56r.model.presets import get_preset
    from nam56r.training.recipe import RecipeError, get_recipe

    config = get_preset("nam56r-tiny")
    with pytest.raises(ValueError, match="moe.dispatch 'sorted' must be one of 'megatron', 'fused-permute'"):
        replace(config, moe=replace(config.moe, dispatch="sorted")).validate()
    layer = build_moe_layer(replace(config, moe=replace(config.moe, dispatch="fused-permute")), "local", experts="grouped")
    mcfg = layer.mlp.config
    mcfg.moe_permute_fusion, mcfg.moe_expert_capacity_factor = True, 1.5
    with cuda_buffers_on("cpu"), pytest.raises(ValueError, match=r"does not support moe_expert_capacity_factor=1.5 \(token dropping\); "
                                                                r"moe_permute_fusion=True"):
        DispatchMoELayer(mcfg, layer.mlp.submodules, layer_number=layer.layer_number, dispatch="fused-permute")
    mcfg.moe_permute_fusion, mcfg.moe_expert_capacity_factor = False, None
    mcfg.moe_latent_size, mcfg.overlap_dispatch_backward_with_experts_wgrad = 8, True  # MoELayer itself needs TE for latent
    with pytest.raises(ValueError, match=r"does not support moe_latent_size=8 \(the permute reads the layer input itself\); "
                                         r"overlap_dispatch_backward_with_experts_wgrad=True"):
        FusedPermuteDispatcher(layer.mlp.num_local_experts, layer.mlp.local_expert_indices, mcfg, pg_collection=get_default_pg_collection())
    with pytest.raises(RecipeError, match="moe_dispatch 'fused-permute' dispatches on one expert-parallel rank; ep=2"):
        get_recipe("h200x2-ep2", moe_dispatch="fused-permute", kernels=False)
    assert get_recipe("proxy-1gpu", moe_dispatch="fused-permute", kernels=False).model_config().moe.dispatch == "fused-permute"


def test_the_fused_permute_dispatcher_hands_each_reader_its_alias_of_the_layer_input(megatron_built, monkeypatch) -> None:
    from dataclasses import replace

    from nam56r.model.model import build_moe_layer
    from nam56r.model.presets import get_preset

    config = get_preset("nam56r-tiny")
    dispatcher = build_moe_layer(replace(config, moe=replace(config.moe, dispatch="fused-permute")), "local").mlp.token_dispatcher
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # fan_out's forward launches no kernel; its backward would
    x = torch.randn(*TOKENS, config.hidden_size, requires_grad=True)
    dispatcher.fan_out(x)
    readers = {reader: dispatcher.use(x, reader) for reader in ("router", "shared", "permute")}
    assert readers["router"].shape == readers["shared"].shape == x.shape
    assert readers["permute"].shape == (TOKENS[0] * TOKENS[1], config.hidden_size)
    assert len({id(alias) for alias in readers.values()}) == 3 and all(alias is not x for alias in readers.values())
    with pytest.raises(RuntimeError, match="router reads another tensor than the layer input fanned out"):
        dispatcher.use(x.detach().clone(), "router")
    with torch.no_grad():
        dispatcher.fan_out(x)  # nothing recorded: every reader reads the input itself
    assert dispatcher.use(x, "shared") is x and dispatcher.use(x, "permute").shape == readers["permute"].shape


FUSED_ACTIVATION_SCRIPT = """
from dataclasses import replace
import torch
from nam56r.model.model import build_moe_layer
from nam56r.model.presets import get_preset
from tests.nam56r.test_moe_layer import assert_same_step

config = get_preset("nam56r-tiny")
torch.manual_seed(0)
eager = build_moe_layer(config, "local", experts="grouped")
for dispatch in ("megatron", "fused-permute"):
    fused_config = replace(config, moe=replace(config.moe, dispatch=dispatch, expert_activation="fused"))
    fused = build_moe_layer(fused_config, "local", experts="grouped")
    assert fused.mlp.experts.fused_activation and not eager.mlp.experts.fused_activation
    fused.load_state_dict(eager.state_dict(), strict=True)
    assert_same_step(eager, fused, config)
    print("fused activation ok", dispatch)
"""


def test_the_fused_expert_activation_gives_the_eager_layers_output_and_gradients(run_interpreted, megatron_built) -> None:
    """`MoEConfig.expert_activation="fused"` (its Triton kernel under the interpreter) in the real layer, on both
    dispatch paths: same weights, same output, input gradient and every parameter gradient in fp32 as the eager
    activation and scale."""
    stdout = run_interpreted(FUSED_ACTIVATION_SCRIPT, timeout=600)
    assert stdout.count("fused activation ok") == 2, stdout


def test_the_fused_expert_activation_is_refused_where_it_cannot_run(megatron_built) -> None:
    from dataclasses import replace

    from nam56r.model.model import build_moe_layer
    from nam56r.model.presets import get_preset

    config = get_preset("nam56r-tiny")
    with pytest.raises(ValueError, match="expert_activation 'fused' is the non-gated experts' GELU"):
        replace(config, moe=replace(config.moe, gated=True, expert_activation="fused")).validate()
    with pytest.raises(ValueError, match="must be one of 'eager', 'fused'"):
        replace(config, moe=replace(config.moe, expert_activation="compiled")).validate()
    with pytest.raises(ValueError, match="runs in our grouped experts on the local backend"):
        build_moe_layer(replace(config, moe=replace(config.moe, expert_activation="fused")), "te", experts="grouped")


ROUTER_GATING_SCRIPT = """
from dataclasses import replace
import torch
from megatron.core.transformer.moe.router import TopKRouter
from nam56r.model.model import build_moe_layer
from nam56r.model.moe_dispatch import FusedRouter
from nam56r.model.presets import get_preset
from tests.nam56r.test_moe_layer import assert_same_step

config = get_preset("nam56r-tiny")
torch.manual_seed(0)
megatron = build_moe_layer(config, "local", experts="grouped", params_dtype=torch.bfloat16).bfloat16()
assert type(megatron.mlp.router) is TopKRouter
for dispatch in ("megatron", "fused-permute"):
    fused_config = replace(config, moe=replace(config.moe, dispatch=dispatch, router_gating="fused"))
    fused = build_moe_layer(fused_config, "local", experts="grouped", params_dtype=torch.bfloat16).bfloat16()
    assert type(fused.mlp.router) is FusedRouter and fused.mlp.router.fused_gating and not fused.mlp.router.fused_routing
    fused.load_state_dict(megatron.state_dict(), strict=True)
    # The same fp32 logits up to summation order (so the same routing); the rest of the layer in bf16.
    assert_same_step(megatron, fused, config, dtype=torch.bfloat16, tol=2e-2)
    print("fused router gating ok", dispatch)
"""


def test_the_fused_router_gating_gives_megatrons_layer_output_and_gradients(run_interpreted, megatron_built) -> None:
    """`MoEConfig.router_gating="fused"` (its Triton kernels under the interpreter) in the real bf16 layer, on both
    dispatch paths, against Megatron's local router GEMM: same weights, same output, input and parameter gradients
    within bf16 rounding."""
    stdout = run_interpreted(ROUTER_GATING_SCRIPT, timeout=600)
    assert stdout.count("fused router gating ok") == 2, stdout


def test_the_fused_router_gating_refuses_what_it_does_not_compute(megatron_built) -> None:
    from dataclasses import replace

    from nam56r.model.model import build_moe_layer
    from nam56r.model.moe_dispatch import FusedRouter
    from nam56r.model.presets import get_preset

    config = get_preset("nam56r-tiny")
    with pytest.raises(ValueError, match="moe.router_gating 'te' must be one of 'megatron', 'fused'"):
        replace(config, moe=replace(config.moe, router_gating="te")).validate()
    router = build_moe_layer(config, "local", experts="grouped").mlp.router
    router.config.moe_router_dtype = "fp64"
    with pytest.raises(ValueError, match=r"router_gating='fused' does not support moe_router_dtype='fp64' \(needs 'fp32'\)"):
        FusedRouter.adopt(router, gating="fused", routing="megatron")


ROUTING_SCRIPT = """
from dataclasses import replace
import torch
from nam56r.model.model import build_moe_layer
from nam56r.model.moe_dispatch import FusedRouter
from nam56r.model.presets import get_preset
from tests.nam56r.test_moe_layer import assert_same_step

config = get_preset("nam56r-tiny")
torch.manual_seed(0)
megatron = build_moe_layer(config, "local", experts="grouped")
with torch.no_grad():  # a trained expert bias, so the biased selection differs from the aux loss's unbiased one
    megatron.mlp.router.expert_bias.copy_(0.05 * torch.randn(config.moe.num_experts))
for dispatch in ("megatron", "fused-permute"):
    fused_config = replace(config, moe=replace(config.moe, dispatch=dispatch, routing="fused"))
    fused = build_moe_layer(fused_config, "local", experts="grouped")
    router = fused.mlp.router
    assert type(router) is FusedRouter and router.fused_routing and not router.fused_gating
    fused.load_state_dict(megatron.state_dict(), strict=True)
    megatron.mlp.router.local_tokens_per_expert.zero_()
    # fp32 throughout: the same selection, and values and gradients (the seq aux loss's included) to fp32 rounding.
    assert_same_step(megatron, fused, config)
    load = router.local_tokens_per_expert
    assert torch.equal(load, megatron.mlp.router.local_tokens_per_expert) and load.sum() == 24 * 2 * config.moe.topk
    print("fused routing ok", dispatch)
"""


def test_the_fused_routing_gives_megatrons_layer_output_gradients_and_expert_load(run_interpreted, megatron_built) -> None:
    """`MoEConfig.routing="fused"` (its Triton kernels under the interpreter) in the real fp32 layer, on both dispatch
    paths, against TopKRouter.routing with its seq aux loss and a nonzero expert bias: same output, input and parameter
    gradients within fp32 rounding, and the same expert load counted for the bias update."""
    stdout = run_interpreted(ROUTING_SCRIPT, timeout=600)
    assert stdout.count("fused routing ok") == 2, stdout


def test_the_fused_routing_refuses_what_it_does_not_compute(megatron_built) -> None:
    from dataclasses import replace

    from nam56r.model.model import build_moe_layer
    from nam56r.model.moe_dispatch import FusedRouter
    from nam56r.model.presets import get_preset

    config = get_preset("nam56r-tiny")
    with pytest.raises(ValueError, match="moe.routing 'te' must be one of 'megatron', 'fused'"):
        replace(config, moe=replace(config.moe, routing="te")).validate()
    settings = {
        "moe_router_score_function": ("softmax", r"moe_router_score_function='softmax' \(needs 'sigmoid'\)"),
        "moe_router_load_balancing_type": ("aux_loss", "moe_router_load_balancing_type='aux_loss'"),
        "moe_z_loss_coeff": (1e-3, "moe_z_loss_coeff"),
        "moe_router_group_topk": (2, "moe_router_num_groups/moe_router_group_topk"),
        "moe_expert_capacity_factor": (1.0, r"moe_expert_capacity_factor \(token dropping\)"),
    }
    for field, (value, message) in settings.items():
        router = build_moe_layer(config, "local", experts="grouped").mlp.router
        setattr(router.config, field, value)
        router.score_function, router.routing_type = router.config.moe_router_score_function, router.config.moe_router_load_balancing_type
        with pytest.raises(ValueError, match=f"MoEConfig.routing='fused' does not support {message}; use MoEConfig.routing='megatron'"):
            FusedRouter.adopt(router, gating="megatron", routing="fused")
    router = FusedRouter.adopt(build_moe_layer(config, "local", experts="grouped").mlp.router, gating="megatron", routing="fused")
    with pytest.raises(ValueError, match="does not take a padding mask"):
        router.routing(torch.zeros(4, 2, config.moe.num_experts), padding_mask=torch.ones(4, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="need Megatron's TopKRouter, got Linear"):
        FusedRouter.adopt(torch.nn.Linear(2, 2), gating="fused", routing="fused")
