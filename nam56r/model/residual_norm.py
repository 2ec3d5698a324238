"""The transformer layers' input norms on one fused kernel each way (`ModelConfig.residual_norm="fused"`).

Why: a Megatron TransformerLayer reads its input through its norm (`input_layernorm` before attention,
`pre_mlp_layernorm` before the MLP or MoE) and again as the residual. On the local backend the norm is torch's
RMSNorm (`WrappedTorchNorm`), whose backward is two kernels (the input's gradient, then the weight's), and autograd
then adds the residual's gradient to the input's in bf16, a third pass over [tokens, hidden].
`ResidualRMSNorm` returns `(normed, residual)`, the pair Megatron's TransformerLayer takes from a norm that hands out
the residual itself, so the residual's gradient reaches the norm's backward, which sums it in
(`nam56r_kernels.residual_rms_norm`): one pass, rounded once.

It stands where WrappedTorchNorm builds `torch.nn.RMSNorm`, with the same parameter (`weight`, ones) and state-dict
key, and refuses what WrappedTorchNorm refuses. The norms that are not a layer's input norm (MLA's q/kv norms, the
Mamba layers', the final and MTP norms) stay WrappedTorchNorm.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from nam56r_kernels.residual_rms_norm import rms_norm_residual

__all__ = ["ResidualRMSNorm"]


class ResidualRMSNorm(torch.nn.Module):
    """forward(hidden_states [..., H]) -> (normed [..., H], residual [..., H]) in hidden_states' dtype, on CUDA (or under
    Triton's interpreter); the weight must be in hidden_states' dtype (Float16Module's cast gives it)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:
        # WrappedTorchNorm's signature; like it, the norm kind is read from the config.
        unsupported = {
            f"normalization={config.normalization!r} (needs 'RMSNorm')": config.normalization != "RMSNorm",
            "layernorm_zero_centered_gamma=True": config.layernorm_zero_centered_gamma or zero_centered_gamma,
            "persist_layer_norm=True": config.persist_layer_norm or persist_layer_norm,
            "sequence_parallel=True": config.sequence_parallel,
            "memory_efficient_layer_norm=True": config.memory_efficient_layer_norm,
        }
        if problems := [name for name, bad in unsupported.items() if bad]:
            raise ValueError("ModelConfig.residual_norm='fused' does not support " + "; ".join(problems)
                             + "; use residual_norm='torch'")
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        if self.weight.dtype != hidden_states.dtype:
            raise ValueError(f"ResidualRMSNorm's weight is {self.weight.dtype} and its input {hidden_states.dtype}; the fused norm "
                             "takes both in one dtype (Float16Module casts the weight to the model's)")
        normed, residual = rms_norm_residual(hidden_states.reshape(-1, shape[-1]), self.weight, self.eps)
        return normed.view(shape), residual.view(shape)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
