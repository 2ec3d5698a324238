"""Training recipes: one dataclass per run shape, named presets per machine shape.

A `Recipe` says what to train (a model preset), on what (nodes x GPUs, TP/PP/EP), how (batch,
steps, optimizer, precision, runtime switches) and where results go. It holds nothing
host-specific: no paths to home directories, no host names. `nam56r.training.flags` lowers it to
Megatron's own training flags; `nam56r.training.train` launches it.

A recipe names its DSA phases (`nam56r.training.phases`): a dense indexer warm-up for the first
`dsa_phases.dense_warmup_steps` steps, then sparse attention; the switch happens inside one run, at
Megatron's step number, so a resumed run continues in the right phase.

Runtime policy is checked here, not applied silently elsewhere: `check()` refuses combinations the
original team found broken (CUDA graphs at PP=1: TE's graph pool took 39.5 GiB and OOMed the
production topology) instead of quietly turning a switch off, and model shapes the fused kernels
refuse (`nam56r.model.fused_constraints`) before anything launches.

`Recompute` switches activation recompute per block family. Attention and MoE lower to Megatron's selective
recompute (`nam56r.training.flags`); Megatron has no hook inside a Mamba layer, so the Mamba-3 switch reaches
the model config and our checkpointed mixer (`nam56r.model.recompute`). Megatron's full recompute checkpoints
whole layers of every family at once, so it is no family switch: a run that passes it after `--` keeps the
family switches off (the launcher refuses the mix).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import ClassVar, Literal, get_args

from nam56r.model.config import (
    DSAIndexerPath,
    ExpertActivation,
    ModelConfig,
    MoEDispatch,
    MoERouting,
    Precision,
    ResidualNorm,
    RouterGating,
)
from nam56r.model.presets import PRESETS, get_preset
from nam56r.training.phases import DsaPhases
from nam56r.training.recall_probe import RecallSchedule

BackendChoice = Literal["auto", "te", "local"]
LinearCE = Literal["liger", "chunked", "logits"]


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


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str  # a model preset name (nam56r.model.presets)
    description: str = ""
    # Machine shape and parallelism
    nodes: int = 1
    gpus_per_node: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # Batch and schedule
    micro_batch: int = 1
    global_batch: int = 8
    seq_length: int | None = None  # None: the model preset's
    steps: int = 300
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 30
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    seed: int = 1234
    # Numerics and kernels
    precision: Precision = "bf16"
    backend: BackendChoice = "auto"
    # The kernel paths below are the defaults docs/bench/kernels.json shows winning at NAM56R's shapes, each
    # measured in the same run as the path it replaces; the others stay available by name.
    # IndexCache (DSA layers reuse the nearest Full layer's top-k): a 1 Full + 2 Shared group runs faster than
    # the same 3 layers computing their own top-k, on either indexer path.
    index_cache: bool = True
    # DSAConfig.indexer: "fused-tilelang-loss" (the fused top-k; its sparse loss on Megatron's TileLang target, KL
    # and indexer-backward kernels) is faster than Megatron's own indexer path over a whole DSA layer; "fused"
    # (the loss in torch) is about level with Megatron's and slower than "fused-tilelang-loss"; "megatron" is
    # upstream's.
    dsa_indexer: DSAIndexerPath = "fused-tilelang-loss"
    # LM head and MTP heads: "chunked", our chunked linear CE (nam56r.model.linear_cross_entropy, through patch
    # 0016), faster than logits + CE with 1.75 GiB extra; "liger", Liger's fused linear CE (Megatron patches
    # 0007/0008), slower than logits + CE; "logits", upstream's logits + CE.
    linear_ce: LinearCE = "chunked"
    # MoEConfig.dispatch: "fused-permute" (nam56r.model.moe_dispatch, one expert-parallel rank only) is faster over
    # a whole MoE layer than Megatron's token dispatcher, "megatron", which recipes with ep > 1 name.
    moe_dispatch: MoEDispatch = "fused-permute"
    # MoEConfig.expert_activation of the local backend's grouped experts: "fused" (GELU and the router-prob scale in
    # one Triton pass each way, nam56r_kernels.expert_activation) is faster than "eager" at NAM56R's expert shape.
    # None: "fused" on the local backend; the te backend's grouped experts run TE's own activation ("eager" here).
    expert_activation: ExpertActivation | None = None
    # MoEConfig.router_gating: "fused" (the router's fp32 logits from its bf16 operands, nam56r_kernels.router_gating)
    # is faster over a whole MoE layer than "megatron" (Megatron's local router GEMM, its operands copied to fp32).
    router_gating: RouterGating = "fused"
    # MoEConfig.routing: "fused" (scores, top-k, seq aux loss and expert load in Triton, nam56r_kernels.moe_routing) is
    # faster over a whole MoE layer than "megatron" (TopKRouter.routing's torch ops).
    moe_routing: MoERouting = "fused"
    # ModelConfig.residual_norm of the local backend's transformer layers: "fused" (the input norm and the residual's
    # gradient in one Triton pass each way, nam56r.model.residual_norm) is faster than "torch" at NAM56R's hidden size.
    # None: "fused" on the local backend; the te backend's layers run TE's norm ("torch" here).
    residual_norm: ResidualNorm | None = None
    # DSA: dense indexer warm-up for the first N steps, then sparse (nam56r.model.dsa_warmup)
    dsa_phases: DsaPhases = field(default_factory=DsaPhases)
    # DSA: log one layer's indexer recall against dense attention every N steps (nam56r.training.recall_probe); 0: off
    indexer_recall: RecallSchedule = field(default_factory=RecallSchedule)
    recompute: Recompute = Recompute()  # activation recompute per block family
    # Runtime switches, each explicit
    # Data-parallel communication overlapped with compute (Megatron's --overlap-grad-reduce): the distributed
    # optimizer's gradient reduce-scatter during the backward. Needs data parallel > 1. The parameter all-gather
    # stays after the optimizer step: --overlap-param-gather is refused (nam56r.training.flags.REFUSED_FLAGS).
    overlap_dp_comm: bool = False
    # The shared expert's GEMMs on a side stream beside Megatron's all-to-all dispatch and combine (Megatron's
    # --moe-shared-expert-overlap). Needs moe_dispatch "megatron".
    moe_shared_expert_overlap: bool = False
    # The distributed optimizer's checkpoint state per parameter (Megatron's --dist-ckpt-optim-fully-reshardable):
    # such a checkpoint resumes at another expert-parallel size too. Off, Megatron writes its buffers as they lie
    # on each rank, which resumes at the same model-parallel layout only, with no gather at save time.
    reshardable_checkpoints: bool = False
    cuda_graphs: bool = False
    compile_mamba_elementwise: bool = False
    # Logging, evaluation and checkpoints
    log_interval: int = 1
    eval_interval: int = 100
    eval_iters: int = 10
    save_interval: int = 100
    num_workers: int = 2

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def expert_activation_on(self, backend: str) -> ExpertActivation:
        """The MoE experts' activation path on the resolved layer backend ("local" or "te")."""
        return self._local_fused_path(self.expert_activation, backend, "eager", _fused_activation_refused)

    def residual_norm_on(self, backend: str) -> ResidualNorm:
        """The transformer layers' input-norm path on the resolved layer backend ("local" or "te")."""
        return self._local_fused_path(self.residual_norm, backend, "torch", _fused_norm_refused)

    def _local_fused_path(self, chosen: str | None, backend: str, backend_own: str, refused: Callable[[str], str]) -> str:
        """A path whose "fused" runs on the local backend only: `chosen`, or unset, "fused" there and `backend_own` (the
        te backend's own module) elsewhere; raises naming `refused(backend)` for "fused" on another backend."""
        if chosen is None:
            return "fused" if backend == "local" else backend_own
        if chosen == "fused" and backend != "local":
            raise RecipeError(self.name, [refused(backend)])
        return chosen

    def on_backend(self, backend: str) -> Recipe:
        """This recipe with the paths that depend on the resolved layer backend named (what recipe.json records)."""
        return replace(self, expert_activation=self.expert_activation_on(backend), residual_norm=self.residual_norm_on(backend))

    def model_config(self, backend: str | None = None) -> ModelConfig:
        """The model this recipe trains: the preset with the recipe's sequence length, precision, IndexCache,
        DSA indexer, MoE dispatch, router gating and Mamba-3 recompute, and, given the resolved layer `backend`, its experts'
        activation and input-norm paths (without it, the preset's)."""
        base = get_preset(self.model)
        activation = self.expert_activation_on(backend) if backend else base.moe.expert_activation
        return replace(
            base,
            residual_norm=self.residual_norm_on(backend) if backend else base.residual_norm,
            seq_length=self.seq_length or base.seq_length,
            precision=self.precision,
            index_cache=replace(base.index_cache, enabled=self.index_cache),
            dsa=replace(base.dsa, indexer=self.dsa_indexer),
            moe=replace(base.moe, dispatch=self.moe_dispatch, expert_activation=activation, router_gating=self.router_gating,
                        routing=self.moe_routing),
            mamba=replace(base.mamba, recompute=self.recompute.mamba),
        ).validate()

    def check(self, kernels: bool = True) -> Recipe:
        """Raise RecipeError naming every inconsistent or refused setting; return self. `kernels=False` leaves out
        `kernel_problems`, which imports Megatron and TileLang for their predicates (the launcher checks those
        while its ranks start)."""
        problems: list[str] = []
        if self.model not in PRESETS:
            problems.append(f"model {self.model!r} is not a preset ({', '.join(sorted(PRESETS))})")
        for name in ("nodes", "gpus_per_node", "tp", "pp", "ep", "micro_batch", "global_batch", "steps", "log_interval", "save_interval"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if problems:
            raise RecipeError(self.name, problems)
        if self.world_size % (self.tp * self.pp):
            problems.append(f"world size {self.world_size} is not divisible by tp*pp = {self.tp * self.pp}")
        elif self.data_parallel % self.ep:
            problems.append(
                f"expert parallel {self.ep} must divide the data-parallel size {self.data_parallel} (world {self.world_size} / tp*pp)"
            )
        if self.tp != 1:
            problems.append(f"tp={self.tp}: NAM56R's Mamba-3 mixer and the fused linear CE run at tensor parallel 1 only")
        model = self.model_config()
        if kernels:
            problems += self.kernel_problems()
        if model.moe.num_experts % self.ep:
            problems.append(f"expert parallel {self.ep} does not divide the {model.moe.num_experts} experts of {self.model}")
        if self.moe_dispatch == "fused-permute" and self.ep != 1:
            problems.append(f"moe_dispatch 'fused-permute' dispatches on one expert-parallel rank; ep={self.ep} needs "
                            "Megatron's all-to-all (--moe-dispatch megatron)")
        per_step = self.micro_batch * max(self.data_parallel, 1)
        if self.global_batch % per_step:
            problems.append(
                f"global_batch {self.global_batch} is not a multiple of micro_batch x data-parallel"
                f" = {self.micro_batch} x {self.data_parallel}"
            )
        if self.overlap_dp_comm and self.data_parallel == 1:
            problems.append("overlap_dp_comm overlaps the data-parallel gradient reduce-scatter; this recipe "
                            f"runs data parallel 1 (world {self.world_size} / tp*pp), which has none")
        if self.moe_shared_expert_overlap and self.moe_dispatch != "megatron":
            problems.append(f"moe_shared_expert_overlap runs the shared expert beside Megatron's all-to-all dispatcher; "
                            f"moe_dispatch {self.moe_dispatch!r} has no communication to overlap (--moe-dispatch megatron)")
        if self.moe_shared_expert_overlap and not model.moe.shared_expert_ffn:
            problems.append(f"moe_shared_expert_overlap: model {self.model} has no shared expert")
        if self.cuda_graphs and self.pp == 1:
            problems.append(
                "cuda_graphs at pp=1 refused: the original team measured TE's CUDA-graph private pool at 39.5 GiB, which OOMs "
                "the PP=1 topologies; use pp>1 or leave cuda_graphs off"
            )
        if self.cuda_graphs and self.backend == "local":
            problems.append("cuda_graphs needs the te backend (Megatron's TE graph capture); this recipe asks for backend 'local'")
        if self.precision == "fp8-tensorwise" and self.backend == "local":
            problems.append("precision fp8-tensorwise needs TransformerEngine (backend 'te'); the local backend trains in bf16")
        if self.compile_mamba_elementwise:
            problems.append(
                "compile_mamba_elementwise: the regional torch.compile of Mamba-3's elementwise regions is not wired into "
                "training: at NAM56R's shape it is no faster than the eager region (`nox -s bench -- kernels`, case "
                "'mamba3 adt region mb8'); leave it off"
            )
        if self.expert_activation == "fused" and self.backend == "te":
            problems.append(_fused_activation_refused(self.backend))
        if self.residual_norm == "fused" and self.backend == "te":
            problems.append(_fused_norm_refused(self.backend))
        if self.linear_ce not in get_args(LinearCE):
            problems.append(f"linear_ce {self.linear_ce!r} is not one of {', '.join(get_args(LinearCE))}")
        problems += recompute_problems(self, model)
        if self.min_lr > self.lr:
            problems.append(f"min_lr {self.min_lr} exceeds lr {self.lr}")
        if self.warmup_steps >= self.steps:
            problems.append(f"warmup_steps {self.warmup_steps} must be below steps {self.steps} (set it with --warmup)")
        problems += self.dsa_phases.problems(self.steps)
        problems += self.indexer_recall.problems(pp=self.pp, tp=self.tp, cuda_graphs=self.cuda_graphs)
        if self.indexer_recall.interval > 0:
            problems += _recall_layer_problems(model)
        if problems:
            raise RecipeError(self.name, problems)
        return self

    def kernel_problems(self) -> list[str]:
        """The model's shapes against the fused kernels it selects, in both DSA phases (Megatron's and mamba_ssm's
        own predicates, so this imports them)."""
        from nam56r.model.fused_constraints import fused_kernel_problems

        model = self.model_config()
        problems = [f"model {model.name}: {p}" for p in fused_kernel_problems(model)]
        if self.dsa_phases.dense_warmup_steps > 0:
            problems += _dense_warmup_problems(model)
        return problems

    def to_dict(self) -> dict:
        return asdict(self)


def _fused_activation_refused(backend: str) -> str:
    return (f"expert_activation 'fused' runs in our grouped experts on the local backend; backend '{backend}' has TE's "
            "grouped experts (--expert-activation eager, or --backend local)")


def _fused_norm_refused(backend: str) -> str:
    return (f"residual_norm 'fused' stands in for the local backend's torch norm; backend '{backend}' has TE's norm "
            "(--residual-norm torch, or --backend local)")


def _dense_warmup_problems(model: ModelConfig) -> list[str]:
    """The fused kernels' limits at the warm-up's top-k (the sequence length; `nam56r.model.dsa_warmup`)."""
    if model.dsa.kernel_backend != "tilelang" or model.seq_length <= model.dsa.topk:
        return []  # no fused DSA path, or the warm-up's top-k is the sparse one, checked with the model
    from nam56r.model.fused_constraints import dsa_violations

    widened = replace(model, dsa=replace(model.dsa, topk=model.seq_length))
    try:
        found = dsa_violations(widened)
    except ImportError as exc:
        return [f"cannot check the dense warm-up's fused DSA shapes: {type(exc).__name__}: {exc}; run `nox -s build`"]
    return [f"dense warm-up (top-k = seq_length {model.seq_length}): {p}; or pass --dense-warmup-steps 0" for p in found]


def _recall_layer_problems(model: ModelConfig) -> list[str]:
    from nam56r.model.pattern import LayerKind, layout_of

    if layout_of(model).counts().get(LayerKind.DSA, 0):
        return []
    return [f"the indexer recall probe needs DSA layers; model {model.name} has none ({model.pattern}); pass --indexer-recall-interval 0"]


def recompute_problems(recipe: Recipe, model: ModelConfig) -> list[str]:
    """What `recipe.recompute` cannot do for `model` in this run, each with the fix."""
    from nam56r.model.pattern import LayerKind, layout_of

    recompute, problems = recipe.recompute, []
    counts = layout_of(model).counts()
    has = {"mamba": counts.get(LayerKind.MAMBA3, 0), "moe": counts.get(LayerKind.MOE, 0),
           "attention": sum(counts.get(kind, 0) for kind in (LayerKind.MLA, LayerKind.DSA, LayerKind.MTP_ATTENTION))}
    for family in recompute.families:
        if not has[family]:
            problems.append(f"recompute {family}: model {model.name} has no {family} layers ({model.pattern}); drop it from --recompute")
    if recompute.attention and recipe.precision == "fp8-tensorwise":
        problems.append(
            "recompute attention under fp8-tensorwise: Megatron's DSA layers (AbsorbedMLASelfAttention) assert FP8 off when "
            "they recompute their up-projection (mla_up_proj); train in bf16 or leave attention out of --recompute"
        )
    if recompute.attention and model.index_cache.enabled and recipe.pp > 1:
        problems.append(
            f"recompute attention with IndexCache at pp={recipe.pp}: a Shared DSA layer recomputed in the backward would read "
            "the top-k of a later micro-batch (the pipeline schedule runs its forward first); use pp=1, --index-cache off, "
            "or leave attention out of --recompute"
        )
    if recompute.mamba and recipe.cuda_graphs:
        problems.append(
            "recompute mamba with CUDA graphs: our checkpointed mixer is not checked under graph capture (Megatron's own "
            "checkpoint skips itself while capturing); leave one of them off"
        )
    return problems


class RecipeError(ValueError):
    def __init__(self, recipe: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"recipe {recipe!r}:\n  - " + "\n  - ".join(problems))


def tiny_1gpu() -> Recipe:
    return Recipe(
        name="tiny-1gpu",
        model="nam56r-tiny",
        description="toy sizes on any one GPU: smoke runs and the resume check (minutes)",
        micro_batch=8,
        global_batch=16,
        steps=200,
        lr=1e-3,
        min_lr=1e-4,
        warmup_steps=10,
        dsa_phases=DsaPhases(dense_warmup_steps=5),
        eval_interval=50,
        save_interval=50,
    )


def proxy_1gpu() -> Recipe:
    return Recipe(
        name="proxy-1gpu",
        model="nam56r-proxy",
        description="16-layer proxy at canonical widths on one H100/H200, bf16",
        micro_batch=1,
        global_batch=8,
        steps=300,
        dsa_phases=DsaPhases(dense_warmup_steps=50),
        save_interval=100,
    )


def h200x2_ep2() -> Recipe:
    return Recipe(
        name="h200x2-ep2",
        model="nam56r-proxy",
        description="the proxy on 2xH200 with expert parallel 2",
        gpus_per_node=2,
        ep=2,
        micro_batch=2,
        global_batch=16,
        steps=300,
        dsa_phases=DsaPhases(dense_warmup_steps=50),
        moe_dispatch="megatron",  # ep > 1: Megatron's all-to-all
    )


def h200x8_bf16() -> Recipe:
    return Recipe(
        name="h200x8-bf16",
        model="nam56r",
        description="the original team's best BF16 topology: 8xH200, PP=1 EP=4 MBS=8 (their 289 TFLOP/s/GPU)",
        gpus_per_node=8,
        ep=4,
        micro_batch=8,
        global_batch=64,
        steps=10_000,
        dsa_phases=DsaPhases(dense_warmup_steps=1000),  # the original stack's and DeepSeek-V3.2's 1000 steps
        save_interval=500,
        eval_interval=500,
        moe_dispatch="megatron",  # ep > 1: Megatron's all-to-all
    )


def h200x8_fp8() -> Recipe:
    return Recipe(
        name="h200x8-fp8",
        model="nam56r",
        description="the original team's FP8 topology: 8xH200, PP=1 EP=8 MBS=10, FP8 tensorwise (their 268 TFLOP/s/GPU); needs TE",
        gpus_per_node=8,
        ep=8,
        micro_batch=10,
        global_batch=80,
        steps=10_000,
        dsa_phases=DsaPhases(dense_warmup_steps=1000),
        precision="fp8-tensorwise",
        backend="te",
        save_interval=500,
        eval_interval=500,
        moe_dispatch="megatron",  # ep > 1: Megatron's all-to-all
    )


RECIPES: dict[str, Callable[[], Recipe]] = {
    "tiny-1gpu": tiny_1gpu,
    "proxy-1gpu": proxy_1gpu,
    "h200x2-ep2": h200x2_ep2,
    "h200x8-bf16": h200x8_bf16,
    "h200x8-fp8": h200x8_fp8,
}


def get_recipe(name: str, *, kernels: bool = True, **overrides: object) -> Recipe:
    """The recipe called `name` with `overrides` (field name -> value; None values are ignored), checked
    (`Recipe.check`; `kernels=False` leaves out `Recipe.kernel_problems`)."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    known = {f.name for f in fields(Recipe)}
    unknown = set(overrides) - known
    if unknown:
        raise KeyError(f"unknown recipe fields {sorted(unknown)}; known: {', '.join(sorted(known))}")
    recipe = RECIPES[name]()
    given = {k: v for k, v in overrides.items() if v is not None}
    return (replace(recipe, **given) if given else recipe).check(kernels=kernels)
