"""The recipe's settings, each declared once (`nam56r.training.settings`): its type, default, launcher option, help
and, for a plain on/off switch, the Megatron flag it lowers to. Groups: parallel, batch, optimizer, kernel paths,
phases, runtime, logging; `Recompute` is one setting with a parser of its own.

Adding an on/off switch that lowers to one Megatron flag: declare it here with `megatron="--flag"` and test it. The
launcher's option and `--help`, the startup banner, recipe.json, the benchmark rows' settings (`recorded=True`) and
the README's option table follow from the declaration; `Recipe.check` (nam56r.training.recipe_checks) is the place
for a rule about when the switch may be on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from nam56r.model.config import DSAIndexerPath, ExpertActivation, MoEDispatch, MoERouting, Precision, ResidualNorm, RouterGating
from nam56r.training.phases import DsaPhases
from nam56r.training.recall_probe import RecallSchedule
from nam56r.training.settings import setting

BackendChoice = Literal["auto", "te", "local"]
LinearCE = Literal["liger", "chunked", "logits"]


@dataclass(frozen=True)
class Parallel:
    nodes: int = setting(1, cli="--nodes", help="number of nodes")
    gpus_per_node: int = setting(1, cli="--gpus-per-node", help="GPUs per node")
    tp: int = setting(1, help="tensor-parallel size")
    pp: int = setting(1, cli="--pp", help="pipeline-parallel size")
    ep: int = setting(1, cli="--ep", help="expert-parallel size")


@dataclass(frozen=True)
class Batch:
    micro_batch: int = setting(1, cli="--mbs", recorded=True, help="micro-batch size per GPU")
    global_batch: int = setting(8, cli="--gbs", help="global batch size (sequences per step)")
    seq_length: int | None = setting(None, cli="--seq", cli_default="the model preset's", help="sequence length")
    steps: int = setting(300, cli="--steps", help="training steps")


@dataclass(frozen=True)
class Optimizer:
    lr: float = setting(3e-4, cli="--lr", help="peak learning rate")
    min_lr: float = setting(3e-5, help="learning rate at the end of the cosine decay")
    warmup_steps: int = setting(30, cli="--warmup", help="learning-rate warm-up steps (below --steps)")
    weight_decay: float = setting(0.1, help="AdamW weight decay")
    adam_beta1: float = setting(0.9, help="Adam beta1")
    adam_beta2: float = setting(0.95, help="Adam beta2")
    clip_grad: float = setting(1.0, help="gradient-norm clip")
    seed: int = setting(1234, cli="--seed", help="random seed (initialization and data order; another seed makes another run "
                                                 "of one arm)")


# The kernel paths' defaults are the paths docs/bench/kernels.json shows winning at NAM56R's shapes, each measured in
# the same run as the path it replaces; the others stay available by name.
@dataclass(frozen=True)
class KernelPaths:
    precision: Precision = setting("bf16", help="training precision (fp8-tensorwise needs the te backend)")
    backend: BackendChoice = setting("auto", cli="--backend", recorded=True, help="layer backend (auto: TE when installed)")
    # A 1 Full + 2 Shared group runs faster than the same 3 layers computing their own top-k, on either indexer path.
    index_cache: bool = setting(
        True, cli="--index-cache", recorded=True,
        help="IndexCache for the DSA layers: Shared layers reuse the nearest Full layer's top-k")
    # "fused-tilelang-loss" is faster than Megatron's own indexer path over a whole DSA layer; "fused" (the loss in
    # torch) is about level with Megatron's.
    dsa_indexer: DSAIndexerPath = setting(
        "fused-tilelang-loss", cli="--dsa-indexer", recorded=True,
        help="how DSA layers select their top-k and train the indexer: the fused Triton top-k with the sparse loss on the "
             "selected keys computed by Megatron's TileLang loss kernels (fused-tilelang-loss) or in torch (fused), or "
             "Megatron's TileLang indexer and loss (megatron); nam56r.model.dsa_fused_indexer")
    # "chunked" is faster than logits + CE with 1.75 GiB extra; "liger" is slower than logits + CE.
    linear_ce: LinearCE = setting(
        "chunked", cli="--linear-ce", recorded=True,
        help="LM head and MTP heads: our chunked linear cross-entropy through Megatron patch 0016 (chunked; "
             "nam56r.model.linear_cross_entropy), Liger's fused linear cross-entropy through patches 0007/0008 (liger), "
             "or upstream's logits + cross-entropy (logits)")
    # "fused-permute" (one expert-parallel rank only) is faster over a whole MoE layer than Megatron's token dispatcher.
    moe_dispatch: MoEDispatch = setting(
        "fused-permute", cli="--moe-dispatch", recorded=True,
        help="how MoE layers dispatch tokens to their experts: at expert parallel 1, one pass per token without sorts, "
             "atomics or host syncs (fused-permute; nam56r.model.moe_dispatch), or Megatron's all-to-all dispatcher "
             "(megatron, the EP > 1 recipes')")
    # "fused" is faster than "eager" at NAM56R's expert shape. None: "fused" on the local backend; the te backend's
    # grouped experts run TE's own activation ("eager" here).
    expert_activation: ExpertActivation | None = setting(
        None, cli="--expert-activation", recorded=True, cli_default="fused on the local backend, eager on te",
        help="the MoE experts' GELU and router-prob scale on the local backend: one Triton pass each way (fused; "
             "nam56r_kernels.expert_activation) or Megatron's eager ops (eager, and the te backend's, whose grouped "
             "experts run TE's own activation)")
    # "fused" is faster over a whole MoE layer than Megatron's local router GEMM on fp32 copies.
    router_gating: RouterGating = setting(
        "fused", cli="--router-gating", recorded=True,
        help="the MoE router's fp32 logits: from its bf16 input and weight with Triton kernels each way, no fp32 copies "
             "(fused; nam56r_kernels.router_gating), or Megatron's local GEMM on fp32 copies (megatron); both sum in fp32")
    # "fused" is faster over a whole MoE layer than TopKRouter.routing's torch ops.
    moe_routing: MoERouting = setting(
        "fused", cli="--moe-routing", recorded=True,
        help="the MoE router's sigmoid scores, top-k, probs, seq aux loss and expert load: Triton kernels, two launches "
             "forward and one backward (fused; nam56r_kernels.moe_routing), or Megatron's TopKRouter.routing in torch ops "
             "(megatron); the same selection, values to fp32 rounding")
    # "fused" is faster than "torch" at NAM56R's hidden size. None: "fused" on the local backend; the te backend's
    # layers run TE's norm ("torch" here).
    residual_norm: ResidualNorm | None = setting(
        None, cli="--residual-norm", recorded=True, cli_default="fused on the local backend, torch on te",
        help="the transformer layers' input norms (RMSNorm) on the local backend: one Triton pass each way whose backward "
             "also sums the residual's gradient (fused; nam56r.model.residual_norm) or torch's RMSNorm with autograd "
             "adding the residual's gradient (torch, and the te backend's, which runs TE's norm)")


@dataclass(frozen=True)
class Recompute:
    """Activation recompute per block family; all off keeps every activation (the recipes' default)."""

    mamba: bool = False  # our checkpointed Mamba-3 mixer: keeps the mixer's input, recomputes the rest
    moe: bool = False  # Megatron's selective "moe": the whole MoE layer (router, dispatch, experts, shared expert)
    attention: bool = False  # Megatron's selective "core_attn" + "mla_up_proj": MLA and DSA layers, the MTP heads' too

    FAMILIES: ClassVar[tuple[str, ...]] = ("mamba", "moe", "attention")

    @classmethod
    def parse(cls, text: str) -> Recompute:
        """The launcher's spelling: "none", "all", or families joined by commas ("mamba,moe")."""
        names = [n.strip() for n in text.split(",") if n.strip()]
        if names == ["none"]:
            return cls()
        if names == ["all"]:
            return cls(**dict.fromkeys(cls.FAMILIES, True))
        unknown = [n for n in names if n not in cls.FAMILIES]
        if unknown or not names:
            raise ValueError(f"recompute {text!r}: give none, all, or families joined by commas from {', '.join(cls.FAMILIES)}")
        return cls(**dict.fromkeys(names, True))

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(name for name in self.FAMILIES if getattr(self, name))

    def __str__(self) -> str:
        return ",".join(self.families) or "none"

    def megatron_modules(self) -> list[str]:
        """Megatron's `--recompute-modules` for the attention and MoE switches (empty: no selective recompute)."""
        return (["core_attn", "mla_up_proj"] if self.attention else []) + (["moe"] if self.moe else [])


def recompute_argument(text: str) -> Recompute:
    import argparse

    try:
        return Recompute.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class Phases:
    dsa: DsaPhases = DsaPhases()  # dense indexer warm-up for the first N steps, then sparse (nam56r.model.dsa_warmup)
    indexer_recall: RecallSchedule = RecallSchedule()  # log one DSA layer's indexer recall every N steps; 0: off


@dataclass(frozen=True)
class Runtime:
    # The distributed optimizer's gradient reduce-scatter during the backward. The parameter all-gather stays after
    # the optimizer step: --overlap-param-gather is refused (nam56r.training.launcher.flags.REFUSED_FLAGS).
    overlap_dp_comm: bool = setting(
        False, cli="--overlap-dp-comm", megatron="--overlap-grad-reduce", recorded=True,
        help="overlap the distributed optimizer's gradient reduce-scatter with the backward (Megatron's "
             "--overlap-grad-reduce); needs data parallel > 1. Its parameter all-gather stays after the optimizer step: "
             "Megatron's --overlap-param-gather is refused")
    moe_shared_expert_overlap: bool = setting(
        False, cli="--moe-shared-expert-overlap", megatron="--moe-shared-expert-overlap", recorded=True,
        help="run the MoE shared expert on a side stream beside Megatron's all-to-all dispatch and combine (Megatron's "
             "--moe-shared-expert-overlap); needs --moe-dispatch megatron, the EP > 1 recipes'")
    # Off, Megatron writes the optimizer buffers as they lie on each rank: no gather at save time, but a resume at the
    # same model-parallel layout only. Lowered with the distributed optimizer it belongs to (nam56r.training.launcher.flags).
    reshardable_checkpoints: bool = setting(
        False, cli="--reshardable-ckpt",
        help="write the distributed optimizer's checkpoint state per parameter (Megatron's "
             "--dist-ckpt-optim-fully-reshardable), so a checkpoint resumes at another expert-parallel size; each save "
             "gathers the optimizer state on data-parallel rank 0. Off, a checkpoint resumes only at its own "
             "expert-parallel size")
    cuda_graphs: bool = setting(False, cli="--cuda-graphs", help="CUDA graphs (refused at pp=1)")
    compile_mamba_elementwise: bool = setting(False, help="torch.compile Mamba-3's elementwise regions (refused: no faster)")


@dataclass(frozen=True)
class Logging:
    log_interval: int = setting(1, help="steps between log lines")
    eval_interval: int = setting(100, cli="--eval-interval", help="steps between validations")
    eval_iters: int = setting(10, help="validation batches per validation")
    save_interval: int = setting(100, cli="--save-interval", help="steps between checkpoints")
    num_workers: int = setting(2, help="data-loader workers per rank")
