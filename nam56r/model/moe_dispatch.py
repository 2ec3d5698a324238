"""MoE token dispatch for one expert-parallel rank without sorts, atomics or host syncs (`MoEConfig.dispatch`).

Why: at expert and tensor parallel 1 (the proxy and every one-GPU run), Megatron's all-to-all dispatcher without
TransformerEngine argsorts the routing map and `index_select`s the tokens, copies all of them once more to
"sort" them by local expert (the identity at EP=1, `sort_chunks_by_idxs`) and once more back, syncs the token
counts to the host, and sums the expert outputs into the tokens with bf16 `scatter_add` atomics; the backward
mirrors each step. `FusedPermuteDispatcher` keeps one table of each (token, expert) pair's row in expert order
(`nam56r_kernels.moe_permute`) and copies or sums each token's rows in one pass, in fp32: the permuted tokens and
probs are Megatron's, in Megatron's order. The combine sums each token's rows and the shared expert's output in one
pass, so it differs from Megatron's (sum, round, add the shared output, round) only by rounding once. The token
counts stay on the GPU, which the grouped experts (`nam56r.model.moe_experts.GroupedMLPExperts`) take.

`DispatchMoELayer` is Megatron's MoELayer with this dispatcher when `MoEConfig.dispatch="fused-permute"`, and
unchanged with "megatron"; with `MoEConfig.router_gating="fused"` its router is `FusedGatingRouter`. The fused
dispatcher refuses what it does not cover (expert or tensor parallel above
1, token dropping, padding for quantization, shared-expert overlap, Megatron's own fused permute) when built.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from nam56r_kernels.moe_permute import permute_tokens, routing_table, unpermute_tokens
from nam56r_kernels.router_gating import router_gating

from nam56r.model.config import MOE_DISPATCH_PATHS, ROUTER_GATING_PATHS, MoEDispatch, RouterGating


class FusedGatingRouter(TopKRouter):
    """Megatron's TopKRouter whose gating GEMM is `nam56r_kernels.router_gating`: fp32 logits from the bf16 input and
    weight, as TransformerEngine computes them, where Megatron's local path copies both to fp32 first. Routing, the aux
    loss and the expert bias are TopKRouter's."""

    @classmethod
    def adopt(cls, router: torch.nn.Module) -> FusedGatingRouter:
        """`router` (a TopKRouter, its parameters and buffers kept) as a FusedGatingRouter; raises for what the fused
        gating does not compute (another router class, a router bias, router dtypes other than fp32)."""
        unsupported = {
            f"router class {type(router).__name__} (needs TopKRouter)": type(router) is not TopKRouter,
            "a router bias": getattr(router, "bias", None) is not None,
            f"moe_router_dtype={router.config.moe_router_dtype!r} (needs 'fp32')": router.config.moe_router_dtype != "fp32",
        }
        if problems := [name for name, bad in unsupported.items() if bad]:
            raise ValueError("MoEConfig.router_gating='fused' does not support " + "; ".join(problems)
                             + "; use MoEConfig.router_gating='megatron'")
        router.__class__ = cls
        return router

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        if self.weight.device.type == "cpu":  # as TopKRouter.gating: a CPU-initialised router moves on first use
            self.weight.data = self.weight.data.to(device=torch.cuda.current_device())
        return router_gating(input, self.weight)


class FusedPermuteDispatcher(MoETokenDispatcher):
    """Megatron's dispatcher contract at EP = TP = 1: dispatch_preprocess -> token_dispatch -> dispatch_postprocess
    -> experts -> combine_preprocess -> token_combine -> combine_postprocess, with no communication.

    dispatch_postprocess returns (tokens permuted by expert [T*topk, H], tokens per expert int64 [E] on the tokens'
    device, probs in the same order [T*topk]); combine_preprocess takes the experts' output in that order and
    returns the tokens' [T, H]."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        unsupported = {
            f"expert parallel size {self.ep_size} (needs 1)": self.ep_size != 1,
            f"expert tensor parallel size {self.tp_size} (needs 1)": self.tp_size != 1,
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (token dropping)": (
                config.moe_expert_capacity_factor is not None),
            "moe_router_padding_for_quantization=True": config.moe_router_padding_for_quantization,
            "moe_shared_expert_overlap=True": config.moe_shared_expert_overlap,
            "moe_permute_fusion=True (TransformerEngine's fused permute)": config.moe_permute_fusion,
        }
        if problems := [name for name, bad in unsupported.items() if bad]:
            raise ValueError("MoEConfig.dispatch='fused-permute' does not support " + "; ".join(problems)
                             + "; use MoEConfig.dispatch='megatron'")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.topk = config.moe_router_topk
        # The shared expert's output, summed into the tokens by the combine (DispatchMoELayer.shared_experts_compute).
        self.combine_addend: torch.Tensor | None = None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        if routing_map.dtype != torch.bool or routing_map.shape != probs.shape:
            raise ValueError(f"routing_map must be bool and shaped as probs {tuple(probs.shape)}, got {routing_map.dtype} "
                             f"{tuple(routing_map.shape)}")
        self.routing_map = routing_map
        return hidden_states.view(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        num_rows = hidden_states.shape[0] * self.topk
        # Dropless routing selects exactly top-k experts per token, so the rows cover [0, num_rows) once; routing_table
        # checks that on the device, without a host sync.
        self.rows, tokens_per_expert, permuted_probs = routing_table(self.routing_map, probs, num_rows)
        return permute_tokens(hidden_states, self.rows, num_rows), tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        addend, self.combine_addend = self.combine_addend, None
        return unpermute_tokens(hidden_states, self.rows, None if addend is None else addend.view(-1, hidden_states.shape[-1]))

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.rows = self.routing_map = None
        return hidden_states.view(self.hidden_shape)


class DispatchMoELayer(MoELayer):
    """Megatron's MoELayer whose token dispatcher is `FusedPermuteDispatcher` with `dispatch="fused-permute"`
    (Megatron's own, from the config's moe_token_dispatcher_type, with "megatron")."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer: bool = False,
                 name: str | None = None, dispatch: MoEDispatch = "megatron", router_gating: RouterGating = "megatron") -> None:
        if dispatch not in MOE_DISPATCH_PATHS:
            raise ValueError(f"dispatch must be one of {MOE_DISPATCH_PATHS}, got {dispatch!r}")
        if router_gating not in ROUTER_GATING_PATHS:
            raise ValueError(f"router_gating must be one of {ROUTER_GATING_PATHS}, got {router_gating!r}")
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer,
                         name=name)
        self.dispatch_path: MoEDispatch = dispatch
        if dispatch == "fused-permute":
            if not isinstance(self.experts, SequentialMLP):  # Megatron's loop, or our GroupedMLPExperts built on it
                raise ValueError(f"MoEConfig.dispatch='fused-permute' hands its experts the token counts on the GPU, which "
                                 f"{type(self.experts).__name__} is not built for; use the local backend's grouped experts or "
                                 "MoEConfig.dispatch='megatron'")
            self.token_dispatcher = FusedPermuteDispatcher(self.num_local_experts, self.local_expert_indices, self.config,
                                                           pg_collection=pg_collection)
        if router_gating == "fused":
            FusedGatingRouter.adopt(self.router)

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        """Megatron's shared expert; on the fused-permute path its output goes to the combine, which sums it into the
        tokens with their routed rows (one pass, one rounding), instead of a separate add."""
        shared_output = super().shared_experts_compute(hidden_states)
        if shared_output is None or self.dispatch_path != "fused-permute":
            return shared_output
        self.token_dispatcher.combine_addend = shared_output
        return None
