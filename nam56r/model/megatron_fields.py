"""NAM56R's architecture as Megatron holds it: one table, `ARCH_FIELDS`, read three ways.

Each row is one fact: the `MLATransformerConfig` field (or, for the few Megatron keeps out of it, the
attribute of its parsed arguments), the flag of Megatron's parser that sets it, and its value for a
`ModelConfig`. From the table come

- `transformer_config_fields`: the architecture part of `nam56r.model.model.megatron_config`, which
  builds the model outside training (parameter counts, CPU tests, benches);
- `architecture_flags`: the architecture part of the training command (`nam56r.training.launcher.flags`);
- `architecture_mismatches`: the launcher's and the model provider's check that the config Megatron
  derived from the command (extra flags included) still describes the model config, before building.

That a flag sets its field as a row says is Megatron's doing (its parser's `dest`, then
`core_transformer_config_from_args`, which copies parsed arguments to config fields of the same name):
tests/nam56r/test_provider_build.py holds the two lowerings to each other by building through
`pretrain`'s model provider from the flags, parsed by Megatron's parser. Since both move together when
a row changes, tests/nam56r/megatron_architecture.json keeps every preset's facts as reviewed: a change
here that changes the model changes that file in the same commit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nam56r.model.config import ModelConfig
from nam56r.model.pattern import layout_of


@dataclass(frozen=True)
class ArchField:
    """One architecture fact: where Megatron keeps it, the flag that sets it, and its value."""

    # The MLATransformerConfig field; with in_config=False, the attribute of Megatron's parsed arguments.
    field: str
    # The flag of Megatron's parser that sets it; None where Megatron derives the value from another
    # flag (the layer pattern) or its default is NAM56R's value.
    flag: str | None
    # A constant, or the value for a ModelConfig. None leaves the flag out (Megatron's default is None).
    value: Callable[[ModelConfig], Any] | str | int | float | bool
    # A flag without a value (store_true/store_false): the value of `field` it gives. It is passed
    # when the row's value is that one and left out otherwise (Megatron's default is the other).
    switch: bool | None = None
    # False: not a TransformerConfig field; Megatron keeps it in its parsed arguments only.
    in_config: bool = True
    # How the model runs, not what it is: the launcher passes this value, an extra flag may replace
    # it, and `architecture_mismatches` leaves it alone.
    runtime: bool = False

    def of(self, config: ModelConfig) -> Any:
        """This fact's value for `config`."""
        return self.value(config) if callable(self.value) else self.value

    def flags(self, config: ModelConfig) -> list[str]:
        """The command-line words that give Megatron this row's value for `config` (none where its default does)."""
        if self.flag is None:
            return []
        value = self.of(config)
        if self.switch is not None:
            return [self.flag] if value == self.switch else []
        return [] if value is None else [self.flag, str(value)]


# In the order of the training command.
ARCH_FIELDS: tuple[ArchField, ...] = (
    # Layers: Megatron counts the main decoder's and the MTP heads' (after "/") in the pattern.
    ArchField("hybrid_layer_pattern", "--hybrid-layer-pattern", lambda c: layout_of(c).megatron_pattern, in_config=False),
    ArchField("num_layers", None, lambda c: len(layout_of(c).main)),
    ArchField("mtp_num_layers", None, lambda c: c.mtp.depths or None),
    ArchField("hidden_size", "--hidden-size", lambda c: c.hidden_size),
    ArchField("num_attention_heads", "--num-attention-heads", lambda c: c.mla.num_heads),
    ArchField("ffn_hidden_size", "--ffn-hidden-size", lambda c: c.mtp.dense_ffn),  # the only dense MLPs are the MTP heads'
    ArchField("seq_length", "--seq-length", lambda c: c.seq_length, in_config=False),
    ArchField("max_position_embeddings", "--max-position-embeddings", lambda c: c.seq_length, in_config=False),
    ArchField("position_embedding_type", "--position-embedding-type", "rope", in_config=False),
    ArchField("rope_type", "--rope-type", "rope"),  # MLA's default is yarn
    ArchField("rotary_base", "--rotary-base", lambda c: int(c.rope_base)),  # an integer flag
    ArchField("normalization", "--normalization", "RMSNorm"),
    # Megatron asks for Apex's persistent LayerNorm kernel by default; NAM56R's norms are TE's or,
    # on the local backend, torch's (WrappedTorchNorm), which refuse the flag.
    ArchField("persist_layer_norm", "--no-persist-layer-norm", False, switch=False),
    ArchField("layernorm_epsilon", "--norm-epsilon", lambda c: c.norm_epsilon),
    ArchField("add_bias_linear", "--disable-bias-linear", False, switch=False),
    ArchField("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", True, switch=True, in_config=False),
    ArchField("gated_linear_unit", None, False),  # non-gated MLPs and experts (--swiglu would gate them)
    ArchField("attention_dropout", "--attention-dropout", 0.0),
    ArchField("hidden_dropout", "--hidden-dropout", 0.0),
    ArchField("init_method_std", "--init-method-std", lambda c: c.init_std),
    # Multi-head latent attention (the full MLA and the DSA layers)
    ArchField("multi_latent_attention", "--multi-latent-attention", True, switch=True),
    ArchField("q_lora_rank", "--q-lora-rank", lambda c: c.mla.q_lora_rank),
    ArchField("kv_lora_rank", "--kv-lora-rank", lambda c: c.mla.kv_lora_rank),
    ArchField("qk_head_dim", "--qk-head-dim", lambda c: c.mla.qk_head_dim),
    ArchField("qk_pos_emb_head_dim", "--qk-pos-emb-head-dim", lambda c: c.mla.qk_rope_head_dim),
    ArchField("v_head_dim", "--v-head-dim", lambda c: c.mla.v_head_dim),
    ArchField("qk_layernorm", "--qk-layernorm", True, switch=True),
    # DSA
    ArchField("experimental_attention_variant", "--experimental-attention-variant", "dsa"),
    ArchField("apply_rope_fusion", "--no-rope-fusion", False, switch=False),  # DSAttention rejects fused RoPE
    ArchField("dsa_indexer_n_heads", "--dsa-indexer-n-heads", lambda c: c.dsa.indexer_heads),
    ArchField("dsa_indexer_head_dim", "--dsa-indexer-head-dim", lambda c: c.dsa.indexer_head_dim),
    ArchField("dsa_indexer_topk", "--dsa-indexer-topk", lambda c: c.dsa.topk),
    ArchField("dsa_indexer_loss_coeff", "--dsa-indexer-loss-coeff", lambda c: c.dsa.indexer_loss_coeff),
    ArchField("dsa_indexer_use_sparse_loss", "--dsa-indexer-use-sparse-loss", lambda c: c.dsa.sparse_indexer_loss, switch=True),
    ArchField("dsa_indexer_rotate_activation", "--no-dsa-indexer-rotate-activation", lambda c: c.dsa.rotate_activation, switch=False),
    # MoE
    ArchField("num_moe_experts", "--num-experts", lambda c: c.moe.num_experts),
    ArchField("moe_router_topk", "--moe-router-topk", lambda c: c.moe.topk),
    ArchField("moe_ffn_hidden_size", "--moe-ffn-hidden-size", lambda c: c.moe.expert_ffn),
    ArchField("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size", lambda c: c.moe.shared_expert_ffn or None),
    ArchField("moe_router_score_function", "--moe-router-score-function", lambda c: c.moe.score_function),
    ArchField("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias", lambda c: c.moe.expert_bias, switch=True),
    ArchField("moe_router_load_balancing_type", "--moe-router-load-balancing-type", "seq_aux_loss"),
    ArchField("moe_aux_loss_coeff", "--moe-aux-loss-coeff", lambda c: c.moe.aux_loss_coeff),
    ArchField("moe_router_dtype", "--moe-router-dtype", "fp32"),
    ArchField("moe_token_dispatcher_type", "--moe-token-dispatcher-type", "alltoall", runtime=True),
    ArchField("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", 128, in_config=False),
)


def transformer_config_fields(config: ModelConfig) -> dict[str, Any]:
    """The MLATransformerConfig fields of the architecture, with their values for `config`."""
    return {row.field: row.of(config) for row in ARCH_FIELDS if row.in_config}


def architecture_flags(config: ModelConfig) -> list[str]:
    """Megatron's flags for the architecture of `config`, in the table's order."""
    return [word for row in ARCH_FIELDS for word in row.flags(config)]


def architecture_mismatches(config: ModelConfig, args: Any, megatron_cfg: Any) -> list[str]:
    """The facts on which Megatron's parsed arguments `args` and the MLATransformerConfig it derived
    from them (`megatron_cfg`) differ from `config`, each with the flag that sets it; runtime rows are
    left out. Empty when the command describes `config`."""
    problems = []
    for row in ARCH_FIELDS:
        if row.runtime:
            continue
        given, ours = getattr(megatron_cfg if row.in_config else args, row.field), row.of(config)
        if given != ours:
            where = f" (set by {row.flag})" if row.flag else ""
            problems.append(f"{row.field}: flags give {given!r}, NAM56R defines {ours!r}{where}")
    return problems
