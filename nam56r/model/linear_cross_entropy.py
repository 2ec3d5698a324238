"""The LM head's and MTP heads' loss on our chunked linear cross-entropy, in Megatron's layouts.

Megatron patch 0016 lets `fused_linear_cross_entropy` call an implementation named by
`TransformerConfig.fused_linear_cross_entropy_impl` ("module:function"); `CHUNKED_LINEAR_CE` names
`megatron_linear_cross_entropy` below, which adapts Megatron's [s, b] layouts to
`nam56r_kernels.linear_cross_entropy` (tokens flattened s-major, as the hidden states are laid out).
The loss mask Megatron passes (the LM head's, or each MTP depth's rolled one) is the per-token weight the
chunked path folds into its gradients in forward.
"""

from __future__ import annotations

import torch

CHUNKED_LINEAR_CE = "nam56r.model.linear_cross_entropy:megatron_linear_cross_entropy"


def megatron_linear_cross_entropy(
    hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None,
    return_predictions: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden_states [s, b, h], weight [V, h], labels and loss_mask [b, s] -> (fp32 loss [b, s], argmax [s, b] or
    None): `fused_linear_cross_entropy`'s contract (Megatron patches 0007 and 0016)."""
    # Imported here: the launcher lowers CHUNKED_LINEAR_CE into its flags and should not load Triton to do so.
    from nam56r_kernels.linear_cross_entropy import linear_cross_entropy

    s, b, h = hidden_states.shape
    if labels.shape != (b, s):
        raise ValueError(f"labels must be [b, s] = [{b}, {s}], got {tuple(labels.shape)}")
    if loss_mask is not None and loss_mask.shape != (b, s):
        raise ValueError(f"loss_mask must be [b, s] = [{b}, {s}], got {tuple(loss_mask.shape)}")
    token_weight = None if loss_mask is None else loss_mask.t().reshape(s * b)
    loss, predictions = linear_cross_entropy(hidden_states.reshape(s * b, h), weight, labels.t().reshape(s * b), token_weight)
    return loss.view(s, b).t().contiguous(), (predictions.view(s, b) if return_predictions else None)
