"""Presets and the config's consistency checks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nam56r.model.config import Mamba3Config, ModelConfig, MoEConfig
from nam56r.model.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(name: str) -> None:
    config = get_preset(name)
    assert config.name == name
    assert config.num_layers == len(config.pattern)


def test_canonical_sizes() -> None:
    c = get_preset("nam56r")
    assert (c.hidden_size, c.vocab_size, c.seq_length, c.num_layers) == (4096, 131072, 4096, 52)
    assert c.mamba.num_heads(c.hidden_size) == 128
    assert (c.moe.num_experts, c.moe.topk, c.moe.expert_ffn, c.moe.shared_expert_ffn) == (16, 4, 896, 1024)
    assert not c.index_cache.enabled  # on only once measured to help


def test_proxy_keeps_widths_and_mix() -> None:
    full, proxy = get_preset("nam56r"), get_preset("nam56r-proxy")
    assert proxy.hidden_size == full.hidden_size and proxy.moe == full.moe and proxy.mamba == full.mamba
    assert proxy.pattern_unit == full.pattern_unit and proxy.num_layers < full.num_layers


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: nam56r"):
        get_preset("nam57")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mamba": Mamba3Config(ngroups=7)}, "ngroups 7 does not divide the 128 Mamba-3 heads"),
        ({"moe": MoEConfig(num_experts=4, topk=5)}, "topk 5 exceeds"),
        ({"mamba": Mamba3Config(rope_fraction=0.25)}, "rope_fraction 0.25"),
        ({"hidden_size": 4000}, "not a multiple of mamba.head_dim"),
    ],
)
def test_inconsistent_sizes_are_rejected(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(get_preset("nam56r"), **change).validate()


def test_a_model_config_naming_an_ngram_kernel_is_refused() -> None:
    """The n-gram embedding has one path (embedding + linear) and no `ngram.kernel` field: a model config
    file that names one is refused with the field, not loaded as if it were not there."""
    data = get_preset("nam56r-tiny").to_dict()
    data["ngram"]["kernel"] = "reference"
    with pytest.raises(ValueError, match=r"unknown NgramHashConfig fields \['kernel'\]"):
        ModelConfig.from_dict(data)
