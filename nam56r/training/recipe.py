"""Training recipes: one dataclass per run shape, named presets per machine shape.

A `Recipe` says what to train (a model preset), on what (nodes x GPUs, TP/PP/EP), how (batch, steps, optimizer,
precision, kernel paths, runtime switches). It holds nothing host-specific: no paths to home directories, no host
names. Its settings are declared once, in groups (`nam56r.training.recipe_settings`); `Recipe.check`
(`nam56r.training.recipe_checks`) refuses what may not run; `nam56r.training.launcher.flags` lowers it to Megatron's training
flags; `nam56r.training.launcher` launches it.

A recipe names its DSA phases (`nam56r.training.phases`): a dense indexer warm-up for the first
`phases.dsa.dense_warmup_steps` steps, then sparse attention; the switch happens inside one run, at Megatron's step
number, so a resumed run continues in the right phase.

`Recompute` switches activation recompute per block family. Attention and MoE lower to Megatron's selective
recompute (`nam56r.training.launcher.flags`); Megatron has no hook inside a Mamba layer, so the Mamba-3 switch reaches
the model config and our checkpointed mixer (`nam56r.model.recompute`). Megatron's full recompute checkpoints
whole layers of every family at once, so it is no family switch: a run that passes it after `--` keeps the
family switches off (the launcher refuses the mix).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, ClassVar

from nam56r.model.config import ExpertActivation, ModelConfig, ResidualNorm
from nam56r.model.presets import PRESETS, get_preset
from nam56r.model.reference import ReferenceConfig, reference_for
from nam56r.training import recipe_checks as checks
from nam56r.training.recipe_settings import (
    Batch,
    KernelPaths,
    Logging,
    Optimizer,
    Parallel,
    Phases,
    Recompute,
    Runtime,
    recompute_argument,
)
from nam56r.training.settings import setting, settings_in, with_overrides


@dataclass(frozen=True)
class Recipe:
    name: str
    model: str = setting(cli="--model", choices=tuple(sorted(PRESETS)), cli_default="the recipe's (--list)",
                         help="model preset (e.g. nam56r on a recipe whose default is the proxy)")
    reference: bool = setting(
        False, cli="--reference", flag=True,
        help="train the preset's reference model instead of NAM56R: a dense GPT of about NAM56R's active parameters on "
             "Megatron's own GPTModel and local layers (nam56r.model.reference), on the same data, batch, steps and "
             "optimizer. Its kernel paths are upstream's (recorded in recipe.json), expert parallel 1, no DSA phases")
    description: str = ""
    parallel: Parallel = field(default_factory=Parallel)
    batch: Batch = field(default_factory=Batch)
    optimizer: Optimizer = field(default_factory=Optimizer)
    kernels: KernelPaths = field(default_factory=KernelPaths)
    recompute: Recompute = setting(
        Recompute(), cli="--recompute", parse=recompute_argument, metavar="none|all|FAMILY[,FAMILY...]", recorded=True,
        help="activation recompute per block family: mamba (our checkpointed Mamba-3 mixer), moe (Megatron's selective "
             "'moe': the whole MoE layer), attention (Megatron's selective 'core_attn' and 'mla_up_proj' on the MLA, DSA "
             "and MTP attention); e.g. --recompute mamba,moe. Megatron's full recompute (after --) is refused together "
             "with these")
    phases: Phases = field(default_factory=Phases)
    runtime: Runtime = field(default_factory=Runtime)
    logging: Logging = field(default_factory=Logging)

    GROUP_TITLES: ClassVar[dict[str, str]] = {
        "parallel": "parallelism", "batch": "batch and schedule", "optimizer": "optimizer",
        "kernels": "numerics and kernel paths", "phases": "DSA phases", "runtime": "runtime switches",
        "logging": "logging and checkpoints"}

    @property
    def world_size(self) -> int:
        return self.parallel.nodes * self.parallel.gpus_per_node

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.parallel.tp * self.parallel.pp)

    def expert_activation_on(self, backend: str) -> ExpertActivation:
        """The MoE experts' activation path on the resolved layer backend ("local" or "te")."""
        return self._local_fused_path(self.kernels.expert_activation, backend, "eager", checks.fused_activation_refused)

    def residual_norm_on(self, backend: str) -> ResidualNorm:
        """The transformer layers' input-norm path on the resolved layer backend ("local" or "te")."""
        return self._local_fused_path(self.kernels.residual_norm, backend, "torch", checks.fused_norm_refused)

    def _local_fused_path(self, chosen: str | None, backend: str, backend_own: str, refused: Callable[[str], str]) -> str:
        """A path whose "fused" runs on the local backend only: `chosen`, or unset, "fused" there and `backend_own` (the
        te backend's own module) elsewhere; raises naming `refused(backend)` for "fused" on another backend."""
        if chosen is None:
            return "fused" if backend == "local" else backend_own
        if chosen == "fused" and backend != "local":
            raise RecipeError(self.name, [refused(backend)])
        return chosen

    def as_reference(self) -> Recipe:
        """This recipe training its model preset's reference GPT: upstream's paths, expert parallel 1, no DSA phases, so
        that recipe.json records what runs; refuses what the reference cannot honour (`checks.reference_problems`)."""
        if problems := checks.reference_problems(self):
            raise RecipeError(self.name, problems)
        upstream = KernelPaths(backend="local", index_cache=False, dsa_indexer="megatron", linear_ce="logits", moe_dispatch="megatron",
                               expert_activation="eager", router_gating="megatron", moe_routing="megatron", residual_norm="torch")
        return replace(self, reference=True, kernels=upstream, parallel=replace(self.parallel, ep=1), phases=Phases())

    def trained_model(self, backend: str | None = None) -> ModelConfig | ReferenceConfig:
        """What the ranks build: the preset's reference with `--reference` (at this recipe's sequence length), else
        `model_config(backend)`."""
        model = self.model_config(backend)
        return reference_for(model) if self.reference else model

    def on_backend(self, backend: str) -> Recipe:
        """This recipe with the paths that depend on the resolved layer backend named (what recipe.json records)."""
        kernels = replace(self.kernels, expert_activation=self.expert_activation_on(backend),
                          residual_norm=self.residual_norm_on(backend))
        return replace(self, kernels=kernels)

    def model_config(self, backend: str | None = None) -> ModelConfig:
        """The model this recipe trains: the preset with the recipe's sequence length, precision, IndexCache,
        DSA indexer, MoE dispatch, router gating and Mamba-3 recompute, and, given the resolved layer `backend`, its experts'
        activation and input-norm paths (without it, the preset's)."""
        base, kernels = get_preset(self.model), self.kernels
        activation = self.expert_activation_on(backend) if backend else base.moe.expert_activation
        return replace(
            base,
            residual_norm=self.residual_norm_on(backend) if backend else base.residual_norm,
            seq_length=self.batch.seq_length or base.seq_length,
            precision=kernels.precision,
            index_cache=replace(base.index_cache, enabled=kernels.index_cache),
            dsa=replace(base.dsa, indexer=kernels.dsa_indexer),
            moe=replace(base.moe, dispatch=kernels.moe_dispatch, expert_activation=activation,
                        router_gating=kernels.router_gating, routing=kernels.moe_routing),
            mamba=replace(base.mamba, recompute=self.recompute.mamba),
        ).validate()

    def check(self, kernels: bool = True) -> Recipe:
        """Raise RecipeError naming every inconsistent or refused setting; return self. `kernels=False` leaves out
        `kernel_problems`, which imports Megatron and TileLang for their predicates (the launcher checks those
        while its ranks start)."""
        if problems := checks.shape_problems(self):
            raise RecipeError(self.name, problems)
        if self.reference and self.as_reference() != self:
            raise RecipeError(self.name, ["reference=True on NAM56R's kernel paths: make it with Recipe.as_reference (get_recipe does)"])
        problems = checks.parallel_problems(self)
        model = self.model_config()
        if kernels:
            problems += self.kernel_problems()
        problems += checks.placement_problems(self, model) + checks.runtime_problems(self, model)
        problems += checks.kernel_path_problems(self) + checks.recompute_problems(self, model)
        problems += checks.schedule_problems(self, model)
        if problems:
            raise RecipeError(self.name, problems)
        return self

    def kernel_problems(self) -> list[str]:
        """The model's shapes against the fused kernels it selects, in both DSA phases (Megatron's and mamba_ssm's
        own predicates, so this imports them)."""
        from nam56r.model.fused_constraints import fused_kernel_problems

        if self.reference:
            return []  # Megatron's own modules only
        model = self.model_config()
        problems = [f"model {model.name}: {p}" for p in fused_kernel_problems(model)]
        if self.phases.dsa.dense_warmup_steps > 0:
            problems += checks.dense_warmup_problems(model)
        return problems

    def to_dict(self) -> dict:
        """recipe.json: the settings in their groups."""
        return asdict(self)


class RecipeError(ValueError):
    def __init__(self, recipe: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"recipe {recipe!r}:\n  - " + "\n  - ".join(problems))


def _recipe(name: str, model: str, description: str, **settings: object) -> Recipe:
    """A named recipe: its settings by key (nam56r.training.settings), the rest at their defaults."""
    return with_overrides(Recipe(name=name, model=model, description=description), settings)


def tiny_1gpu() -> Recipe:
    return _recipe("tiny-1gpu", "nam56r-tiny", "toy sizes on any one GPU: smoke runs and the resume check (minutes)",
                   micro_batch=8, global_batch=16, steps=200, lr=1e-3, min_lr=1e-4, warmup_steps=10, dense_warmup_steps=5,
                   eval_interval=50, save_interval=50)


def proxy_1gpu() -> Recipe:
    return _recipe("proxy-1gpu", "nam56r-proxy", "16-layer proxy at canonical widths on one H100/H200, bf16",
                   micro_batch=1, global_batch=8, steps=300, dense_warmup_steps=50, save_interval=100)


def h200x2_ep2() -> Recipe:
    return _recipe("h200x2-ep2", "nam56r-proxy", "the proxy on 2xH200 with expert parallel 2",
                   gpus_per_node=2, ep=2, micro_batch=2, global_batch=16, steps=300, dense_warmup_steps=50,
                   moe_dispatch="megatron")  # ep > 1: Megatron's all-to-all


def h200x8_bf16() -> Recipe:
    return _recipe("h200x8-bf16", "nam56r",
                   "the original team's best BF16 topology: 8xH200, PP=1 EP=4 MBS=8 (their 289 TFLOP/s/GPU)",
                   gpus_per_node=8, ep=4, micro_batch=8, global_batch=64, steps=10_000,
                   dense_warmup_steps=1000,  # the original stack's and DeepSeek-V3.2's 1000 steps
                   save_interval=500, eval_interval=500, moe_dispatch="megatron")


def h200x8_fp8() -> Recipe:
    return _recipe("h200x8-fp8", "nam56r",
                   "the original team's FP8 topology: 8xH200, PP=1 EP=8 MBS=10, FP8 tensorwise (their 268 TFLOP/s/GPU); needs TE",
                   gpus_per_node=8, ep=8, micro_batch=10, global_batch=80, steps=10_000, dense_warmup_steps=1000,
                   precision="fp8-tensorwise", backend="te", save_interval=500, eval_interval=500, moe_dispatch="megatron")


RECIPES: dict[str, Callable[[], Recipe]] = {
    "tiny-1gpu": tiny_1gpu,
    "proxy-1gpu": proxy_1gpu,
    "h200x2-ep2": h200x2_ep2,
    "h200x8-bf16": h200x8_bf16,
    "h200x8-fp8": h200x8_fp8,
}


def get_recipe(name: str, *, kernels: bool = True, **overrides: object) -> Recipe:
    """The recipe called `name` with `overrides` (setting key -> value, e.g. micro_batch=8; None values are ignored),
    as its reference run where they say `reference=True` (`Recipe.as_reference`), checked (`Recipe.check`;
    `kernels=False` leaves out `Recipe.kernel_problems`)."""
    if name not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}")
    recipe = with_overrides(RECIPES[name](), overrides)
    return (recipe.as_reference() if recipe.reference else recipe).check(kernels=kernels)


def settings_of(recipe_json: Mapping[str, Any], keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A recipe.json's settings by key (`Recipe.to_dict`'s groups flattened): `keys`, or, with None, every setting
    a benchmark row records (declared `recorded`). A file without one of them raises ValueError naming it."""
    return settings_in(recipe_json, Recipe, keys, source="recipe.json")
