"""A Megatron mixer around mamba_ssm's Mamba-3 (Megatron core_v0.19.0 has no Mamba-3).

Megatron's `MambaLayer` builds `mixer(config, d_model=..., layer_number=..., pg_collection=...)`
and calls it on `[s, b, h]` activations, expecting `(output, bias)`. mamba_ssm's `Mamba3` works on
`[b, s, h]` with its own plain `nn.Linear` projections, so this adapter transposes at the seam and
runs with tensor parallel size 1 only (it says so instead of silently replicating).

Mamba-3's kernels need float32 D, dt_bias, B/C biases and MIMO projections; they are marked
`keep_fp32`, the opt-out that our Megatron patch 0003 adds to Float16Module.

With `Mamba3Config.recompute` (recipe `Recompute.mamba`, launcher `--recompute mamba`) the mixer runs
`Mamba3` through `nam56r.model.recompute.checkpointed` while training: Megatron has no recompute hook inside
a Mamba layer.
"""

from __future__ import annotations

import torch
from mamba_ssm.modules.mamba3 import Mamba3
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from nam56r.model.config import Mamba3Config
from nam56r.model.local_layers import parameter_device
from nam56r.model.recompute import checkpointed

# Parameters Mamba-3's kernels read in float32 (mamba patch 0002 casts at the call sites; these stay
# fp32 in storage too, so Float16Module does not round them through bf16).
KEEP_FP32_PARAMS = ("D", "dt_bias", "B_bias", "C_bias", "mimo_x", "mimo_z", "mimo_o")


def build_mamba3(mamba: Mamba3Config, d_model: int, layer_idx: int, *, device: torch.device | None,
                 dtype: torch.dtype) -> Mamba3:
    """mamba_ssm's `Mamba3` as NAM56R's layers build it (the mixer, and the kernel prewarm that must call its
    kernels with the same shapes: `nam56r.training.launcher.kernel_prewarm`)."""
    return Mamba3(
        d_model=d_model,
        d_state=mamba.d_state,
        expand=mamba.expand,
        headdim=mamba.head_dim,
        ngroups=mamba.ngroups,
        rope_fraction=mamba.rope_fraction,
        is_mimo=mamba.mimo,
        mimo_rank=mamba.mimo_rank,
        chunk_size=mamba.chunk_size,
        layer_idx=layer_idx,
        device=device,
        dtype=dtype,
    )


class Mamba3Mixer(MegatronModule):
    """`[s, b, h] -> ([s, b, h], None)` through mamba_ssm's Mamba-3."""

    def __init__(
        self,
        config: TransformerConfig,
        d_model: int,
        layer_number: int,
        pg_collection: ProcessGroupCollection,
        pp_layer_offset: int = 0,
        name: str | None = None,
        *,
        mamba: Mamba3Config,
    ) -> None:
        super().__init__(config)
        tp_size = pg_collection.tp.size()
        if tp_size != 1:
            raise NotImplementedError(
                f"Mamba3Mixer runs with tensor parallel size 1, got {tp_size}: mamba_ssm's Mamba-3 projections "
                "are not tensor-parallel. Use expert/data parallelism (NAM56R trains at TP=1)."
            )
        if config.sequence_parallel:
            raise NotImplementedError("Mamba3Mixer does not support sequence_parallel (NAM56R trains at TP=1)")
        self.layer_number = layer_number
        self.recompute = mamba.recompute
        self.mamba3 = build_mamba3(mamba, d_model, layer_number, device=parameter_device(config), dtype=config.params_dtype)
        for param_name in KEEP_FP32_PARAMS:
            param = getattr(self.mamba3, param_name, None)
            if param is None:
                continue  # mimo_* exist only in MIMO mode
            if param.dtype != torch.float32:
                raise TypeError(f"Mamba-3 parameter {param_name} was created as {param.dtype}; the kernels need float32")
            param.keep_fp32 = True

    def forward(self, hidden_states: torch.Tensor, inference_context=None, packed_seq_params=None) -> tuple[torch.Tensor, None]:
        if inference_context is not None:
            raise NotImplementedError("Mamba3Mixer is a training mixer; inference contexts are not supported")
        if hidden_states.dim() != 3:
            raise ValueError(f"Mamba3Mixer expects [s, b, h] activations, got shape {tuple(hidden_states.shape)}")
        cu_seqlens = None
        if packed_seq_params is not None:
            if hidden_states.size(1) != 1:
                raise ValueError(f"packed sequences need batch 1 ([t, 1, h]), got shape {tuple(hidden_states.shape)}")
            cu_seqlens = packed_seq_params.cu_seqlens_q
        if self.recompute and self.training and torch.is_grad_enabled():
            out = checkpointed(self.mamba3, hidden_states.transpose(0, 1), cu_seqlens=cu_seqlens)
        else:
            out = self.mamba3(hidden_states.transpose(0, 1), cu_seqlens=cu_seqlens)
        return out.transpose(0, 1), None
