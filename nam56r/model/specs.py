"""NAM56R's Megatron layer specs: one HybridStack spec per backend, chosen explicitly.

`te`: TransformerEngine modules (norms, linears, core attention, grouped-GEMM experts), the
production option on users' nodes. `local`: Megatron's own modules, for machines without TE (GPU
nodes without it, CPU tests); its MoE experts are `nam56r.model.moe_experts.GroupedMLPExperts`, two
`torch.nn.functional.grouped_mm` calls with `SequentialMLP`'s parameters and checkpoint layout, in
place of Megatron's `SequentialMLP` (a Python loop of per-expert GEMMs). `resolve_backend("auto")` picks
`te` when `transformer_engine` imports and `local` otherwise, and says which once; there is no
quiet switch after that.

Every layer family is NAM56R's: Mamba-3 through `Mamba3Mixer`, full MLA (also in Megatron's `*`
slot, which only the MTP heads use), DSA as absorbed MLA with the lightning indexer (Megatron's or
the fused top-k, `DSAConfig.indexer`) and IndexCache, MoE with one shared expert, and the MTP heads' dense MLP.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
    AbsorbedMLASelfAttentionSubmodules,
)
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer, DSAIndexerSubmodules, DSAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer, TransformerLayerSubmodules
from nam56r_kernels.index_cache import IndexCachePlan, TopkCache

from nam56r.model.backend import Backend, resolve_backend  # noqa: F401 - resolve_backend is part of this module's API
from nam56r.model.config import ExpertActivation, ModelConfig, ResidualNorm
from nam56r.model.dsa_index_cache import IndexCacheDSAttention
from nam56r.model.local_layers import DuplicatedLinear, LatentSDPAttention
from nam56r.model.mamba3_mixer import Mamba3Mixer
from nam56r.model.moe_dispatch import DispatchMoELayer
from nam56r.model.moe_experts import GroupedMLPExperts
from nam56r.model.residual_norm import ResidualRMSNorm

# The routed experts of a MoE layer: the backend's grouped experts (ours on `local`, TE's on `te`), or
# Megatron's per-expert `SequentialMLP` on the backend's linears (the baseline the MoE layer bench measures).
MoEExperts = Literal["grouped", "sequential"]
MOE_EXPERTS: tuple[MoEExperts, ...] = ("grouped", "sequential")


class _BackendModules:
    """The module classes of one backend."""

    def __init__(self, backend: Backend, expert_activation: ExpertActivation = "eager", residual_norm: ResidualNorm = "torch") -> None:
        if expert_activation != "eager" and backend != "local":
            raise ValueError(f"moe.expert_activation {expert_activation!r} runs in our grouped experts on the local backend; "
                             f"backend {backend!r} has its own experts: use expert_activation='eager'")
        if residual_norm != "torch" and backend != "local":
            raise ValueError(f"residual_norm {residual_norm!r} stands in for the local backend's torch norm; backend {backend!r} "
                             "has its own: use residual_norm='torch'")
        if backend == "te":
            from megatron.core.extensions.transformer_engine import (
                TEColumnParallelLinear,
                TEDotProductAttention,
                TELinear,
                TENorm,
                TERowParallelLinear,
            )
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            self.norm, self.column, self.row = TENorm, TEColumnParallelLinear, TERowParallelLinear
            self.down_proj, self.duplicated, self.core_attention = TELinear, TELinear, TEDotProductAttention
            self.provider, self.grouped_gemm = TESpecProvider(), True
        else:
            self.norm, self.column, self.row = WrappedTorchNorm, ColumnParallelLinear, RowParallelLinear
            self.down_proj, self.duplicated, self.core_attention = ColumnParallelLinear, DuplicatedLinear, LatentSDPAttention
            self.provider, self.grouped_gemm = _LocalGroupedExpertsProvider(fused_activation=expert_activation == "fused"), True
        # A transformer layer's input norm (attention's input_layernorm, the MLP/MoE's pre_mlp_layernorm).
        self.input_norm = ResidualRMSNorm if residual_norm == "fused" else self.norm


class _LocalGroupedExpertsProvider(LocalSpecProvider):
    """Megatron's local modules, with grouped-GEMM experts that need no TransformerEngine."""

    def __init__(self, fused_activation: bool = False) -> None:
        super().__init__()
        self.fused_activation = fused_activation

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool):
        if not moe_use_grouped_gemm:
            return super().grouped_mlp_modules(moe_use_grouped_gemm)
        sequential = super().grouped_mlp_modules(False)  # SequentialMLP with the local linears and activation
        return partial(GroupedMLPExperts, *sequential.args, **sequential.keywords, fused_activation=self.fused_activation)


def _attention_layer(modules: _BackendModules, attention: type, submodules: type, core_attention: object) -> ModuleSpec:
    """A layer of multi-latent `attention` (Megatron's MLA or its absorbed form, which take the same projections and
    norms) around `core_attention`."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=modules.input_norm,
            self_attention=ModuleSpec(
                module=attention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=submodules(
                    linear_q_proj=modules.column,
                    linear_q_down_proj=modules.down_proj,
                    linear_q_up_proj=modules.column,
                    linear_kv_down_proj=modules.down_proj,
                    linear_kv_up_proj=modules.column,
                    core_attention=core_attention,
                    linear_proj=modules.row,
                    q_layernorm=modules.norm,
                    kv_layernorm=modules.norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )


def _mla_layer(modules: _BackendModules) -> ModuleSpec:
    return _attention_layer(modules, MLASelfAttention, MLASelfAttentionSubmodules, modules.core_attention)


def _dsa_layer(modules: _BackendModules, config: ModelConfig, plan: IndexCachePlan | None, cache: TopkCache | None) -> ModuleSpec:
    # DSA layers have no TE core attention (Megatron's DSAttention is local either way).
    core_attention = ModuleSpec(
        module=IndexCacheDSAttention,
        params={"plan": plan, "cache": cache, "indexer": config.dsa.indexer},
        submodules=DSAttentionSubmodules(
            indexer=ModuleSpec(
                module=DSAIndexer,
                submodules=DSAIndexerSubmodules(
                    linear_wq_b=modules.duplicated,
                    linear_wk=modules.duplicated,
                    k_norm=modules.norm,
                    linear_weights_proj=modules.duplicated,
                ),
            )
        ),
    )
    return _attention_layer(modules, AbsorbedMLASelfAttention, AbsorbedMLASelfAttentionSubmodules, core_attention)


def moe_layer_spec(config: ModelConfig, backend: Backend, experts: MoEExperts = "grouped") -> ModuleSpec:
    """NAM56R's MoE layer (pre-MLP norm, Megatron's MoELayer: router, token dispatcher, routed experts, shared
    expert; residual add) on `backend`, with `experts` as its routed experts."""
    if experts not in MOE_EXPERTS:
        raise ValueError(f"experts must be one of {MOE_EXPERTS}, got {experts!r}")
    modules = _BackendModules(backend, config.moe.expert_activation, config.residual_norm)
    moe = get_moe_module_spec_for_backend(
        backend=modules.provider, num_experts=config.moe.num_experts, moe_grouped_gemm=modules.grouped_gemm and experts == "grouped"
    )
    # Megatron's builder: partial(MoELayer, submodules=...); ours is that MoELayer with MoEConfig.dispatch's dispatcher.
    moe = partial(DispatchMoELayer, *moe.args, **moe.keywords, dispatch=config.moe.dispatch,
                  router_gating=config.moe.router_gating, routing=config.moe.routing)
    return ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(pre_mlp_layernorm=modules.input_norm, mlp=moe, mlp_bda=get_bias_dropout_add),
    )


def hybrid_stack_spec(
    config: ModelConfig, backend: Backend, *, index_cache_plan: IndexCachePlan | None = None, topk_cache: TopkCache | None = None
) -> ModuleSpec:
    """The HybridStack spec for `config` on `backend` (IndexCache wired in when a plan is given)."""
    modules = _BackendModules(backend, config.moe.expert_activation, config.residual_norm)
    mla = _mla_layer(modules)
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=modules.norm,
                    mixer=ModuleSpec(module=Mamba3Mixer, params={"mamba": config.mamba}),
                    mamba_bda=get_bias_dropout_add,
                ),
            ),
            attention_layer=mla,  # Megatron's `*` slot: only the MTP heads use it (nam56r.model.pattern)
            mla_layer=mla,
            dsa_layer=_dsa_layer(modules, config, index_cache_plan, topk_cache),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=modules.input_norm,
                    mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=modules.column, linear_fc2=modules.row)),
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
            final_norm=modules.norm,  # Megatron patch 0009 (HybridStack's final norm from the spec)
            moe_layer=moe_layer_spec(config, backend),
            mtp_block_spec=ModuleSpec(
                module=MultiTokenPredictionBlock,
                submodules=MultiTokenPredictionBlockSubmodules(
                    layer_specs=[
                        ModuleSpec(
                            module=MultiTokenPredictionLayer,
                            submodules=MultiTokenPredictionLayerSubmodules(
                                enorm=modules.norm,
                                hnorm=modules.norm,
                                eh_proj=modules.column,
                                mtp_model_layer=None,
                                layer_norm=modules.norm,
                            ),
                        )
                    ]
                ),
            ),
        ),
    )
