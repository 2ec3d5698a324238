"""Pattern parsing and the translation to Megatron's hybrid pattern (no Megatron import needed)."""

from __future__ import annotations

import pytest

from nam56r.model.pattern import LayerKind, PatternError, layout_of, parse_pattern, translate
from nam56r.model.presets import get_preset


def test_nam56r_layout_matches_the_architecture() -> None:
    layout = layout_of(get_preset("nam56r"))
    counts = layout.counts()
    assert len(layout.main) == 52
    assert (counts[LayerKind.MLA] + counts[LayerKind.DSA], counts[LayerKind.MOE], counts[LayerKind.MAMBA3]) == (13, 22, 17)
    attention = [k for k in layout.main if k in (LayerKind.MLA, LayerKind.DSA)]
    assert [i for i, k in enumerate(attention) if k == LayerKind.MLA] == [0, 4, 8, 12]
    assert layout.layer_numbers(LayerKind.DSA) == (5, 9, 13, 21, 25, 29, 37, 41, 45)
    # every attention layer is followed by an MoE/Mamba group
    for i, kind in enumerate(layout.main):
        if kind in (LayerKind.MLA, LayerKind.DSA):
            assert layout.main[i + 1] == LayerKind.MOE


def test_megatron_pattern_is_explicit_per_family() -> None:
    pattern = layout_of(get_preset("nam56r")).megatron_pattern
    assert pattern.startswith("+EMEDEMEDEMMDEME+EMEDEMM")
    assert pattern.endswith("+EME/*-/*-")
    assert pattern.count("/") == 2 and len(pattern.split("/")[0]) == 52


def test_full_attention_every_controls_the_mla_dsa_split() -> None:
    layout = translate("*M*M*M", full_attention_every=2)
    assert layout.main == (LayerKind.MLA, LayerKind.MAMBA3, LayerKind.DSA, LayerKind.MAMBA3, LayerKind.MLA, LayerKind.MAMBA3)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("*EMD", r"'D' at position 3 is Megatron's DSA symbol"),
        ("*E+M", r"'\+' at position 2 is Megatron's MLA symbol"),
        ("*EM|*EM", r"pipeline-stage separator"),
        ("*EM/*-", r"MTP separator"),
        ("*EXM", r"unknown symbol 'X' at position 2"),
        ("", r"main pattern is empty"),
    ],
)
def test_bad_patterns_are_rejected_with_the_symbol_and_position(pattern: str, message: str) -> None:
    with pytest.raises(PatternError, match=message):
        translate(pattern, full_attention_every=4)


def test_mtp_pattern_without_depths_is_rejected() -> None:
    with pytest.raises(PatternError, match="mtp_depths=0"):
        translate("*EM", full_attention_every=4, mtp_pattern="*-", mtp_depths=0)


def test_bad_mtp_pattern_is_rejected() -> None:
    with pytest.raises(PatternError, match="MTP pattern"):
        translate("*EM", full_attention_every=4, mtp_pattern="*G", mtp_depths=1)


def test_parse_pattern_returns_symbols() -> None:
    assert parse_pattern("*EM-") == ["*", "E", "M", "-"]
