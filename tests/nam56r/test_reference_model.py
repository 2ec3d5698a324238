"""The reference GPT of issue #46 (`nam56r.model.reference`): each preset's declared shape is the fit against
NAM56R's active parameters as Megatron builds them, the parameter arithmetic equals the built GPTModel's count row by
row, and the build holds Megatron's own modules only."""

from __future__ import annotations

import re

import pytest

from nam56r.model.presets import get_preset
from nam56r.model.reference import REFERENCE_SHAPES, ReferenceConfig, fit_shape, model_from_dict, reference_for

# Whose modules a reference build may hold: Megatron's core and torch. Ours, and the fused kernels' upstreams, never.
ALLOWED_MODULES = ("megatron.core.", "torch.")
FUSED_MODULES = ("nam56r", "nam56r_kernels", "liger_kernel", "tilelang", "mamba_ssm", "transformer_engine")

_active: dict[str, int] = {}


def nam56r_active(preset: str) -> int:
    from nam56r.model.params import count_parameters

    if preset not in _active:
        _active[preset] = count_parameters(get_preset(preset)).active
    return _active[preset]


def foreign_modules(model) -> list[str]:
    """The classes in `model` that are not Megatron's or torch's, by module path."""
    return sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()
                   if not type(m).__module__.startswith(ALLOWED_MODULES) or type(m).__module__.startswith(FUSED_MODULES)})


def rows_of_built(model) -> dict[str, int]:
    """The built model's parameters grouped as `ReferenceConfig.param_rows` groups them, by parameter name."""
    groups = (("token embedding", r"^embedding\."), ("attention", r"\.self_attention\."), ("mlp", r"\.mlp\."),
              ("norms", r"(layernorm|final_layernorm)\.weight$"), ("output layer", r"^output_layer\."))
    rows = dict.fromkeys([name for name, _ in groups], 0)
    for name, param in model.named_parameters():
        matched = [row for row, pattern in groups if re.search(pattern, name)]
        assert len(matched) == 1, f"parameter {name} falls in {matched or 'no'} row"
        rows[matched[0]] += param.numel()
    return rows


@pytest.mark.parametrize("preset", sorted(REFERENCE_SHAPES))
def test_declared_shape_is_the_fit_against_nam56rs_built_active_count(preset, megatron_built):
    active = nam56r_active(preset)
    assert fit_shape(get_preset(preset), active) == REFERENCE_SHAPES[preset], "refit REFERENCE_SHAPES (python -m nam56r.model.reference)"
    reference = reference_for(get_preset(preset))
    assert abs(reference.total_params() - active) / active < 0.03


@pytest.mark.parametrize("preset", sorted(REFERENCE_SHAPES))
def test_parameter_arithmetic_equals_the_built_model_row_by_row(preset, megatron_built):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from nam56r.model.reference_model import build_reference_model

    reference = reference_for(get_preset(preset))
    model = build_reference_model(reference, device="meta")
    assert isinstance(model, GPTModel)
    assert rows_of_built(model) == reference.param_rows()
    assert sum(p.numel() for p in model.parameters()) == reference.total_params()


def test_the_reference_mirrors_the_presets_vocab_sequence_and_widths():
    model = get_preset("nam56r-proxy")
    reference = reference_for(model)
    assert (reference.vocab_size, reference.seq_length, reference.hidden_size, reference.num_heads) == (
        model.vocab_size, model.seq_length, model.hidden_size, model.mla.num_heads)
    assert (reference.rope_base, reference.norm_epsilon, reference.init_std) == (model.rope_base, model.norm_epsilon, model.init_std)
    assert reference.name == "nam56r-proxy-reference" and reference.mirrors == "nam56r-proxy"
    with pytest.raises(KeyError, match="has no reference model"):
        reference_for(get_preset("nam56r-h3584"))


def test_a_run_model_config_reads_back_as_what_it_was():
    reference = reference_for(get_preset("nam56r-tiny"))
    assert model_from_dict(reference.to_dict()) == reference
    assert model_from_dict(get_preset("nam56r-tiny").to_dict()) == get_preset("nam56r-tiny")
    with pytest.raises(ValueError, match="not a multiple of num_heads"):
        ReferenceConfig.from_dict(reference.to_dict() | {"num_heads": 3})


def test_flops_per_token_are_six_per_matmul_weight_plus_causal_attention():
    reference = reference_for(get_preset("nam56r-tiny"))
    rows = reference.param_rows()
    weights = rows["attention"] + rows["mlp"] + rows["output layer"]  # the embedding is a lookup, norms no GEMM
    h = reference.hidden_size
    assert reference.flops_per_token(512) == 6 * weights + reference.num_layers * 6 * 2 * h * 512 / 2
    assert reference.flops_per_token(1024) > reference.flops_per_token(512)


def test_the_cpu_build_holds_megatrons_own_layers_only(megatron_built):
    import torch
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from nam56r.model.reference_model import build_reference_model

    torch.manual_seed(0)
    reference = reference_for(get_preset("nam56r-tiny"))
    model = build_reference_model(reference, device="cpu")
    assert foreign_modules(model) == []
    assert len(model.decoder.layers) == reference.num_layers and not model.mtp_process
    for layer in model.decoder.layers:
        assert type(layer) is TransformerLayer and type(layer.self_attention) is SelfAttention
        assert type(layer.self_attention.core_attention) is DotProductAttention and type(layer.mlp) is MLP
        assert type(layer.input_layernorm) is torch.nn.RMSNorm and layer.mlp.config.gated_linear_unit
    assert not model.config.fused_linear_cross_entropy and not model.share_embeddings_and_output_weights
    assert all(torch.isfinite(p).all() for p in model.parameters())  # initialized on the CPU


def test_the_module_check_sees_nam56rs_fused_modules(tiny_cpu_model):
    found = foreign_modules(tiny_cpu_model.model)
    assert any(name.startswith("nam56r.model.") for name in found), found
