"""Building the tiny preset on CPU with the local backend: every block family from our specs, the
fp32 opt-out under Float16Module, and the n-gram embedding at the entrance."""

from __future__ import annotations

import pytest
import torch


def test_tiny_model_has_every_block_family_from_our_specs(tiny_cpu_model) -> None:
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from nam56r.model.dsa_index_cache import IndexCacheDSAttention
    from nam56r.model.local_layers import LatentSDPAttention
    from nam56r.model.mamba3_mixer import Mamba3Mixer
    from nam56r.model.moe_experts import GroupedMLPExperts
    from nam56r.model.pattern import LayerKind

    model, layout = tiny_cpu_model.model, tiny_cpu_model.layout
    expected = {
        LayerKind.MAMBA3: lambda layer: isinstance(layer, MambaLayer) and isinstance(layer.mixer, Mamba3Mixer),
        LayerKind.MOE: lambda layer: isinstance(layer.mlp, MoELayer) and layer.mlp.shared_experts is not None
        and type(layer.mlp.experts) is GroupedMLPExperts,
        LayerKind.MLA: lambda layer: type(layer.self_attention) is MLASelfAttention
        and isinstance(layer.self_attention.core_attention, LatentSDPAttention),
        LayerKind.DSA: lambda layer: isinstance(layer.self_attention, AbsorbedMLASelfAttention)
        and isinstance(layer.self_attention.core_attention, IndexCacheDSAttention),
    }
    for layer, kind in zip(model.decoder.layers, layout.main, strict=True):
        assert expected[kind](layer), (kind, type(layer).__name__)
    assert isinstance(model.decoder.final_norm, torch.nn.RMSNorm)  # Megatron patch 0009
    assert len(model.mtp.layers) == tiny_cpu_model.model.model_config.mtp.depths
    for p in model.parameters():
        assert torch.isfinite(p).all()


def test_float16module_keeps_mamba3_kernel_params_fp32(megatron_built) -> None:
    from megatron.core.transformer.module import Float16Module

    from nam56r.model.mamba3_mixer import KEEP_FP32_PARAMS
    from nam56r.model.model import build_model
    from nam56r.model.presets import get_preset

    model = build_model(get_preset("nam56r-tiny"), "local", device="cpu").model
    model.config.bf16 = True
    wrapped = Float16Module(model.config, model)
    mamba3 = wrapped.module.decoder.layers[2].mixer.mamba3
    for name in KEEP_FP32_PARAMS:
        assert getattr(mamba3, name).dtype == torch.float32, name
    assert mamba3.in_proj.weight.dtype == torch.bfloat16


def test_ngram_embedding_adds_a_projected_feature_per_token(tiny_cpu_model) -> None:
    embedding = tiny_cpu_model.model.ngram_embedding
    ids = torch.randint(0, tiny_cpu_model.model.vocab_size, (2, 12))
    out = embedding(ids)
    assert out.shape == (2, 12, tiny_cpu_model.model.config.hidden_size)
    # Position 0 has no complete 2-gram or 3-gram: its feature is exactly zero.
    assert torch.count_nonzero(out[:, 0]) == 0 and torch.count_nonzero(out[:, 2:]) > 0


def test_unknown_backend_and_device_are_rejected(megatron_built) -> None:
    from nam56r.model.model import build_model
    from nam56r.model.presets import get_preset
    from nam56r.model.specs import resolve_backend

    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("apex")
    with pytest.raises(ValueError, match="device must be"):
        build_model(get_preset("nam56r-tiny"), "local", device="tpu")


def test_a_model_parallel_rng_state_set_before_the_build_is_kept(megatron_built) -> None:
    """`pretrain` seeds Megatron's CUDA RNG tracker from --seed before it calls the model provider; a
    "cuda" build keeps that state and seeds only a tracker without one. The seeding itself needs a
    CUDA generator: tests/nam56r/test_gpu_model.py covers it on a GPU."""
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME, get_cuda_rng_tracker

    from nam56r.model.model import seed_model_parallel_rng, single_process_groups

    tracker = get_cuda_rng_tracker()
    saved_states, saved_seeds = tracker.get_states(), set(tracker.seeds_)
    state = torch.ByteTensor([1, 2, 3])  # stands for the generator state pretrain recorded
    tracker.set_states({_MODEL_PARALLEL_RNG_TRACKER_NAME: state})
    try:
        assert seed_model_parallel_rng(7, single_process_groups()) is False
        assert tracker.get_states() == {_MODEL_PARALLEL_RNG_TRACKER_NAME: state} and 7 not in tracker.seeds_
    finally:
        tracker.set_states(saved_states)
        tracker.seeds_ = saved_seeds
