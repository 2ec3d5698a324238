"""`ModelConfig.residual_norm`: the transformer layers' input norms on `nam56r.model.residual_norm.ResidualRMSNorm`.
The real MoE layer (Megatron's TransformerLayer taking the norm's (normed, residual) pair) gives torch's norm's
output and gradients; the spec puts the fused norm in the input-norm slots only; the recipes pick it on the local
backend and refuse it on TE's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

LAYER_SCRIPT = """
from dataclasses import replace
import torch
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from nam56r.model.model import build_moe_layer
from nam56r.model.presets import get_preset
from nam56r.model.residual_norm import ResidualRMSNorm
from tests.nam56r.test_moe_layer import assert_same_step

config = get_preset("nam56r-tiny")
torch.manual_seed(0)
for dispatch in ("megatron", "fused-permute"):
    plain_config = replace(config, moe=replace(config.moe, dispatch=dispatch))
    plain = build_moe_layer(plain_config, "local", experts="grouped")
    fused = build_moe_layer(replace(plain_config, residual_norm="fused"), "local", experts="grouped")
    assert isinstance(fused.pre_mlp_layernorm, ResidualRMSNorm) and isinstance(plain.pre_mlp_layernorm, torch.nn.RMSNorm)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():
        plain.pre_mlp_layernorm.weight.uniform_(0.5, 1.5)  # a trained norm weight, so its gradient path is exercised
    fused.load_state_dict(plain.state_dict(), strict=True)
    assert_same_step(plain, fused, config)
    print("residual norm layer ok", dispatch)
"""


def test_the_fused_norm_gives_the_torch_norms_layer_output_and_gradients(run_interpreted, megatron_built) -> None:
    """The real fp32 MoE layer, its norm on the fused kernels (under the interpreter), on both dispatch paths: the same
    output, input gradient (the residual's included) and every parameter gradient as with torch's RMSNorm."""
    stdout = run_interpreted(LAYER_SCRIPT, timeout=600)
    assert stdout.count("residual norm layer ok") == 2, stdout


def test_the_spec_puts_the_fused_norm_in_the_layers_input_norm_slots_only(megatron_built) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from nam56r.model.presets import get_preset
    from nam56r.model.residual_norm import ResidualRMSNorm
    from nam56r.model.specs import hybrid_stack_spec

    config = get_preset("nam56r-tiny")
    for norm, want in (("torch", WrappedTorchNorm), ("fused", ResidualRMSNorm)):
        stack = hybrid_stack_spec(replace(config, residual_norm=norm), "local").submodules
        assert stack.mla_layer.submodules.input_layernorm is want
        assert stack.dsa_layer.submodules.input_layernorm is want
        assert stack.moe_layer.submodules.pre_mlp_layernorm is want and stack.mlp_layer.submodules.pre_mlp_layernorm is want
        attention = stack.mla_layer.submodules.self_attention.submodules
        assert attention.q_layernorm is attention.kv_layernorm is WrappedTorchNorm  # read as plain tensors
        assert stack.mamba_layer.submodules.norm is stack.final_norm is WrappedTorchNorm


def test_the_fused_norm_is_refused_where_it_cannot_run(megatron_built, monkeypatch) -> None:
    from nam56r.model.model import build_moe_layer
    from nam56r.model.presets import get_preset
    from nam56r.model.residual_norm import ResidualRMSNorm

    config = get_preset("nam56r-tiny")
    with pytest.raises(ValueError, match="residual_norm 'apex' must be one of 'torch', 'fused'"):
        replace(config, residual_norm="apex").validate()
    with pytest.raises(ValueError, match="residual_norm 'fused' stands in for the local backend's torch norm; backend 'te'"):
        build_moe_layer(replace(config, residual_norm="fused"), "te")
    layer = build_moe_layer(replace(config, residual_norm="fused"), "local")
    mcfg = layer.config
    for field, value, message in (("normalization", "LayerNorm", "normalization='LayerNorm' \\(needs 'RMSNorm'\\)"),
                                  ("sequence_parallel", True, "sequence_parallel=True")):
        monkeypatch.setattr(mcfg, field, value)
        with pytest.raises(ValueError, match=f"residual_norm='fused' does not support {message}; use residual_norm='torch'"):
            ResidualRMSNorm(mcfg, config.hidden_size)
        monkeypatch.undo()
    with pytest.raises(ValueError, match="does not support layernorm_zero_centered_gamma=True; use residual_norm='torch'"):
        ResidualRMSNorm(mcfg, config.hidden_size, zero_centered_gamma=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bias'"):
        ResidualRMSNorm(mcfg, config.hidden_size, bias=True)
    with pytest.raises(ValueError, match="weight is torch.float32 and its input torch.bfloat16"):
        layer.pre_mlp_layernorm(torch.randn(3, 2, config.hidden_size).bfloat16())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, got device cpu; use rms_norm_residual_reference"):
        layer.pre_mlp_layernorm(torch.randn(3, 2, config.hidden_size))


def test_the_recipes_run_the_fused_norm_on_the_local_backend_only() -> None:
    from nam56r.training.recipe import RecipeError, get_recipe

    recipe = get_recipe("proxy-1gpu", kernels=False)
    assert recipe.kernels.residual_norm is None
    assert recipe.model_config("local").residual_norm == "fused" and recipe.on_backend("local").kernels.residual_norm == "fused"
    assert recipe.model_config("te").residual_norm == "torch" and recipe.model_config().residual_norm == "torch"
    assert get_recipe("proxy-1gpu", residual_norm="torch", kernels=False).model_config("local").residual_norm == "torch"
    with pytest.raises(RecipeError, match="residual_norm 'fused' stands in for the local backend's torch norm"):
        get_recipe("proxy-1gpu", residual_norm="fused", backend="te", kernels=False)
    with pytest.raises(RecipeError, match="--residual-norm torch, or --backend local"):
        get_recipe("proxy-1gpu", residual_norm="fused", kernels=False).model_config("te")
