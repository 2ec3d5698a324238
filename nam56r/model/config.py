"""NAM56R's one configuration: every size the model, the parameter count and the launcher use is
here or derived from here.

The original in-house stack described the model in prose, a recipe file and a launch script that
disagreed (two hidden sizes, a parameter figure quoted for the other width). Here there is one
`ModelConfig` per preset (`nam56r.model.presets`), nested dataclasses per block family, and
`validate()` that rejects inconsistent sizes with the offending value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Literal, get_args

Precision = Literal["bf16", "fp8-tensorwise"]
# How a DSA layer selects its top-k and trains its indexer (DSAConfig.indexer).
DSAIndexerPath = Literal["megatron", "fused", "fused-tilelang-loss"]
DSA_INDEXER_PATHS: tuple[str, ...] = get_args(DSAIndexerPath)
# How a MoE layer's tokens reach its experts (MoEConfig.dispatch).
MoEDispatch = Literal["megatron", "fused-permute"]
MOE_DISPATCH_PATHS: tuple[str, ...] = get_args(MoEDispatch)
# How the routed experts apply their activation and router-prob scale (MoEConfig.expert_activation).
ExpertActivation = Literal["eager", "fused"]
EXPERT_ACTIVATION_PATHS: tuple[str, ...] = get_args(ExpertActivation)
# How a MoE router computes its fp32 logits (MoEConfig.router_gating).
RouterGating = Literal["megatron", "fused"]
ROUTER_GATING_PATHS: tuple[str, ...] = get_args(RouterGating)
# How a MoE router turns its logits into routing probs, the seq aux loss and the expert load (MoEConfig.routing).
MoERouting = Literal["megatron", "fused"]
MOE_ROUTING_PATHS: tuple[str, ...] = get_args(MoERouting)
# How a transformer layer's input norm runs and its residual's gradient is summed (ModelConfig.residual_norm).
ResidualNorm = Literal["torch", "fused"]
RESIDUAL_NORM_PATHS: tuple[str, ...] = get_args(ResidualNorm)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention, shared by the full-MLA and the DSA (sparse MLA) layers."""

    num_heads: int = 32
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_head_dim: int = 64  # the non-positional part of each query/key head
    qk_rope_head_dim: int = 64  # the RoPE part
    v_head_dim: int = 64


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek sparse attention: the lightning indexer and its top-k."""

    indexer_heads: int = 32
    indexer_head_dim: int = 64
    topk: int = 256
    # Indexer inputs are detached in Megatron's DSA, so this only scales the indexer's own KL
    # learning signal; 0 would leave the indexers untrained.
    indexer_loss_coeff: float = 1.0
    # Hadamard rotation of indexer q/k exists for FP8 indexer scores; NAM56R's indexer is bf16 (the
    # original measured its FP8 indexer as a net loss), and the rotation needs fast_hadamard_transform.
    rotate_activation: bool = False
    # Fused TileLang indexer / sparse MLA on GPU builds, with declines made errors (Megatron patch
    # 0004's dsa_strict_fused_paths): the unfused DSA path is never taken silently.
    kernel_backend: Literal["tilelang", "none"] = "tilelang"
    # The indexer's KL target over its top-k keys only. The fused TileLang path has a kernel for
    # this sparse loss and none for the dense one (over all causal keys), which under strict fused
    # paths declines with an error; the dense loss would also cost more than the sparse attention.
    sparse_indexer_loss: bool = True
    # How a DSA layer that computes its top-k selects it and trains its indexer. "megatron": Megatron's
    # DSAttention (with kernel_backend="tilelang", its TileLang indexer writes fp32 logits for every key, then
    # torch.topk, and its TileLang kernels compute the sparse loss). The fused paths select with our Triton
    # scores + exact top-k (nam56r_kernels.dsa_indexer.index_topk_fused), which writes one sequence's fp32
    # [sq, sk] scores at a time, and compute the sparse indexer loss on the selected pairs only
    # (nam56r.model.dsa_fused_indexer): "fused" in torch, "fused-tilelang-loss" on Megatron's TileLang
    # target, KL and indexer-backward kernels. CUDA tensors only, sparse loss only. The sparse MLA is
    # Megatron's on every path. The model's default is Megatron's; the recipes name the path they train with
    # (nam56r.training.recipe).
    indexer: DSAIndexerPath = "megatron"


@dataclass(frozen=True)
class IndexCacheConfig:
    """Cross-layer reuse of the DSA indexer's top-k (IndexCache).

    DSA layers are numbered in order of depth; ordinals `0, share_group, 2*share_group, ...` are
    "Full" (compute the indexer) and the others are "Shared" (reuse the top-k of the nearest
    preceding Full layer). Off in the model's default; the recipes switch it on (nam56r.training.recipe),
    where `nox -s bench -- kernels` measures an IndexCache group faster than the same layers without it.
    """

    enabled: bool = False
    share_group: int = 3


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 16
    topk: int = 4
    expert_ffn: int = 896
    shared_expert_ffn: int = 1024  # one shared expert; 0 means none
    # Non-gated experts (two weight matrices, Megatron's default activation): the original's
    # 4.73B total / 3.03B active split implies it.
    gated: bool = False
    score_function: Literal["sigmoid", "softmax"] = "sigmoid"
    expert_bias: bool = True  # aux-loss-free balancing (DeepSeek-V3)
    aux_loss_coeff: float = 1e-4
    # How it runs, not what it is: "megatron", Megatron's token dispatcher (all-to-all); "fused-permute", one expert
    # parallel rank's dispatch without sorts, atomics or host syncs (nam56r.model.moe_dispatch; EP = 1 only).
    # The model's default is Megatron's; the recipes name the path they train with (nam56r.training.recipe).
    dispatch: MoEDispatch = "megatron"
    # How it runs: "eager", GELU, then the router-prob scale and a cast (Megatron's MLP); "fused", both in one Triton
    # pass each way with the same rounding steps (nam56r_kernels.expert_activation; our grouped experts, local backend).
    expert_activation: ExpertActivation = "eager"
    # How it runs: "megatron", Megatron's local router GEMM (input and weight copied to fp32, an fp32 GEMM each way);
    # "fused", the bf16 operands multiplied into fp32 logits, and both gradients summed in fp32 from exact products, no
    # fp32 copies (nam56r_kernels.router_gating; TransformerEngine's arithmetic). Either way the logits are fp32 sums and
    # the gradients fp32 sums rounded to bf16.
    router_gating: RouterGating = "megatron"
    # How it runs: "megatron", TopKRouter.routing without TransformerEngine (small torch ops, each a host launch while the
    # GPU waits); "fused", the sigmoid scores, top-k, probs, seq aux loss and expert load in two Triton launches forward
    # and one backward (nam56r_kernels.moe_routing; the same selection and values to fp32 rounding). Only the sigmoid
    # score function with the seq aux loss or none is fused.
    routing: MoERouting = "megatron"


@dataclass(frozen=True)
class Mamba3Config:
    """mamba_ssm's Mamba-3 mixer as NAM56R runs it (MIMO, no conv)."""

    mimo: bool = True
    mimo_rank: int = 4
    chunk_size: int = 16
    d_state: int = 128
    head_dim: int = 64
    expand: int = 2
    ngroups: int = 8
    rope_fraction: float = 0.5
    # How it runs, not what it is: recompute the mixer in the backward instead of keeping its activations
    # (`nam56r.model.recompute`; set from the recipe's `Recompute.mamba`).
    recompute: bool = False

    def num_heads(self, hidden_size: int) -> int:
        return self.expand * hidden_size // self.head_dim


@dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction: `depths` extra heads, each a small hybrid stack of `pattern`."""

    depths: int = 2
    pattern: str = "*-"  # one attention layer and one dense MLP per depth
    dense_ffn: int = 21504


@dataclass(frozen=True)
class NgramHashConfig:
    """The n-gram hash embedding added to the token embedding at the model's entrance."""

    enabled: bool = True
    orders: tuple[int, ...] = (2, 3)
    heads: int = 8
    table_size: int = 500_000
    embed_dim: int = 16
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int = 4096
    vocab_size: int = 131072
    seq_length: int = 4096
    # Our layer pattern: `*` attention, `E` MoE, `M` Mamba-3, `-` dense MLP (nam56r.model.pattern).
    pattern_unit: str = "*EME*EME*EMM"
    pattern_repeats: int = 4
    pattern_tail: str = "*EME"
    # The 1st, (1+k)th, (1+2k)th... attention layers are full MLA, the others DSA.
    full_attention_every: int = 4
    mla: MLAConfig = field(default_factory=MLAConfig)
    dsa: DSAConfig = field(default_factory=DSAConfig)
    index_cache: IndexCacheConfig = field(default_factory=IndexCacheConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mamba: Mamba3Config = field(default_factory=Mamba3Config)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    ngram: NgramHashConfig = field(default_factory=NgramHashConfig)
    rope_base: float = 500_000.0
    norm_epsilon: float = 1e-5
    # How it runs, not what it is: the transformer layers' input norms (attention's and the MLP/MoE's, RMSNorm either
    # way). "torch", Megatron's local norm (torch's RMSNorm; autograd adds the residual's gradient in bf16 after its
    # backward); "fused", one Triton pass each way whose backward sums the residual's gradient in, rounded once
    # (nam56r.model.residual_norm; local backend). The model's default is torch's; the recipes name theirs.
    residual_norm: ResidualNorm = "torch"
    precision: Precision = "bf16"
    init_std: float = 0.02

    @property
    def pattern(self) -> str:
        """The main decoder pattern in our symbols (no MTP part)."""
        return self.pattern_unit * self.pattern_repeats + self.pattern_tail

    @property
    def num_layers(self) -> int:
        return len(self.pattern)

    def validate(self) -> ModelConfig:
        """Raise ValueError naming the first inconsistent size; return self so presets can chain it."""
        problems = []
        h = self.hidden_size
        if h % self.mamba.head_dim:
            problems.append(f"hidden_size {h} is not a multiple of mamba.head_dim {self.mamba.head_dim}")
        nheads = self.mamba.num_heads(h)
        if self.mamba.ngroups < 1 or nheads % self.mamba.ngroups:
            problems.append(f"mamba.ngroups {self.mamba.ngroups} does not divide the {nheads} Mamba-3 heads")
        if self.mamba.rope_fraction not in (0.5, 1.0):
            problems.append(f"mamba.rope_fraction {self.mamba.rope_fraction} is not 0.5 or 1.0 (mamba_ssm's Mamba-3 supports those)")
        if self.moe.topk > self.moe.num_experts:
            problems.append(f"moe.topk {self.moe.topk} exceeds moe.num_experts {self.moe.num_experts}")
        if self.dsa.topk < 1:
            problems.append(f"dsa.topk {self.dsa.topk} must be positive")
        if self.dsa.indexer not in DSA_INDEXER_PATHS:
            problems.append(f"dsa.indexer {self.dsa.indexer!r} must be one of {', '.join(map(repr, DSA_INDEXER_PATHS))}")
        elif self.dsa.indexer != "megatron" and not self.dsa.sparse_indexer_loss:
            problems.append(
                f"dsa.indexer {self.dsa.indexer!r} trains the indexer with the sparse loss only (the dense one needs gradients at every "
                "causal key); set dsa.sparse_indexer_loss=True or dsa.indexer='megatron'"
            )
        if self.moe.dispatch not in MOE_DISPATCH_PATHS:
            problems.append(f"moe.dispatch {self.moe.dispatch!r} must be one of {', '.join(map(repr, MOE_DISPATCH_PATHS))}")
        if self.moe.expert_activation not in EXPERT_ACTIVATION_PATHS:
            problems.append(f"moe.expert_activation {self.moe.expert_activation!r} must be one of "
                            f"{', '.join(map(repr, EXPERT_ACTIVATION_PATHS))}")
        elif self.moe.expert_activation == "fused" and self.moe.gated:
            problems.append("moe.expert_activation 'fused' is the non-gated experts' GELU; gated experts need 'eager'")
        if self.moe.router_gating not in ROUTER_GATING_PATHS:
            problems.append(f"moe.router_gating {self.moe.router_gating!r} must be one of {', '.join(map(repr, ROUTER_GATING_PATHS))}")
        if self.moe.routing not in MOE_ROUTING_PATHS:
            problems.append(f"moe.routing {self.moe.routing!r} must be one of {', '.join(map(repr, MOE_ROUTING_PATHS))}")
        if self.residual_norm not in RESIDUAL_NORM_PATHS:
            problems.append(f"residual_norm {self.residual_norm!r} must be one of {', '.join(map(repr, RESIDUAL_NORM_PATHS))}")
        if self.full_attention_every < 1:
            problems.append(f"full_attention_every {self.full_attention_every} must be positive")
        if self.index_cache.share_group < 1:
            problems.append(f"index_cache.share_group {self.index_cache.share_group} must be positive")
        if self.mtp.depths < 0:
            problems.append(f"mtp.depths {self.mtp.depths} must be >= 0")
        if self.ngram.enabled and (not self.ngram.orders or min(self.ngram.orders) < 2):
            problems.append(f"ngram.orders {self.ngram.orders} must be n-gram orders >= 2")
        if self.precision not in ("bf16", "fp8-tensorwise"):
            problems.append(f"precision {self.precision!r} is not 'bf16' or 'fp8-tensorwise'")
        if problems:
            raise ValueError(f"config {self.name!r}: " + "; ".join(problems))
        return self

    def to_dict(self) -> dict:
        """Plain data (JSON-safe) that `from_dict` turns back into an equal config."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelConfig:
        """The inverse of `to_dict`; unknown keys raise (a config written by another version)."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        values = dict(data)
        for name, sub in _NESTED.items():
            if name in values:
                extra = set(values[name]) - {f.name for f in fields(sub)}
                if extra:
                    raise ValueError(f"unknown {sub.__name__} fields {sorted(extra)}")
                values[name] = sub(**{k: tuple(v) if isinstance(v, list) else v for k, v in values[name].items()})
        return cls(**values).validate()


_NESTED: dict[str, type] = {
    "mla": MLAConfig,
    "dsa": DSAConfig,
    "index_cache": IndexCacheConfig,
    "moe": MoEConfig,
    "mamba": Mamba3Config,
    "mtp": MTPConfig,
    "ngram": NgramHashConfig,
}
