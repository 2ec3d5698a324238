"""The sizes the `kernels` suite runs at: the model's, read from a preset (`nam56r.model.presets`), and the
bench's own (micro-batches and token counts), named here. No torch: the derivation is checked on CPU.

A kernel measured at sizes the model does not have says nothing about the model, so no model size is
written down in the suite; each comes from the preset's `ModelConfig`. Values the config does not hold
are named constants below, each saying where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nam56r.model.config import ModelConfig
from nam56r.model.presets import get_preset

KERNEL_PRESET = "nam56r"  # the suite measures the model we train (the proxy has the same widths, fewer layers)

# mamba_ssm's Mamba3(A_floor=1e-4): the clamp of the data-dependent A. NAM56R leaves it at mamba_ssm's default
# (nam56r.model.mamba3_mixer does not pass it), so ModelConfig does not hold it.
MAMBA3_A_FLOOR = 1e-4


@dataclass(frozen=True)
class KernelShapes:
    """The model sizes of the kernel cases, each named after the ModelConfig field it is read from."""

    preset: str
    seq_length: int  # seq_length: every case's sequence (DSA's [seq, seq] scores, CE rows, the Mamba-3 region)
    hidden_size: int  # hidden_size: LM-head input, MoE expert input/output, the layers' input norm
    norm_epsilon: float  # norm_epsilon: the layers' input norm
    vocab_size: int  # vocab_size: LM-head/MTP output
    mtp_depths: int  # mtp.depths: the MTP heads, each one more LM head's cross-entropy
    indexer_heads: int  # dsa.indexer_heads
    indexer_head_dim: int  # dsa.indexer_head_dim
    dsa_topk: int  # dsa.topk
    num_experts: int  # moe.num_experts
    expert_topk: int  # moe.topk
    expert_ffn: int  # moe.expert_ffn
    mamba_heads: int  # mamba.num_heads(hidden_size): expand * hidden_size / head_dim
    mamba_a_floor: float  # not in ModelConfig: MAMBA3_A_FLOOR


def kernel_shapes(preset: str = KERNEL_PRESET) -> KernelShapes:
    """The kernel cases' model sizes for the preset called `preset` (KeyError naming the known ones)."""
    config = get_preset(preset)
    return KernelShapes(
        preset=config.name,
        seq_length=config.seq_length,
        hidden_size=config.hidden_size,
        norm_epsilon=config.norm_epsilon,
        vocab_size=config.vocab_size,
        mtp_depths=config.mtp.depths,
        indexer_heads=config.dsa.indexer_heads,
        indexer_head_dim=config.dsa.indexer_head_dim,
        dsa_topk=config.dsa.topk,
        num_experts=config.moe.num_experts,
        expert_topk=config.moe.topk,
        expert_ffn=config.moe.expert_ffn,
        mamba_heads=config.mamba.num_heads(config.hidden_size),
        mamba_a_floor=MAMBA3_A_FLOOR,
    )


@dataclass(frozen=True)
class KernelSweep:
    """The bench's own sizes, not the model's: how many sequences (micro-batch) or tokens a case runs."""

    dsa_score_batches: tuple[int, ...]  # `dsa-scores mb{b}`: one case per micro-batch
    dsa_topk_batch: int  # `dsa-topk mb{b}`
    ce_batch: int  # `lm-head ce` / `mtp ce`: sequences through the output layer
    moe_tokens: int  # `moe experts (N tokens)`, `moe layer ... (N tokens)`: tokens routed, each to expert_topk experts
    mamba_batch: int  # `mamba3 adt region mb{b}`
    dsa_layer_batch: int  # `dsa layer(s) fwd+bwd seq{seq} mb{b}`
    # `mamba-mimo ... mb{b}`: the MIMO backward launch sweep; the 2xH200 recipe trains at 4, 8 is the next size up
    mimo_bwd_batches: tuple[int, ...]


FULL_SWEEP = KernelSweep(dsa_score_batches=(1, 8), dsa_topk_batch=8, ce_batch=8, moe_tokens=32768, mamba_batch=8, dsa_layer_batch=1,
                         mimo_bwd_batches=(4, 8))
QUICK_SWEEP = KernelSweep(dsa_score_batches=(1,), dsa_topk_batch=1, ce_batch=2, moe_tokens=8192, mamba_batch=8, dsa_layer_batch=1,
                          mimo_bwd_batches=(4,))


def kernel_sweep(quick: bool) -> KernelSweep:
    """The full run's sizes, or `--quick`'s smaller ones (a smoke run, not a result)."""
    return QUICK_SWEEP if quick else FULL_SWEEP


def dsa_layer_config(preset: str, indexer: str, index_cache: bool) -> ModelConfig:
    """The model of the `dsa layer` cases: the preset's, with the DSA indexer path (`DSAConfig.indexer`) and
    IndexCache set; every size, the kernel backend and the loss are the preset's."""
    config = get_preset(preset)
    return replace(
        config, dsa=replace(config.dsa, indexer=indexer), index_cache=replace(config.index_cache, enabled=index_cache)
    ).validate()


def moe_layer_batch(shapes: KernelShapes, sweep: KernelSweep) -> int:
    """The `moe layer` cases' sweep.moe_tokens tokens as sequences of seq_length (the router's sequence aux
    loss sees the model's sequences): how many."""
    if sweep.moe_tokens % shapes.seq_length:
        raise ValueError(f"moe_tokens {sweep.moe_tokens} is not a whole number of {shapes.seq_length}-token sequences")
    return sweep.moe_tokens // shapes.seq_length
