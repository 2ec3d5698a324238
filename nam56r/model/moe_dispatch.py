"""MoE token dispatch for one expert-parallel rank without sorts, atomics or host syncs (`MoEConfig.dispatch`).

Why: at expert and tensor parallel 1 (the proxy and every one-GPU run), Megatron's all-to-all dispatcher without
TransformerEngine argsorts the routing map and `index_select`s the tokens, copies all of them once more to
"sort" them by local expert (the identity at EP=1, `sort_chunks_by_idxs`) and once more back, syncs the token
counts to the host, and sums the expert outputs into the tokens with bf16 `scatter_add` atomics; the backward
mirrors each step. `FusedPermuteDispatcher` keeps one table of each (token, expert) pair's row in expert order
(`nam56r_kernels.moe_permute`) and copies or sums each token's rows in one pass, in fp32: the permuted tokens and
probs are Megatron's, in Megatron's order. The combine sums each token's rows and the shared expert's output in one
pass, so it differs from Megatron's (sum, round, add the shared output, round) only by rounding once; in the backward
the layer input's gradient is likewise one pass over the permuted rows' gradient and the router's and shared expert's
input gradients (`moe_permute.fan_out`), where autograd would sum the rows and add the other two in bf16. The token
counts stay on the GPU, which the grouped experts (`nam56r.model.moe_experts.GroupedMLPExperts`) take.

`DispatchMoELayer` is Megatron's MoELayer with this dispatcher when `MoEConfig.dispatch="fused-permute"`, and
unchanged with "megatron"; with `MoEConfig.router_gating` or `MoEConfig.routing` "fused" its router is `FusedRouter`. The fused
dispatcher refuses what it does not cover (expert or tensor parallel above
1, token dropping, padding for quantization, shared-expert overlap, Megatron's own fused permute) when built.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from nam56r_kernels.moe_permute import RowsGradient, fan_out, permute_tokens, routing_table, unpermute_tokens
from nam56r_kernels.moe_routing import sigmoid_topk_routing
from nam56r_kernels.router_gating import router_gating

from nam56r.model.config import (
    MOE_DISPATCH_PATHS,
    MOE_ROUTING_PATHS,
    ROUTER_GATING_PATHS,
    MoEDispatch,
    MoERouting,
    RouterGating,
)


class FusedRouter(TopKRouter):
    """Megatron's TopKRouter with either or both of its stages on our kernels, its parameters, buffers and state-dict
    keys unchanged:

    - gating (`MoEConfig.router_gating="fused"`): `nam56r_kernels.router_gating`, fp32 logits from the bf16 input and
      weight, as TransformerEngine computes them, where Megatron's local path copies both to fp32 first;
    - routing (`MoEConfig.routing="fused"`): `nam56r_kernels.moe_routing`, the sigmoid scores, top-k probs and map, the
      seq aux loss and the expert load in two Triton launches, where TopKRouter.routing runs dozens of small torch ops. The
      aux loss is attached and logged by TopKRouter's own `attach_and_log_load_balancing_loss`, and the expert load
      lands in `local_tokens_per_expert` as `_apply_expert_bias` adds it.

    A stage that is not fused is TopKRouter's."""

    fused_gating: bool
    fused_routing: bool

    @classmethod
    def adopt(cls, router: torch.nn.Module, gating: RouterGating, routing: MoERouting) -> FusedRouter:
        """`router` (a TopKRouter) as a FusedRouter running the stages named "fused"; raises for what they do not
        compute, naming the Megatron setting and the path that computes it."""
        if type(router) is not TopKRouter:
            raise ValueError(f"MoEConfig.router_gating/routing 'fused' need Megatron's TopKRouter, got {type(router).__name__}")
        config = router.config
        unsupported = {}
        if gating == "fused":
            unsupported.update({
                ("router_gating", "a router bias"): getattr(router, "bias", None) is not None,
                ("router_gating", f"moe_router_dtype={config.moe_router_dtype!r} (needs 'fp32')"): config.moe_router_dtype != "fp32",
            })
        if routing == "fused":
            other_aux = [kind for kind in ("aux_loss", "global_aux_loss") if router.get_aux_loss_coeff(kind) > 0]
            unsupported.update({
                ("routing", f"moe_router_score_function={router.score_function!r} (needs 'sigmoid')"): router.score_function != "sigmoid",
                ("routing", f"moe_router_load_balancing_type={router.routing_type!r}"): (
                    router.routing_type in ("sinkhorn", "quantile_balancing") or bool(other_aux)),
                ("routing", "moe_z_loss_coeff"): config.moe_z_loss_coeff is not None,
                ("routing", "moe_router_num_groups/moe_router_group_topk"): bool(config.moe_router_group_topk),
                ("routing", "moe_expert_capacity_factor (token dropping)"): config.moe_expert_capacity_factor is not None,
                ("routing", "moe_enable_routing_replay"): router.router_replay is not None,
                ("routing", "moe_router_fusion=True (TransformerEngine's fused router)"): config.moe_router_fusion,
                ("routing", f"tensor x context parallel size {router.tp_cp_group.size()} (the seq aux loss's token counts "
                            "are summed across that group; needs 1)"): router.tp_cp_group.size() != 1,
            })
        if problems := [(stage, name) for (stage, name), bad in unsupported.items() if bad]:
            raise ValueError("; ".join(f"MoEConfig.{stage}='fused' does not support {name}; use MoEConfig.{stage}='megatron'"
                                       for stage, name in problems))
        router.__class__ = cls
        router.fused_gating, router.fused_routing = gating == "fused", routing == "fused"
        return router

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        if not self.fused_gating:
            return super().gating(input)
        if self.weight.device.type == "cpu":  # as TopKRouter.gating: a CPU-initialised router moves on first use
            self.weight.data = self.weight.data.to(device=torch.cuda.current_device())
        return router_gating(input, self.weight)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if not self.fused_routing:
            return super().routing(logits, padding_mask=padding_mask)
        if padding_mask is not None:
            raise ValueError("MoEConfig.routing='fused' does not take a padding mask; use MoEConfig.routing='megatron'")
        seq_length, batch = logits.shape[:2]
        coeff = 0.0
        if self.training and torch.is_grad_enabled():
            coeff = self.get_aux_loss_coeff("seq_aux_loss")
        probs, routing_map, aux_loss, tokens_per_expert = sigmoid_topk_routing(
            logits.reshape(-1, self.config.num_moe_experts), self.topk, expert_bias=self.expert_bias,
            scaling_factor=self.config.moe_router_topk_scaling_factor, seq_aux_coeff=coeff, seq_aux_batch=batch)
        if aux_loss is not None:
            # As TopKRouter._apply_seq_aux_loss: the loss is per sequence, so the token count is seq_length x batch.
            probs = self.attach_and_log_load_balancing_loss(probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group,
                                                            valid_token_count=seq_length * batch)
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += tokens_per_expert
        return probs, routing_map


class FusedPermuteDispatcher(MoETokenDispatcher):
    """Megatron's dispatcher contract at EP = TP = 1: dispatch_preprocess -> token_dispatch -> dispatch_postprocess
    -> experts -> combine_preprocess -> token_combine -> combine_postprocess, with no communication.

    dispatch_postprocess returns (tokens permuted by expert [T*topk, H], tokens per expert int64 [E] on the tokens'
    device, probs in the same order [T*topk]); combine_preprocess takes the experts' output in that order and
    returns the tokens' [T, H].

    In training, `fan_out` gives the layer's router and shared expert aliases of its input and keeps a third for the
    permute, so the backward sums the three uses' gradients into the input's in one pass (`moe_permute.fan_out`)."""

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
            f"moe_latent_size={config.moe_latent_size} (the permute reads the layer input itself)": config.moe_latent_size is not None,
            "overlap_dispatch_backward_with_experts_wgrad=True": config.overlap_dispatch_backward_with_experts_wgrad,
        }
        if problems := [name for name, bad in unsupported.items() if bad]:
            raise ValueError("MoEConfig.dispatch='fused-permute' does not support " + "; ".join(problems)
                             + "; use MoEConfig.dispatch='megatron'")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.topk = config.moe_router_topk
        # The shared expert's output, summed into the tokens by the combine (DispatchMoELayer.shared_experts_compute).
        self.combine_addend: torch.Tensor | None = None
        # The layer input fanned out by `fan_out`, its aliases by use, and where the permute leaves its rows' gradient.
        self._fanned: tuple[torch.Tensor, dict[str, torch.Tensor], RowsGradient] | None = None

    def fan_out(self, hidden_states: torch.Tensor) -> None:
        """Start of a layer forward: with autograd recording, split `hidden_states` [..., H] into one alias per use
        (router, shared expert, permute), which `use` hands out; the permute's backward leaves its rows' gradient for the
        fan-out's, which sums the three in one pass."""
        self._fanned = None
        if not (torch.is_grad_enabled() and hidden_states.requires_grad):
            return
        tokens = hidden_states.view(-1, hidden_states.shape[-1])
        aliases, sink = fan_out(tokens, 3)
        self._fanned = (hidden_states, dict(zip(("router", "shared", "permute"), aliases, strict=True)), sink)

    def use(self, hidden_states: torch.Tensor, reader: str) -> torch.Tensor:
        """`hidden_states` as `reader` ("router", "shared" or "permute") reads it: fan_out's alias in its shape ("permute":
        [T, H]), or itself when this forward does not record gradients."""
        if self._fanned is None:
            return hidden_states if reader != "permute" else hidden_states.view(-1, hidden_states.shape[-1])
        source, aliases, _ = self._fanned
        if hidden_states is not source:
            raise RuntimeError(f"FusedPermuteDispatcher: the MoE layer's {reader} reads another tensor than the layer input "
                               "fanned out at the start of this forward; MoEConfig.dispatch='fused-permute' expects Megatron's "
                               "MoELayer order (shared expert, router, dispatch on the same input)")
        return aliases[reader] if reader == "permute" else aliases[reader].view(source.shape)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        if routing_map.dtype != torch.bool or routing_map.shape != probs.shape:
            raise ValueError(f"routing_map must be bool and shaped as probs {tuple(probs.shape)}, got {routing_map.dtype} "
                             f"{tuple(routing_map.shape)}")
        self.routing_map = routing_map
        return self.use(hidden_states, "permute"), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        num_rows = hidden_states.shape[0] * self.topk
        # Dropless routing selects exactly top-k experts per token, so the rows cover [0, num_rows) once; routing_table
        # checks that on the device, without a host sync.
        self.rows, tokens_per_expert, permuted_probs = routing_table(self.routing_map, probs, num_rows)
        sink = self._fanned[2] if self._fanned is not None else None
        return permute_tokens(hidden_states, self.rows, num_rows, rows_gradient=sink), tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        addend, self.combine_addend = self.combine_addend, None
        return unpermute_tokens(hidden_states, self.rows, None if addend is None else addend.view(-1, hidden_states.shape[-1]))

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.rows = self.routing_map = self._fanned = None
        return hidden_states.view(self.hidden_shape)


class DispatchMoELayer(MoELayer):
    """Megatron's MoELayer whose token dispatcher is `FusedPermuteDispatcher` with `dispatch="fused-permute"`
    (Megatron's own, from the config's moe_token_dispatcher_type, with "megatron")."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer: bool = False,
                 name: str | None = None, dispatch: MoEDispatch = "megatron", router_gating: RouterGating = "megatron",
                 routing: MoERouting = "megatron") -> None:
        if dispatch not in MOE_DISPATCH_PATHS:
            raise ValueError(f"dispatch must be one of {MOE_DISPATCH_PATHS}, got {dispatch!r}")
        if router_gating not in ROUTER_GATING_PATHS:
            raise ValueError(f"router_gating must be one of {ROUTER_GATING_PATHS}, got {router_gating!r}")
        if routing not in MOE_ROUTING_PATHS:
            raise ValueError(f"routing must be one of {MOE_ROUTING_PATHS}, got {routing!r}")
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
        if "fused" in (router_gating, routing):
            FusedRouter.adopt(self.router, gating=router_gating, routing=routing)

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        """Megatron's shared expert, the first reader of the layer input in MoELayer.forward; on the fused-permute path
        the input is fanned out here (`FusedPermuteDispatcher.fan_out`), and the shared output goes to the combine, which
        sums it into the tokens with their routed rows (one pass, one rounding), instead of a separate add."""
        if self.dispatch_path != "fused-permute":
            return super().shared_experts_compute(hidden_states)
        self.token_dispatcher.fan_out(hidden_states)
        shared_output = super().shared_experts_compute(self.token_dispatcher.use(hidden_states, "shared"))
        if shared_output is None:
            return shared_output
        self.token_dispatcher.combine_addend = shared_output
        return None

    def route(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if self.dispatch_path == "fused-permute":
            hidden_states = self.token_dispatcher.use(hidden_states, "router")
        return super().route(hidden_states, padding_mask)
