"""What a recipe may not be: every inconsistent or refused combination of its settings, each with the fix.

Runtime policy is checked here, not applied silently elsewhere: a combination the original team found broken (CUDA
graphs at PP=1: TE's graph pool took 39.5 GiB and OOMed the production topology) is refused instead of a switch
quietly turned off, and so are model shapes the fused kernels refuse (`nam56r.model.fused_constraints`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, get_args

from nam56r.model.config import ModelConfig
from nam56r.model.presets import PRESETS
from nam56r.training.recipe_settings import LinearCE

if TYPE_CHECKING:
    from nam56r.training.recipe import Recipe

POSITIVE = (("parallel", "nodes"), ("parallel", "gpus_per_node"), ("parallel", "tp"), ("parallel", "pp"), ("parallel", "ep"),
            ("batch", "micro_batch"), ("batch", "global_batch"), ("batch", "steps"), ("logging", "log_interval"),
            ("logging", "save_interval"))


def shape_problems(recipe: Recipe) -> list[str]:
    """The model preset and the sizes that must be at least 1; later checks assume these hold."""
    problems = [] if recipe.model in PRESETS else [f"model {recipe.model!r} is not a preset ({', '.join(sorted(PRESETS))})"]
    for group, name in POSITIVE:
        if (value := getattr(getattr(recipe, group), name)) < 1:
            problems.append(f"{name} must be >= 1, got {value}")
    return problems


def parallel_problems(recipe: Recipe) -> list[str]:
    parallel, problems = recipe.parallel, []
    if recipe.world_size % (parallel.tp * parallel.pp):
        problems.append(f"world size {recipe.world_size} is not divisible by tp*pp = {parallel.tp * parallel.pp}")
    elif recipe.data_parallel % parallel.ep:
        problems.append(f"expert parallel {parallel.ep} must divide the data-parallel size {recipe.data_parallel} "
                        f"(world {recipe.world_size} / tp*pp)")
    if parallel.tp != 1:
        problems.append(f"tp={parallel.tp}: NAM56R's Mamba-3 mixer and the fused linear CE run at tensor parallel 1 only")
    return problems


def placement_problems(recipe: Recipe, model: ModelConfig) -> list[str]:
    """The experts over the expert-parallel ranks, the batch over the data-parallel ranks."""
    parallel, batch, problems = recipe.parallel, recipe.batch, []
    if model.moe.num_experts % parallel.ep:
        problems.append(f"expert parallel {parallel.ep} does not divide the {model.moe.num_experts} experts of {recipe.model}")
    if recipe.kernels.moe_dispatch == "fused-permute" and parallel.ep != 1:
        problems.append(f"moe_dispatch 'fused-permute' dispatches on one expert-parallel rank; ep={parallel.ep} needs "
                        "Megatron's all-to-all (--moe-dispatch megatron)")
    per_step = batch.micro_batch * max(recipe.data_parallel, 1)
    if batch.global_batch % per_step:
        problems.append(f"global_batch {batch.global_batch} is not a multiple of micro_batch x data-parallel"
                        f" = {batch.micro_batch} x {recipe.data_parallel}")
    return problems


def runtime_problems(recipe: Recipe, model: ModelConfig) -> list[str]:
    runtime, kernels, problems = recipe.runtime, recipe.kernels, []
    if runtime.overlap_dp_comm and recipe.data_parallel == 1:
        problems.append("overlap_dp_comm overlaps the data-parallel gradient reduce-scatter; this recipe "
                        f"runs data parallel 1 (world {recipe.world_size} / tp*pp), which has none")
    if runtime.moe_shared_expert_overlap and kernels.moe_dispatch != "megatron":
        problems.append(f"moe_shared_expert_overlap runs the shared expert beside Megatron's all-to-all dispatcher; "
                        f"moe_dispatch {kernels.moe_dispatch!r} has no communication to overlap (--moe-dispatch megatron)")
    if runtime.moe_shared_expert_overlap and not model.moe.shared_expert_ffn:
        problems.append(f"moe_shared_expert_overlap: model {recipe.model} has no shared expert")
    if runtime.cuda_graphs and recipe.parallel.pp == 1:
        problems.append("cuda_graphs at pp=1 refused: the original team measured TE's CUDA-graph private pool at 39.5 GiB, "
                        "which OOMs the PP=1 topologies; use pp>1 or leave cuda_graphs off")
    if runtime.cuda_graphs and kernels.backend == "local":
        problems.append("cuda_graphs needs the te backend (Megatron's TE graph capture); this recipe asks for backend 'local'")
    return problems


def kernel_path_problems(recipe: Recipe) -> list[str]:
    kernels, problems = recipe.kernels, []
    if kernels.precision == "fp8-tensorwise" and kernels.backend == "local":
        problems.append("precision fp8-tensorwise needs TransformerEngine (backend 'te'); the local backend trains in bf16")
    if recipe.runtime.compile_mamba_elementwise:
        problems.append("compile_mamba_elementwise: the regional torch.compile of Mamba-3's elementwise regions is not wired "
                        "into training: at NAM56R's shape it is no faster than the eager region (`nox -s bench -- kernels`, "
                        "case 'mamba3 adt region mb8'); leave it off")
    if kernels.expert_activation == "fused" and kernels.backend == "te":
        problems.append(fused_activation_refused(kernels.backend))
    if kernels.residual_norm == "fused" and kernels.backend == "te":
        problems.append(fused_norm_refused(kernels.backend))
    if kernels.linear_ce not in get_args(LinearCE):
        problems.append(f"linear_ce {kernels.linear_ce!r} is not one of {', '.join(get_args(LinearCE))}")
    return problems


def schedule_problems(recipe: Recipe, model: ModelConfig) -> list[str]:
    optimizer, phases, problems = recipe.optimizer, recipe.phases, []
    if optimizer.min_lr > optimizer.lr:
        problems.append(f"min_lr {optimizer.min_lr} exceeds lr {optimizer.lr}")
    if optimizer.warmup_steps >= recipe.batch.steps:
        problems.append(f"warmup_steps {optimizer.warmup_steps} must be below steps {recipe.batch.steps} (set it with --warmup)")
    problems += phases.dsa.problems(recipe.batch.steps)
    problems += phases.indexer_recall.problems(pp=recipe.parallel.pp, tp=recipe.parallel.tp, cuda_graphs=recipe.runtime.cuda_graphs)
    if phases.indexer_recall.interval > 0:
        problems += _recall_layer_problems(model)
    return problems


def fused_activation_refused(backend: str) -> str:
    return (f"expert_activation 'fused' runs in our grouped experts on the local backend; backend '{backend}' has TE's "
            "grouped experts (--expert-activation eager, or --backend local)")


def fused_norm_refused(backend: str) -> str:
    return (f"residual_norm 'fused' stands in for the local backend's torch norm; backend '{backend}' has TE's norm "
            "(--residual-norm torch, or --backend local)")


def dense_warmup_problems(model: ModelConfig) -> list[str]:
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
    if recompute.attention and recipe.kernels.precision == "fp8-tensorwise":
        problems.append(
            "recompute attention under fp8-tensorwise: Megatron's DSA layers (AbsorbedMLASelfAttention) assert FP8 off when "
            "they recompute their up-projection (mla_up_proj); train in bf16 or leave attention out of --recompute")
    if recompute.attention and model.index_cache.enabled and recipe.parallel.pp > 1:
        problems.append(
            f"recompute attention with IndexCache at pp={recipe.parallel.pp}: a Shared DSA layer recomputed in the backward "
            "would read the top-k of a later micro-batch (the pipeline schedule runs its forward first); use pp=1, "
            "--index-cache off, or leave attention out of --recompute")
    if recompute.mamba and recipe.runtime.cuda_graphs:
        problems.append(
            "recompute mamba with CUDA graphs: our checkpointed mixer is not checked under graph capture (Megatron's own "
            "checkpoint skips itself while capturing); leave one of them off")
    return problems


def reference_problems(recipe: Recipe) -> list[str]:
    """What a run of the reference GPT (`--reference`) cannot honour: settings of NAM56R's own layers and of
    TransformerEngine, which Megatron's local GPT layers do not have."""
    from nam56r.model.reference import REFERENCE_SHAPES

    problems = []
    if recipe.model not in REFERENCE_SHAPES:
        problems.append(f"--reference: model {recipe.model} has no reference model; these have one: {', '.join(REFERENCE_SHAPES)}")
    if recipe.kernels.precision != "bf16" or recipe.kernels.backend == "te":
        problems.append(f"--reference trains on Megatron's local layers in bf16; this recipe asks for {recipe.kernels.precision} on "
                        f"backend {recipe.kernels.backend!r} (use a bf16 recipe, with --backend auto or local)")
    if recipe.recompute.families:
        problems.append(f"--reference has none of NAM56R's block families to recompute; drop --recompute {recipe.recompute}")
    if recipe.phases.indexer_recall.interval:
        problems.append("--reference has no DSA indexer to probe; pass --indexer-recall-interval 0")
    if recipe.runtime.cuda_graphs or recipe.runtime.moe_shared_expert_overlap:
        problems.append("--reference runs without CUDA graphs and has no MoE shared expert; leave --cuda-graphs and "
                        "--moe-shared-expert-overlap off")
    return problems
