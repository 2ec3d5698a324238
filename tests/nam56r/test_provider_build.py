"""The training path's model build on CPU, with the real objects end to end: a recipe's lowered
flags through Megatron's parser and `validate_args`, Megatron's global state set as `pretrain`'s
argument parsing sets it, and the model provider `nam56r.training.launcher.pretrain` hands to `pretrain`, which derives
Megatron's config from those flags and builds through Megatron's HybridModel and layer builders.
Only the device differs from a GPU run: the provider's build lands on "meta" here.

The same build holds the two lowerings of `nam56r.model.megatron_fields` to each other: the config
Megatron derives from the flags equals `megatron_config` (builds outside training) on every field
but the run's (`RUN_FIELDS`). Both come from one table, so a row dropped or altered there moves both;
tests/nam56r/test_megatron_fields.py pins the table itself."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path

import pytest

from nam56r.training.data.layout import DataDir, DataPaths
from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate, transformer_config_from_args
from nam56r.training.recipe import get_recipe

BUILT_RECIPES = ["tiny-1gpu", "proxy-1gpu", "h200x8-bf16"]  # nam56r-tiny, nam56r-proxy, nam56r

# MLATransformerConfig fields where the config Megatron derives from the training flags may differ
# from `megatron_config(model_config, meta=True)`: how the run goes, not what the model is.
RUN_FIELDS = {
    # precision (--bf16; counting builds keep fp32) and initialization on the build's device
    "params_dtype", "autocast_dtype", "pipeline_dtype", "perform_initialization", "use_cpu_initialization",
    # parallelism
    "expert_model_parallel_size", "tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards",
    "cp_comm_type", "deallocate_pipeline_outputs",
    # kernels and the backend (--transformer-impl, --fused-linear-cross-entropy, Megatron's training defaults)
    "transformer_impl", "fused_linear_cross_entropy", "masked_softmax_fusion", "bias_dropout_fusion", "attention_softmax_in_fp32",
    "fused_linear_cross_entropy_impl",  # --linear-ce, a run setting (Megatron patch 0016); checked against the recipe below
    "moe_token_dispatcher_type",  # a runtime row; shape-level builds use the all-gather dispatcher
    "inference_sampling_seed",  # --seed
    "rotary_scaling_factor",  # YaRN's only; NAM56R's rope_type is "rope"
    # Megatron sets is_hybrid_model from --hybrid-layer-pattern, and with it scales the output layers'
    # init std by 1/sqrt(num_layers) instead of 1/sqrt(2*num_layers); `megatron_config` does not set it,
    # so CPU and direct GPU builds initialize those layers smaller than training does.
    "is_hybrid_model", "output_layer_init_method",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, megatron_built) -> Path:
    """A real HuggingFace BPE tokenizer (byte level, 300 tokens) over this test's own source."""
    from nam56r.training.data.build import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer([Path(__file__).read_text()], 300, out)
    return out


def _lowered(name: str, run_dir: Path, tokenizer: Path, **overrides) -> tuple[list[str], object]:
    recipe = get_recipe(name, **overrides)
    model = recipe.model_config()
    data = DataPaths(DataDir(run_dir).train_prefix, None, tokenizer)
    return megatron_flags(recipe, model, data, RunPaths(run_dir, None, None), "local"), recipe


@pytest.fixture
def megatron_globals():
    """Megatron's global args and tokenizer, set as `parse_and_validate_args` sets them for `pretrain`;
    unset afterwards."""
    from megatron.training.global_vars import set_global_variables, unset_global_variables

    def set_them(args) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            set_global_variables(args)

    yield set_them
    unset_global_variables()


@pytest.mark.parametrize(
    ("name", "overrides"),
    [(name, {}) for name in BUILT_RECIPES] + [("tiny-1gpu", {"dsa_indexer": "fused"})],
    ids=BUILT_RECIPES + ["tiny-1gpu-fused-dsa-indexer"],
)
def test_lowered_flags_build_through_pretrains_model_provider(name, overrides, tokenizer_dir, tmp_path, megatron_globals, monkeypatch):
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

    import nam56r.model.model
    import nam56r.training.launcher.preflight
    from nam56r.model.mamba3_mixer import Mamba3Mixer
    from nam56r.model.pattern import LayerKind
    from nam56r.training.launcher.pretrain import model_provider

    argv, recipe = _lowered(name, tmp_path, tokenizer_dir, **overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        args = megatron_validate(argv, recipe.world_size)
    model_config = recipe.model_config()
    assert model_config.dsa.indexer == overrides.get("dsa_indexer", "fused-tilelang-loss")  # the recipes' default
    Path(args.nam56r_model_config).write_text(json.dumps(model_config.to_dict()))  # as the launcher writes it
    megatron_globals(args)

    real_build, devices = nam56r.model.model.build_model, []

    def build_on_meta(*a, device, **k):
        devices.append(device)
        return real_build(*a, device="meta", **k)

    real_preflight, preflights = nam56r.training.launcher.preflight.run_preflight, []

    def preflight_without_gpu(config, **k):
        preflights.append(config)
        return real_preflight(config, require_gpu=False, **k)  # the real checks of the trees and fused paths, but the GPU's

    monkeypatch.setattr(nam56r.model.model, "build_model", build_on_meta)
    monkeypatch.setattr(nam56r.training.launcher.preflight, "run_preflight", preflight_without_gpu)
    model = model_provider(pre_process=True, post_process=True)

    assert devices == ["cuda"]  # the provider's own build, redirected to meta on this CPU machine
    assert preflights == [model_config]  # every rank's provider runs the preflight before it builds
    assert isinstance(model, nam56r.model.model.NAM56RModel) and model.model_config == model_config
    assert model.config.persist_layer_norm is False and model.config.num_layers == model_config.num_layers
    assert len(model.decoder.layers) == model_config.num_layers
    for layer, kind in zip(model.decoder.layers, nam56r.model.model.layout_of(model_config).main, strict=True):
        is_dsa = isinstance(getattr(layer, "self_attention", None), AbsorbedMLASelfAttention)
        is_mamba3 = isinstance(getattr(layer, "mixer", None), Mamba3Mixer)
        assert (is_dsa, is_mamba3) == (kind is LayerKind.DSA, kind is LayerKind.MAMBA3), (kind, type(layer).__name__)
        if is_dsa:  # the model config's DSA indexer path (launcher --dsa-indexer) reaches every DSA layer
            assert layer.self_attention.core_attention.indexer_path == model_config.dsa.indexer
    assert len(model.mtp.layers) == model_config.mtp.depths
    # The recipe's LM-head / MTP CE path (launcher --linear-ce) reaches the built model's config.
    from nam56r.model.linear_cross_entropy import CHUNKED_LINEAR_CE

    assert recipe.kernels.linear_ce == "chunked" and model.config.fused_linear_cross_entropy
    assert model.config.fused_linear_cross_entropy_impl == CHUNKED_LINEAR_CE

    # The two lowerings agree: Megatron's config from the flags (as the provider built with it) and ours.
    ours = nam56r.model.model.megatron_config(model_config, meta=True)
    differ = {f.name: (getattr(model.config, f.name), getattr(ours, f.name)) for f in dataclasses.fields(ours)}
    differ = {name: pair for name, pair in differ.items() if repr(pair[0]) != repr(pair[1]) and name not in RUN_FIELDS}
    assert differ == {}, f"(flags' value, megatron_config's value) per field: {differ}"


@pytest.mark.parametrize("name", BUILT_RECIPES)
def test_lowered_flags_give_a_config_the_local_backend_builds(name, tokenizer_dir, tmp_path, megatron_built):
    from nam56r.model.model import local_backend_problems

    argv, recipe = _lowered(name, tmp_path, tokenizer_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        cfg = transformer_config_from_args(megatron_validate(argv, recipe.world_size))
    assert local_backend_problems(cfg) == []


def test_a_config_the_local_backend_refuses_fails_before_building_and_names_every_setting(tokenizer_dir, tmp_path, megatron_built):
    """Each setting the local backend is said to refuse is refused by Megatron's own torch norm or
    linear, and build_model names all of them at once before Megatron asserts on the first."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, layers
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from nam56r.model.model import build_model, local_backend_problems

    argv, recipe = _lowered("tiny-1gpu", tmp_path, tokenizer_dir)
    norm_fields = ["persist_layer_norm", "layernorm_zero_centered_gamma", "sequence_parallel", "memory_efficient_layer_norm"]
    for field in norm_fields:
        with contextlib.redirect_stdout(io.StringIO()):
            cfg = transformer_config_from_args(megatron_validate(argv, 1))
        setattr(cfg, field, True)
        assert [p.split("=")[0] for p in local_backend_problems(cfg)] == [field]
        with pytest.raises(AssertionError):
            WrappedTorchNorm(config=cfg, hidden_size=8)
    if not layers._grad_accum_fusion_available:
        with contextlib.redirect_stdout(io.StringIO()):
            cfg = transformer_config_from_args(megatron_validate([a for a in argv if a != "--no-gradient-accumulation-fusion"], 1))
        assert cfg.gradient_accumulation_fusion
        assert [p.split("=")[0] for p in local_backend_problems(cfg)] == ["gradient_accumulation_fusion"]
        cfg.use_cpu_initialization, cfg.perform_initialization = True, False
        with pytest.raises(RuntimeError, match="gradient_accumulation_fusion"):
            ColumnParallelLinear(8, 8, config=cfg, init_method=lambda w: None, gather_output=False)

    flags = [a for a in argv if a != "--no-persist-layer-norm"] + ["--sequence-parallel"]
    with contextlib.redirect_stdout(io.StringIO()):
        cfg = transformer_config_from_args(megatron_validate(flags, 1))
    cfg.sequence_parallel = True  # validate_args turns it off at TP 1; a config from elsewhere may not
    with pytest.raises(ValueError, match="the local backend cannot build") as err:
        build_model(recipe.model_config(), "local", device="meta", megatron_cfg=cfg)
    assert "persist_layer_norm=True" in str(err.value) and "sequence_parallel=True" in str(err.value)
