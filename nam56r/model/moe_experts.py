"""MoE experts on torch's grouped GEMM for Megatron's local backend: a drop-in for ``SequentialMLP``.

Why: the local backend's ``SequentialMLP`` loops over experts in Python (two small GEMMs each), and
Megatron's grouped-GEMM experts need TransformerEngine. ``GroupedMLPExperts`` subclasses ``SequentialMLP``,
so it builds the same ``local_experts`` ModuleList of per-expert ``MLP``s: the same parameters, names,
``state_dict`` keys and ``sharded_state_dict`` (checkpoints move between the two unchanged). Only
``forward`` differs: it stacks the experts' weights and runs ``nam56r_kernels.grouped_mlp``.

Scope: what NAM56R's experts are (TP=1 on the expert group, non-gated, no bias, bf16/fp32, the activation
``config.activation_func``). Anything else raises at construction, naming the setting. ``torch.stack`` copies
the expert weights once per forward (and its backward splits the gradient back onto each parameter, so
Megatron's DDP grad hooks see ordinary ``param.grad``s).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig
from nam56r_kernels.grouped_mlp import grouped_mlp

__all__ = ["GroupedMLPExperts"]


def _unsupported_settings(config: TransformerConfig, expert_tp_size: int) -> list[str]:
    unsupported = {
        f"expert tensor parallel size {expert_tp_size} (needs 1)": expert_tp_size != 1,
        "gated_linear_unit=True (needs non-gated experts)": config.gated_linear_unit,
        "add_bias_linear=True (expert biases are not implemented)": config.add_bias_linear,
        f"fp8={config.fp8!r} (needs None)": config.fp8 is not None,
        f"fp4={config.fp4!r} (needs None)": config.fp4 is not None,
        f"moe_latent_size={config.moe_latent_size} (needs None)": config.moe_latent_size is not None,
        "use_te_activation_func=True (needs config.activation_func)": config.use_te_activation_func,
        "bias_activation_fusion=True (SequentialMLP rejects it for non-gated experts with probs too)": config.bias_activation_fusion,
        "delay_wgrad_compute=True (no separate weight-gradient pass)": config.delay_wgrad_compute,
    }
    return [name for name, bad in unsupported.items() if bad]


class GroupedMLPExperts(SequentialMLP):
    """``SequentialMLP``'s parameters and checkpoint layout, computed with two grouped GEMMs.

    forward(permuted_local_hidden_states [T, H], tokens_per_expert [E] int, permuted_probs [T])
    -> (output [T, H] in the hidden states' dtype, None), as ``SequentialMLP.forward`` returns.
    Tokens are permuted so each local expert's are contiguous; the probs are applied after the
    activation, before fc2 (or on the input with ``moe_apply_probs_on_input``), as ``MLP`` does.
    ``fused_activation`` (``MoEConfig.expert_activation="fused"``) applies GELU and the probs in one Triton pass
    each way (``nam56r_kernels.expert_activation``), with the same rounding steps.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        pg_collection: ProcessGroupCollection | None = None,
        name: str | None = None,
        fused_activation: bool = False,
    ):
        if pg_collection is None:
            raise ValueError("GroupedMLPExperts needs pg_collection (its ep, expt_tp and expt_dp groups), got None")
        unsupported = _unsupported_settings(config, pg_collection.expt_tp.size())
        if unsupported:
            raise ValueError(
                "GroupedMLPExperts supports only NAM56R's expert setup; unsupported: "
                + "; ".join(unsupported)
                + ". Use Megatron's SequentialMLP (or TE's grouped experts) for these."
            )
        if fused_activation and config.activation_func is not torch.nn.functional.gelu:
            raise ValueError(f"GroupedMLPExperts' fused activation is GELU's; config.activation_func is {config.activation_func!r}: "
                             "use moe.expert_activation='eager'")
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        self.fused_activation = fused_activation

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Forward step: all local experts with ``grouped_mlp``; same inputs and return as SequentialMLP's."""
        hidden = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError(f"moe_apply_probs_on_input needs moe_router_topk=1, got {self.config.moe_router_topk}")
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(permuted_local_hidden_states.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = torch.as_tensor(tokens_per_expert)
        self._run_expert_forward_pre_hooks()
        fc1_weight = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])
        fc2_weight = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        output = grouped_mlp(
            hidden,
            fc1_weight,
            fc2_weight,
            tokens_per_expert,
            self.local_experts[0].activation_func,
            per_token_scale=permuted_probs,
            fused_activation=self.fused_activation,
        )
        return output, None

    def _run_expert_forward_pre_hooks(self) -> None:
        """Run the forward pre-hooks of the experts' modules, which SequentialMLP's forward would run and this one
        does not: it reads their weights directly. Megatron's DDP with --overlap-param-gather waits for a module's
        all-gathered parameters in that module's forward pre-hook; at EP > 1 the experts' parameters fill a buffer of
        their own, so without this its all-gathers are never waited on (stale weights, then an assertion when the
        next step dispatches them again)."""
        for module in self.local_experts.modules():
            for hook_id, hook in module._forward_pre_hooks.items():
                if hook_id in module._forward_pre_hooks_with_kwargs:
                    hook(module, (), {})
                else:
                    hook(module, ())
