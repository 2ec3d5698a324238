"""Megatron's training flags for a recipe (`megatron_flags`), checked with Megatron's own parser.

Every flag the launcher passes is produced here, so `nam56r.training.launcher --dry-run` can print the exact
command. The architecture flags come from the table Megatron's config for the model comes from too
(`nam56r.model.megatron_fields`). The model provider builds from the model config file the launcher
writes and from the config Megatron derives from these flags, after checking that the two agree on
every architecture fact (`architecture_mismatches`); so Megatron's checks, checkpoint metadata and
logs describe the model that runs. The rest is the recipe's run: parallelism, batch, optimizer, data,
logging, checkpoints, and our own (the model config file, the backend, the DSA phases).

`megatron_validate` runs Megatron's parser and `validate_args` in this process. Megatron's validation
reads WORLD_SIZE and RANK from the environment: they are set in `os.environ` for that call only and
restored after it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nam56r.model.config import ModelConfig
from nam56r.model.linear_cross_entropy import CHUNKED_LINEAR_CE
from nam56r.model.megatron_fields import architecture_flags, architecture_mismatches
from nam56r.model.reference import ReferenceConfig
from nam56r.training.data.layout import DataPaths
from nam56r.training.recipe import Recipe
from nam56r.training.runs.layout import RunDir
from nam56r.training.settings import switch_flags

# Flags a real run must never carry: synthetic data and the null tokenizer (the original launcher
# refused them for real runs too).
REFUSED_FLAGS = {
    "--mock-data": "mock data",
    "--tokenizer-type=NullTokenizer": "the null tokenizer",
    # Megatron waits for a module's all-gathered weights in that module's forward pre-hook. The LM head's and MTP
    # heads' fused linear CE (patches 0007/0008) read the output layer's weight without running its forward, and that
    # weight fills a bucket of its own: its all-gather would never be waited on.
    "--overlap-param-gather": "--overlap-param-gather (the fused linear CE heads read the output layer's weight outside "
                              "its forward, where Megatron waits for the all-gather; --overlap-dp-comm on overlaps the "
                              "gradient reduce-scatter)",
}


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path  # logs, TensorBoard events, the model config, the summary and plot
    save: Path | None  # checkpoints written here
    load: Path | None  # resume from here

    @property
    def layout(self) -> RunDir:
        return RunDir(self.run_dir)


def megatron_flags(recipe: Recipe, model: ModelConfig | ReferenceConfig, data: DataPaths, run: RunPaths, backend: str) -> list[str]:
    """Megatron training flags for `recipe` training `model` (NAM56R's, or with `--reference` the reference GPT's,
    `Recipe.trained_model`) on `data`, with layer backend `backend` ('te'|'local'): the model's architecture
    (`nam56r.model.megatron_fields` or `nam56r.model.reference_model`), then the run's."""
    if backend not in ("te", "local"):
        raise ValueError(f"backend must be resolved to 'te' or 'local' before lowering, got {backend!r}")
    if recipe.reference != isinstance(model, ReferenceConfig):
        raise ValueError(f"recipe {recipe.name} (reference {recipe.reference}) cannot train {model.name}: use Recipe.trained_model")
    if isinstance(model, ReferenceConfig):
        from nam56r.model.reference_model import reference_architecture_flags

        architecture = reference_architecture_flags(model)
    else:
        architecture = architecture_flags(model)
    return architecture + _run_flags(recipe, data, run, backend) + _optional_run_flags(recipe, data, run, backend)


def trained_model_mismatches(model: ModelConfig | ReferenceConfig, args: argparse.Namespace, megatron_cfg) -> list[str]:
    """Where Megatron's parsed flags and the config it derived describe another model than `model` (empty: none)."""
    if isinstance(model, ReferenceConfig):
        from nam56r.model.reference_model import reference_mismatches

        return reference_mismatches(model, args, megatron_cfg)
    return architecture_mismatches(model, args, megatron_cfg)


def _run_flags(recipe: Recipe, data: DataPaths, run: RunPaths, backend: str) -> list[str]:
    """The flags every run passes: parallelism, batch, optimizer, data, logging, checkpoint format."""
    # fmt: off
    return [
        # Parallelism and batch
        "--tensor-model-parallel-size", str(recipe.parallel.tp),
        "--pipeline-model-parallel-size", str(recipe.parallel.pp),
        "--expert-model-parallel-size", str(recipe.parallel.ep),
        "--micro-batch-size", str(recipe.batch.micro_batch),
        "--global-batch-size", str(recipe.batch.global_batch),
        "--train-iters", str(recipe.batch.steps),
        # Optimizer and schedule
        "--optimizer", "adam",
        "--lr", str(recipe.optimizer.lr),
        "--min-lr", str(recipe.optimizer.min_lr),
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(recipe.optimizer.warmup_steps),
        "--weight-decay", str(recipe.optimizer.weight_decay),
        "--adam-beta1", str(recipe.optimizer.adam_beta1),
        "--adam-beta2", str(recipe.optimizer.adam_beta2),
        "--clip-grad", str(recipe.optimizer.clip_grad),
        "--seed", str(recipe.optimizer.seed),
        "--bf16",
        "--transformer-impl", "transformer_engine" if backend == "te" else "local",
        # Data
        "--train-data-path", str(data.train_prefix),
        "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(data.tokenizer_dir),
        "--num-workers", str(recipe.logging.num_workers),
        "--data-cache-path", str(run.layout.dataset_cache),  # not beside the data, which may be read-only
        # Logging
        "--log-interval", str(recipe.logging.log_interval),
        "--tensorboard-dir", str(run.layout.tensorboard),
        "--log-timers-to-tensorboard",
        "--log-memory-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--log-world-size-to-tensorboard",
        "--timing-log-level", "0",
        # Checkpoints: Megatron's distributed checkpointing
        "--ckpt-format", "torch_dist",
        "--save-interval", str(recipe.logging.save_interval),
    ]
    # fmt: on


def _optional_run_flags(recipe: Recipe, data: DataPaths, run: RunPaths, backend: str) -> list[str]:
    """The flags that depend on the run: validation, optimizer sharding, backend, precision, checkpoints, our own."""
    args: list[str] = []
    if data.valid_prefix is not None:
        args += ["--valid-data-path", str(data.valid_prefix)]
        args += ["--eval-interval", str(recipe.logging.eval_interval), "--eval-iters", str(recipe.logging.eval_iters)]
    else:
        args += ["--eval-iters", "0"]
    if recipe.data_parallel > 1:
        args += ["--use-distributed-optimizer"]
        if recipe.runtime.reshardable_checkpoints:
            args += ["--dist-ckpt-optim-fully-reshardable"]
    args += switch_flags(recipe)  # the on/off switches that lower to one Megatron flag (nam56r.training.recipe_settings)
    if backend == "local":
        # Gradient-accumulation fusion needs APEX's or TE's fused wgrad kernels; the local layers have neither.
        args += ["--no-gradient-accumulation-fusion"]
    if recipe.kernels.precision == "fp8-tensorwise":
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    if recipe.runtime.cuda_graphs:
        args += ["--cuda-graph-impl", "transformer_engine"]
    if run.save is not None:
        args += ["--save", str(run.save)]
    if run.load is not None:
        args += ["--load", str(run.load), "--exit-on-missing-checkpoint"]
    if recipe.kernels.linear_ce != "logits":
        args += ["--fused-linear-cross-entropy"]  # TransformerConfig field from Megatron patch 0007
    if recipe.kernels.linear_ce == "chunked":
        args += ["--fused-linear-cross-entropy-impl", CHUNKED_LINEAR_CE]  # TransformerConfig field from Megatron patch 0016
    if modules := recipe.recompute.megatron_modules():
        args += ["--recompute-granularity", "selective", "--recompute-modules", *modules]
    args += ["--nam56r-model-config", str(run.layout.model_config), "--nam56r-backend", backend]
    args += ["--nam56r-dense-warmup-steps", str(recipe.phases.dsa.dense_warmup_steps)]
    args += ["--nam56r-indexer-recall-interval", str(recipe.phases.indexer_recall.interval)]
    return args


def recompute_mismatches(recipe: Recipe, megatron_cfg) -> list[str]:
    """Where the recompute Megatron derived from the whole command (extra flags included) is not the recipe's
    `Recompute`: a full recompute mixed with the family switches (it checkpoints every layer, the switched
    families inside it again), or extra flags that replaced the selective modules the switches lowered to."""
    recompute, problems = recipe.recompute, []
    granularity, modules = megatron_cfg.recompute_granularity, megatron_cfg.recompute_modules or []
    if granularity == "full" and recompute.families:
        problems.append(
            f"--recompute-granularity full checkpoints whole layers of every family; it cannot be mixed with --recompute "
            f"{recompute}: pass one or the other"
        )
    elif missing := [m for m in recompute.megatron_modules() if granularity != "selective" or m not in modules]:
        problems.append(
            f"--recompute {recompute} lowers to selective recompute of {', '.join(missing)}, which the extra flags replaced "
            f"(granularity {granularity!r}, modules {modules}); drop those extra flags"
        )
    return problems


def add_nam56r_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our flags on Megatron's parser (its `extra_args_provider`)."""
    group = parser.add_argument_group("nam56r")
    group.add_argument("--nam56r-model-config", required=True, help="the ModelConfig JSON the launcher wrote")
    group.add_argument("--nam56r-backend", choices=("te", "local"), required=True)
    group.add_argument(
        "--nam56r-dense-warmup-steps", type=int, default=0, metavar="N",
        help="DSA phases: steps 1..N run the dense indexer warm-up, later steps sparse attention (nam56r.training.phases)",
    )
    group.add_argument(
        "--nam56r-indexer-recall-interval", type=int, default=0, metavar="N",
        help="log 'indexer recall' (one DSA layer's indexer top-k against dense attention's) at step 1 and every N steps; "
             "0: off (nam56r.training.recall_probe)",
    )
    group.add_argument(
        "--nam56r-nonfinite-loss-at-step", type=int, metavar="N",
        help="fault injection: make the loss of step N NaN, to test that the run stops naming the step and the last checkpoint",
    )
    return parser


def refused_flags(argv: Sequence[str]) -> list[str]:
    """The refused flags (mock data, null tokenizer) present in `argv`, by name."""
    joined = set(argv) | {f"{a}={b}" for a, b in zip(argv, argv[1:], strict=False)}
    return [why for flag, why in REFUSED_FLAGS.items() if flag in joined]


@contextmanager
def _world(world_size: int):
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), "0"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def megatron_validate(argv: Sequence[str], world_size: int) -> argparse.Namespace:
    """Parse and validate `argv` with Megatron's own parser and `validate_args`, as `world_size` ranks
    would; raise on anything Megatron rejects. Touches no GPU; WORLD_SIZE and RANK, which Megatron's validation
    reads, are set only for the call and restored after it."""
    from megatron.training.arguments import add_megatron_arguments, validate_args

    parser = add_nam56r_args(add_megatron_arguments(argparse.ArgumentParser(prog="megatron", allow_abbrev=False)))
    args = parser.parse_args(list(argv))
    with _world(world_size):
        args.rank, args.world_size = 0, world_size
        args._is_global_batch_size_explicitly_specified = True
        validate_args(args, {})
    return args


def transformer_config_from_args(args: argparse.Namespace):
    """Megatron's config derived from parsed flags, as `pretrain` derives it: an MLATransformerConfig for NAM56R, a
    TransformerConfig for the reference GPT (no --multi-latent-attention)."""
    import contextlib
    import io

    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from megatron.training.arguments import core_transformer_config_from_args

    with contextlib.redirect_stdout(io.StringIO()):
        return core_transformer_config_from_args(args, MLATransformerConfig if args.multi_latent_attention else TransformerConfig)
