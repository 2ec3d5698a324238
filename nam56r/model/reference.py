"""The reference model NAM56R is measured against: a dense GPT on Megatron's own modules, one per preset.

    python -m nam56r.model.reference --preset nam56r-proxy     # its shape and parameters beside NAM56R's active count

A NAM56R run says little on its own; its loss against tokens means something beside a model everyone knows,
trained on the same data and token budget. The reference is Megatron's `GPTModel` with its local layer spec:
standard causal attention (one key/value head per query head), RoPE, RMSNorm, a SwiGLU MLP, no biases, untied
embedding and output layer, and the mirrored preset's vocabulary, sequence length, RoPE base, norm epsilon and
init std. Its parameters, all active, come close to NAM56R's active parameters per token
(`nam56r.model.params`, MTP heads and n-gram table included).

How a shape is chosen (`fit_shape`): NAM56R's hidden size and attention head count, so the embedding and output
layer (the largest single matrices) are NAM56R's own; FFN first at SwiGLU's customary 8/3 x hidden; the layer
count whose total comes nearest NAM56R's active count; then, at that depth, the FFN width (a multiple of 64)
whose total comes nearest. `REFERENCE_SHAPES` holds the result per preset, so a run's shape never moves with a
later change to NAM56R; tests/nam56r/test_reference_model.py refits it from the built NAM56R and fails when
the two part.

`ReferenceConfig.param_rows` is the parameter arithmetic (the same test holds it to the built model), and
`flops_per_token` its training FLOPs by `nam56r.model.flops`' counting rules.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, fields

from nam56r.model.config import ModelConfig

FFN_MULTIPLE = 64  # FFN widths are multiples of this (tensor-core tiles)
VOCAB_MULTIPLE = 128  # Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by (NAM56R's 128)
# Written into run summaries beside NAM56R's formula; change it whenever `flops_per_token`'s rules change.
FORMULA = "reference-gpt.flops v1 (6 x matmul weights, causal s/2 keys per query, model FLOPs)"


@dataclass(frozen=True)
class ReferenceShape:
    """What the fit chooses; every other size is the mirrored preset's."""

    num_layers: int
    ffn_hidden_size: int


# From `fit_shape` against `nam56r.model.params`' active count of each preset (the test refits them).
REFERENCE_SHAPES: dict[str, ReferenceShape] = {
    "nam56r-tiny": ReferenceShape(num_layers=8, ffn_hidden_size=320),
    "nam56r-proxy": ReferenceShape(num_layers=7, ffn_hidden_size=11328),
    "nam56r": ReferenceShape(num_layers=19, ffn_hidden_size=10560),
}


@dataclass(frozen=True)
class ReferenceConfig:
    name: str
    mirrors: str  # the NAM56R preset this reference is measured against
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int  # SwiGLU: the gate and the up projection are each this wide
    vocab_size: int
    seq_length: int
    rope_base: float
    norm_epsilon: float
    init_std: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def layer_params(self) -> int:
        """One transformer layer: two RMSNorm weights, fused QKV + output projection, SwiGLU fc1 (gate and up) + fc2."""
        h = self.hidden_size
        attention = h * 3 * self.num_heads * self.head_dim + self.num_heads * self.head_dim * h
        return 2 * h + attention + 3 * h * self.ffn_hidden_size

    def param_rows(self) -> dict[str, int]:
        """Parameters by component, as Megatron's GPTModel holds them."""
        h, h_attn = self.hidden_size, self.num_heads * self.head_dim
        return {
            "token embedding": self.padded_vocab_size * h,
            "attention": self.num_layers * (4 * h * h_attn),
            "mlp": self.num_layers * 3 * h * self.ffn_hidden_size,
            "norms": self.num_layers * 2 * h + h,  # two per layer, then the final norm
            "output layer": self.padded_vocab_size * h,
        }

    def total_params(self) -> int:
        return sum(self.param_rows().values())

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token: 6 x every matmul weight (the embedding lookup is a gather), plus causal
        attention's scores and values over s/2 keys per query, forward and two backward GEMMs."""
        h_attn = self.num_heads * self.head_dim
        matmul = self.num_layers * (4 * self.hidden_size * h_attn + 3 * self.hidden_size * self.ffn_hidden_size)
        matmul += self.padded_vocab_size * self.hidden_size
        attention = self.num_layers * 3 * 2 * (2 * h_attn) * seq_length / 2
        return 6 * matmul + attention

    def problems(self) -> list[str]:
        """Sizes Megatron's GPTModel cannot take, each with the value."""
        problems = [f"{name} {value} must be positive" for name, value in
                    (("num_layers", self.num_layers), ("num_heads", self.num_heads), ("ffn_hidden_size", self.ffn_hidden_size))
                    if value < 1]
        if self.num_heads > 0 and self.hidden_size % self.num_heads:
            problems.append(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        return problems

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ReferenceConfig:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown ReferenceConfig fields {sorted(unknown)}")
        config = cls(**data)
        if problems := config.problems():
            raise ValueError(f"reference {config.name!r}: " + "; ".join(problems))
        return config


def mirroring(model: ModelConfig, shape: ReferenceShape) -> ReferenceConfig:
    """A reference of `shape` with every other size, and the sequence length, taken from `model`."""
    return ReferenceConfig(
        name=f"{model.name}-reference", mirrors=model.name, hidden_size=model.hidden_size, num_layers=shape.num_layers,
        num_heads=model.mla.num_heads, ffn_hidden_size=shape.ffn_hidden_size, vocab_size=model.vocab_size,
        seq_length=model.seq_length, rope_base=model.rope_base, norm_epsilon=model.norm_epsilon, init_std=model.init_std,
    )


def reference_for(model: ModelConfig) -> ReferenceConfig:
    """The reference of `model`'s preset, at `model`'s sequence length; KeyError naming the presets that have one."""
    if model.name not in REFERENCE_SHAPES:
        raise KeyError(f"preset {model.name!r} has no reference model; these have one: {', '.join(REFERENCE_SHAPES)}")
    return mirroring(model, REFERENCE_SHAPES[model.name])


def fit_shape(model: ModelConfig, target_params: int) -> ReferenceShape:
    """The shape whose reference of `model` comes nearest `target_params` (the module docstring's procedure)."""
    swiglu = max(FFN_MULTIPLE, round(8 * model.hidden_size / 3 / FFN_MULTIPLE) * FFN_MULTIPLE)
    one_layer = mirroring(model, ReferenceShape(1, swiglu))
    outside_layers = one_layer.total_params() - one_layer.layer_params()
    layers = max(1, round((target_params - outside_layers) / one_layer.layer_params()))
    without_mlp = mirroring(model, ReferenceShape(1, 0)).layer_params()
    per_layer = (target_params - outside_layers) / layers
    ffn = max(FFN_MULTIPLE, round((per_layer - without_mlp) / (3 * model.hidden_size) / FFN_MULTIPLE) * FFN_MULTIPLE)
    return ReferenceShape(layers, ffn)


def model_from_dict(data: dict) -> ModelConfig | ReferenceConfig:
    """A run's model_config.json: NAM56R's config, or a reference's (which names the preset it `mirrors`)."""
    return ReferenceConfig.from_dict(data) if "mirrors" in data else ModelConfig.from_dict(data)


def describe(reference: ReferenceConfig, nam56r_active: int) -> list[str]:
    """The reference's shape and parameters by component beside NAM56R's active count."""
    total = reference.total_params()
    lines = [f"reference of {reference.mirrors}: Megatron GPTModel (local spec), hidden {reference.hidden_size}, "
             f"{reference.num_layers} layers, {reference.num_heads} heads of {reference.head_dim}, SwiGLU FFN "
             f"{reference.ffn_hidden_size}, vocab {reference.padded_vocab_size}, seq {reference.seq_length}"]
    lines += [f"  {name:<16}{n:>17,}" for name, n in reference.param_rows().items()]
    lines.append(f"total (all active): {total:,}; {reference.mirrors} active: {nam56r_active:,} "
                 f"({(total - nam56r_active) / nam56r_active:+.2%})")
    return lines


def main(argv: list[str] | None = None) -> int:
    import warnings

    from nam56r.model.params import count_parameters
    from nam56r.model.presets import get_preset

    parser = argparse.ArgumentParser(prog="python -m nam56r.model.reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=sorted(REFERENCE_SHAPES), help="the NAM56R preset the reference mirrors")
    args = parser.parse_args(argv)
    model = get_preset(args.preset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's import-time notices about missing TE/Apex
        active = count_parameters(model).active
    reference = reference_for(model)
    print("\n".join(describe(reference, active)))
    if (fitted := fit_shape(model, active)) != REFERENCE_SHAPES[args.preset]:
        print(f"note: the fit against today's active count gives {fitted}, not the declared {REFERENCE_SHAPES[args.preset]}")
    print(f"total: {reference.total_params()}")
    print(f"active: {reference.total_params()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
