"""DSA's two phases, dense warm-up then sparse, as the DSA layers of a built model run them.

What Megatron core_v0.19.0 has (dsa.py and transformer_config.py of the patched tree; upstream main at
d98e8a64, 2026-08-22, is the same on each point):

- `DSAttention` always attends over the indexer's top-k (`_run_sparse_attention`, dsa.py:116): there is
  no dense-attention mode, no warm-up flag and no freezing of the main path. The indexer's inputs are
  always detached (dsa.py:1879-1880), so the indexer learns only from its KL loss and the rest of the
  model only from the LM loss.
- `dsa_indexer_use_sparse_loss` (transformer_config.py:328) switches only the KL's support: the top-k
  keys (True) or every causal key (False) in `compute_dsa_indexer_loss` (dsa.py:482-490). Attention
  stays top-k either way.
- The TileLang backend streams the indexer KL for the top-k support only; the dense support is a
  fused-path decline (dsa.py:2157, from our patch 0004), an error under strict fused paths. The cuDNN
  backend has a fused dense loss (`_compute_dense_indexer_loss_and_grads`, dsa_cudnn_kernels.py:1871)
  for FlashMLA's 512-wide latent only (`_FLASH_MLA_REQUIRED_VALUE_DIM`), not NAM56R's 64. The split-K
  indexer-loss kernels (Megatron-LM PRs #2869 and #4039) are open, not merged.

What the warm-up is here. DeepSeek-V3.2 (paper, section 2.1) starts DSA with a dense warm-up: attention
stays dense while the indexer learns to match the head-summed, L1-normalised dense attention by KL,
then top-k selection is switched on and the KL is taken over the selected keys. In a dense warm-up step
every DSA layer of NAM56R runs Megatron's DSA with its top-k widened to the sequence length
(`DSAttention.index_topk`, read on every forward): every causal key is selected, so the "sparse"
attention is exactly dense causal attention, and the KL over the selected keys is Megatron's dense
indexer KL (`compute_dsa_indexer_loss` gives the same loss and gradient with sparse_loss=True at k = s
as with sparse_loss=False; tests/nam56r/test_dsa_phases.py checks it). So the warm-up runs on the
same fused TileLang kernels as the sparse phase (upstream's streaming indexer KL at k = s), with strict
fused paths kept on and no Megatron patch. Unlike DeepSeek-V3.2, which continued a trained dense model
and froze everything but the indexer, NAM56R trains from scratch: the whole model learns from the LM
loss during the warm-up, on dense attention, while the indexer learns what that attention looks at.
Then `sparse` restores the configured top-k (`dsa_indexer_topk`).

Cost of a warm-up step: attention over every causal key instead of top-k, and top-k indices of
[batch, s, s] kept per Full DSA layer for the backward (IndexCache's Shared layers reuse them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

DsaPhase = Literal["dense-warmup", "sparse"]
DSA_PHASES: tuple[DsaPhase, ...] = ("dense-warmup", "sparse")


def dsa_layers(model: torch.nn.Module) -> list:
    """Megatron's DSAttention modules of `model` (through any Megatron or DDP wrapper), in module order."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    return [m for m in model.modules() if isinstance(m, DSAttention)]


def dsa_topk_for(phase: DsaPhase, configured_topk: int, seq_length: int) -> int:
    """The top-k a DSA layer selects in `phase`: every key of a sequence in the warm-up, else the configured one."""
    if phase not in DSA_PHASES:
        raise ValueError(f"DSA phase must be one of {DSA_PHASES}, got {phase!r}")
    if seq_length < 1 or configured_topk < 1:
        raise ValueError(f"seq_length {seq_length} and top-k {configured_topk} must be positive")
    return seq_length if phase == "dense-warmup" else configured_topk


def apply_dsa_phase(model: torch.nn.Module, phase: DsaPhase, seq_length: int) -> int:
    """Put every DSA layer of `model` in `phase` for sequences of up to `seq_length` keys; returns how
    many layers it set. Idempotent: it sets each layer's `index_topk` from its config's `dsa_indexer_topk`."""
    layers = dsa_layers(model)
    for layer in layers:
        layer.index_topk = dsa_topk_for(phase, layer.config.dsa_indexer_topk, seq_length)
    return len(layers)


def dsa_phase_of(model: torch.nn.Module) -> DsaPhase | None:
    """The phase `model`'s DSA layers are in (None without DSA layers); raises if they disagree."""
    phases = {"sparse" if layer.index_topk == layer.config.dsa_indexer_topk else "dense-warmup" for layer in dsa_layers(model)}
    if len(phases) > 1:
        raise RuntimeError(f"the model's DSA layers are in different phases: {sorted(phases)}")
    return next(iter(phases), None)
