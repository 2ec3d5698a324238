"""Local (no TransformerEngine) stand-ins for the TE modules Megatron's DSA indexer asks for.

Megatron's DSA indexer builds its projections with `parallel_mode="duplicated"` (every tensor
parallel rank holds the whole weight), a mode only TE's `TELinear` implements; Megatron's local
backend has no such linear. `DuplicatedLinear` is that linear in plain torch, with the same
`(output, bias)` return convention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


def parameter_device(config: TransformerConfig) -> torch.device | None:
    """Where Megatron's own layers put new parameters: the current CUDA device, or (with
    use_cpu_initialization) the default device, which a `torch.device("meta")` context sets."""
    return None if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())


class DuplicatedLinear(torch.nn.Module):
    """`y = x W^T`, weight replicated on every tensor-parallel rank (Megatron's "duplicated" mode)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        skip_bias_add: bool,
        skip_weight_param_allocation: bool = False,
        parallel_mode: str = "duplicated",
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: object = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if parallel_mode != "duplicated":
            raise ValueError(f"DuplicatedLinear implements parallel_mode='duplicated' only, got {parallel_mode!r}")
        if bias or skip_weight_param_allocation or is_expert:
            raise ValueError(
                f"DuplicatedLinear supports bias=False, skip_weight_param_allocation=False, is_expert=False; got "
                f"bias={bias}, skip_weight_param_allocation={skip_weight_param_allocation}, is_expert={is_expert}"
            )
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=parameter_device(config)))
        if config.perform_initialization:
            init_method(self.weight)
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class LatentSDPAttention(torch.nn.Module):
    """Causal core attention for MLA on torch's scaled_dot_product_attention.

    MLA's query/key heads (qk_head_dim + rope dim) are wider than its value heads; Megatron's local
    `DotProductAttention` takes one head size only (it rejects MLA's `k_channels`/`v_channels`), so
    without TE the full-MLA layers use this. Input `[s, b, heads, d]` (value `[s, b, heads, d_v]`),
    output `[s, b, heads * d_v]`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: object,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object = None,
    ) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"LatentSDPAttention implements causal self-attention only, got {attn_mask_type}")
        if config.context_parallel_size != 1:
            raise NotImplementedError(
                f"LatentSDPAttention has no context parallelism (context_parallel_size={config.context_parallel_size})"
            )
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: object = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("LatentSDPAttention supports neither packed sequences nor attention bias")
        if query.dim() != 4 or key.shape[:3] != query.shape[:3] or value.shape[:3] != query.shape[:3]:
            raise ValueError(
                f"expected query/key/value [s, b, heads, d] with equal s, b, heads; got {tuple(query.shape)}, "
                f"{tuple(key.shape)}, {tuple(value.shape)}"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
