"""NAM56R's layer pattern and its explicit translation to Megatron's hybrid pattern.

Our symbols (the original team's notation):

    *  attention slot   E  MoE layer   M  Mamba-3 layer   -  dense MLP layer

In the main decoder the attention slots alternate by position: attention layers 0, k, 2k, ...
(k = `full_attention_every`) are full MLA, the rest DSA (sparse MLA with a lightning indexer).
Megatron core_v0.19.0's hybrid pattern has one symbol per block family (`+` MLA, `D` DSA, `E`
MoE, `M` Mamba, `-` MLP, `*` standard attention slot, `/` MTP separator). The translation is a
table, not a guess: a symbol without an entry is rejected, and so are Megatron's own symbols
inside our pattern, because writing `D` or `+` by hand would bypass the full/sparse schedule.

In the MTP heads the attention slot stays Megatron's `*` (suffix `/*-/*-` for two depths, as the
original launcher built them); our specs fill Megatron's `*` slot with a full MLA layer, since the
model's attention is MLA everywhere.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from nam56r.model.config import ModelConfig


class LayerKind(StrEnum):
    MLA = "mla"
    DSA = "dsa"
    MOE = "moe"
    MAMBA3 = "mamba3"
    MLP = "mlp"
    MTP_ATTENTION = "mtp-attention"


ATTENTION_SLOT = "*"
OUR_SYMBOLS = {"*": "attention slot", "E": "MoE", "M": "Mamba-3", "-": "dense MLP"}
_FIXED_KIND = {"E": LayerKind.MOE, "M": LayerKind.MAMBA3, "-": LayerKind.MLP}
MEGATRON_SYMBOL = {
    LayerKind.MLA: "+",
    LayerKind.DSA: "D",
    LayerKind.MOE: "E",
    LayerKind.MAMBA3: "M",
    LayerKind.MLP: "-",
    LayerKind.MTP_ATTENTION: "*",
}
MEGATRON_MTP_SEPARATOR = "/"
_MEGATRON_ONLY = {
    "+": "Megatron's MLA symbol",
    "D": "Megatron's DSA symbol",
    "G": "Megatron's gated-delta-net symbol (NAM56R has none)",
    "|": "Megatron's pipeline-stage separator (set pipeline splits in the recipe, not the pattern)",
    "/": "Megatron's MTP separator (MTP is configured by ModelConfig.mtp)",
}


class PatternError(ValueError):
    """A NAM56R pattern that cannot be translated; the message names the symbol and position."""


def parse_pattern(pattern: str, *, where: str = "main") -> list[str]:
    """Validate `pattern` (our symbols) and return its symbols; raise PatternError otherwise."""
    if not pattern:
        raise PatternError(f"{where} pattern is empty")
    for position, symbol in enumerate(pattern):
        if symbol in OUR_SYMBOLS:
            continue
        known = ", ".join(f"{s!r} {meaning}" for s, meaning in OUR_SYMBOLS.items())
        if symbol in _MEGATRON_ONLY:
            raise PatternError(
                f"{where} pattern {pattern!r}: {symbol!r} at position {position} is {_MEGATRON_ONLY[symbol]}; "
                f"NAM56R patterns use {known}, and the MLA/DSA choice comes from full_attention_every"
            )
        raise PatternError(f"{where} pattern {pattern!r}: unknown symbol {symbol!r} at position {position}; known: {known}")
    return list(pattern)


@dataclass(frozen=True)
class LayerLayout:
    """The model's layers by kind, and the Megatron pattern that builds exactly them."""

    main: tuple[LayerKind, ...]
    mtp: tuple[LayerKind, ...]
    mtp_depths: int

    @property
    def megatron_pattern(self) -> str:
        main = "".join(MEGATRON_SYMBOL[kind] for kind in self.main)
        mtp = "".join(MEGATRON_SYMBOL[kind] for kind in self.mtp)
        return main + (MEGATRON_MTP_SEPARATOR + mtp) * self.mtp_depths

    def layer_numbers(self, kind: LayerKind) -> tuple[int, ...]:
        """1-based main-decoder layer numbers of `kind`, as Megatron's HybridStack numbers them."""
        return tuple(i + 1 for i, k in enumerate(self.main) if k == kind)

    def counts(self) -> dict[LayerKind, int]:
        """Layers per kind, main decoder and all MTP depths together."""
        counts = Counter(self.main)
        for kind in self.mtp:
            counts[kind] += self.mtp_depths
        return dict(counts)


def translate(pattern: str, *, full_attention_every: int, mtp_pattern: str = "", mtp_depths: int = 0) -> LayerLayout:
    """Our pattern (+ MTP pattern and depth count) to a LayerLayout; fail closed on anything unmapped."""
    if full_attention_every < 1:
        raise PatternError(f"full_attention_every must be positive, got {full_attention_every}")
    main: list[LayerKind] = []
    attention_index = 0
    for symbol in parse_pattern(pattern, where="main"):
        if symbol == ATTENTION_SLOT:
            main.append(LayerKind.MLA if attention_index % full_attention_every == 0 else LayerKind.DSA)
            attention_index += 1
        else:
            main.append(_FIXED_KIND[symbol])
    mtp: list[LayerKind] = []
    if mtp_depths:
        for symbol in parse_pattern(mtp_pattern, where="MTP"):
            mtp.append(LayerKind.MTP_ATTENTION if symbol == ATTENTION_SLOT else _FIXED_KIND[symbol])
    elif mtp_pattern:
        raise PatternError(f"MTP pattern {mtp_pattern!r} given with mtp_depths=0")
    return LayerLayout(main=tuple(main), mtp=tuple(mtp), mtp_depths=mtp_depths)


def layout_of(config: ModelConfig) -> LayerLayout:
    return translate(
        config.pattern,
        full_attention_every=config.full_attention_every,
        mtp_pattern=config.mtp.pattern if config.mtp.depths else "",
        mtp_depths=config.mtp.depths,
    )
