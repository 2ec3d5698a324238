"""The reference GPT (`nam56r.model.reference`) on Megatron: its architecture table, config and builder.

`REFERENCE_FIELDS` is the reference's counterpart of NAM56R's `ARCH_FIELDS` (`nam56r.model.megatron_fields`), read
the same three ways: the config of builds outside training (`reference_transformer_config`), the training command's
architecture flags (`reference_architecture_flags`), and the check that the config Megatron derived from the command
still describes the reference (`reference_mismatches`). The builder is Megatron's own: `GPTModel` with
`get_gpt_layer_local_spec` (torch RMSNorm, Megatron's `SelfAttention` with `DotProductAttention`, `MLP`), and
nothing of NAM56R's: no fused linear cross-entropy, Liger, TileLang, n-gram embedding or MTP.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from nam56r.model.megatron_fields import ArchField
from nam56r.model.model import cuda_buffers_on, seed_model_parallel_rng, single_process_groups
from nam56r.model.reference import VOCAB_MULTIPLE, ReferenceConfig

# In the order of the training command. The values are functions of a ReferenceConfig.
REFERENCE_FIELDS: tuple[ArchField, ...] = (
    ArchField("num_layers", "--num-layers", lambda r: r.num_layers),
    ArchField("hidden_size", "--hidden-size", lambda r: r.hidden_size),
    ArchField("num_attention_heads", "--num-attention-heads", lambda r: r.num_heads),
    ArchField("num_query_groups", None, lambda r: r.num_heads),  # one key/value head per query head
    ArchField("kv_channels", None, lambda r: r.head_dim),
    ArchField("ffn_hidden_size", "--ffn-hidden-size", lambda r: r.ffn_hidden_size),
    ArchField("gated_linear_unit", "--swiglu", True, switch=True),
    ArchField("activation_func", None, lambda r: F.silu),
    ArchField("seq_length", "--seq-length", lambda r: r.seq_length, in_config=False),
    ArchField("max_position_embeddings", "--max-position-embeddings", lambda r: r.seq_length, in_config=False),
    ArchField("position_embedding_type", "--position-embedding-type", "rope", in_config=False),
    ArchField("rotary_base", "--rotary-base", lambda r: int(r.rope_base), in_config=False),
    ArchField("normalization", "--normalization", "RMSNorm"),
    ArchField("persist_layer_norm", "--no-persist-layer-norm", False, switch=False),  # torch's norms refuse Apex's kernel
    ArchField("layernorm_epsilon", "--norm-epsilon", lambda r: r.norm_epsilon),
    ArchField("add_bias_linear", "--disable-bias-linear", False, switch=False),
    ArchField("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", True, switch=True, in_config=False),
    ArchField("attention_dropout", "--attention-dropout", 0.0),
    ArchField("hidden_dropout", "--hidden-dropout", 0.0),
    ArchField("init_method_std", "--init-method-std", lambda r: r.init_std),
    ArchField("apply_rope_fusion", "--no-rope-fusion", False, switch=False),  # fused RoPE is TransformerEngine's
    # What the reference is not: Megatron's defaults, checked so that an extra flag cannot turn them on.
    ArchField("multi_latent_attention", None, False),
    ArchField("qk_layernorm", None, False),
    ArchField("num_moe_experts", None, None),
    ArchField("mtp_num_layers", None, None),
    ArchField("fused_linear_cross_entropy", None, False),
    ArchField("make_vocab_size_divisible_by", "--make-vocab-size-divisible-by", VOCAB_MULTIPLE, in_config=False),
)


def reference_architecture_flags(reference: ReferenceConfig) -> list[str]:
    """Megatron's flags for the reference's architecture, in the table's order."""
    return [word for row in REFERENCE_FIELDS for word in row.flags(reference)]  # type: ignore[arg-type]


def reference_mismatches(reference: ReferenceConfig, args: Any, megatron_cfg: Any) -> list[str]:
    """The facts on which Megatron's parsed `args` and the TransformerConfig it derived differ from `reference`, each
    with the flag that sets it; empty when the command describes the reference."""
    problems = []
    for row in REFERENCE_FIELDS:
        given, ours = getattr(megatron_cfg if row.in_config else args, row.field), row.of(reference)  # type: ignore[arg-type]
        if given != ours:
            where = f" (set by {row.flag})" if row.flag else ""
            problems.append(f"{row.field}: flags give {given!r}, the reference defines {ours!r}{where}")
    return problems


def reference_transformer_config(reference: ReferenceConfig, *, params_dtype: torch.dtype = torch.float32,
                                 meta: bool = False) -> TransformerConfig:
    """Megatron's config for builds outside training; `meta=True` allocates parameters without initializing them."""
    fields = {row.field: row.of(reference) for row in REFERENCE_FIELDS if row.in_config}  # type: ignore[arg-type]
    return TransformerConfig(**fields, params_dtype=params_dtype, bf16=True, use_cpu_initialization=True,
                             perform_initialization=not meta)


def build_reference_model(
    reference: ReferenceConfig,
    *,
    device: str = "meta",
    megatron_cfg: TransformerConfig | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    seed: int = 0,
) -> GPTModel:
    """Megatron's GPTModel on its local layer spec. device "meta": shapes only; "cpu": real tensors (small
    references); "cuda": trainable on the current GPU. `megatron_cfg`: the training path's config, derived by
    Megatron from the launcher's flags and checked against `reference` by the caller (`reference_mismatches`)."""
    if device not in ("meta", "cpu", "cuda"):
        raise ValueError(f"device must be 'meta', 'cpu' or 'cuda', got {device!r}")
    mcfg = megatron_cfg if megatron_cfg is not None else reference_transformer_config(reference, meta=device == "meta")
    pg_collection = pg_collection or single_process_groups("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        seed_model_parallel_rng(seed, pg_collection)
        mcfg.use_cpu_initialization = False
    else:
        mcfg.use_cpu_initialization = True
        mcfg.perform_initialization = mcfg.perform_initialization and device != "meta"
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    with nullcontext() if device == "cuda" else cuda_buffers_on(device), torch.device("meta") if device == "meta" else nullcontext():
        model = GPTModel(
            config=mcfg,
            transformer_layer_spec=spec,
            vocab_size=reference.padded_vocab_size,
            max_sequence_length=reference.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=int(reference.rope_base),
            pg_collection=pg_collection,
        )
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    return model
