"""Lower a recipe to Megatron's own training flags, and check them with Megatron's own parser.

Every flag the launcher passes is produced here, so `nam56r.training.train --dry-run` can print the exact
command. The model's architecture flags mirror the `ModelConfig` Megatron never builds from (our
model provider builds the model from the config file the launcher writes); they are there so that
Megatron's checks, checkpoint metadata and logs describe the model that runs, and the provider
cross-checks them (`ARCH_FIELDS`) before it builds anything.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nam56r.model.config import ModelConfig
from nam56r.model.pattern import layout_of
from nam56r.training.recipe import Recipe
from nam56r.training.run_dir import RunDir

# Flags a real run must never carry: synthetic data and the null tokenizer (the original launcher
# refused them for real runs too).
REFUSED_FLAGS = {
    "--mock-data": "mock data",
    "--tokenizer-type=NullTokenizer": "the null tokenizer",
}


@dataclass(frozen=True)
class DataPaths:
    """Megatron indexed datasets (prefixes, without .bin/.idx) and the HuggingFace tokenizer directory."""

    train_prefix: Path
    valid_prefix: Path | None
    tokenizer_dir: Path


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path  # logs, TensorBoard events, the model config, the summary and plot
    save: Path | None  # checkpoints written here
    load: Path | None  # resume from here

    @property
    def layout(self) -> RunDir:
        return RunDir(self.run_dir)


def lower(recipe: Recipe, model: ModelConfig, data: DataPaths, run: RunPaths, backend: str) -> list[str]:
    """Megatron training flags for `recipe` training `model` on `data`, with layer backend `backend` ('te'|'local')."""
    if backend not in ("te", "local"):
        raise ValueError(f"backend must be resolved to 'te' or 'local' before lowering, got {backend!r}")
    layout = layout_of(model)
    mla, dsa, moe = model.mla, model.dsa, model.moe
    seq = model.seq_length
    # fmt: off
    args: list[str] = [
        # Model (cross-checked by the provider against the config file)
        "--hybrid-layer-pattern", layout.megatron_pattern,
        "--hidden-size", str(model.hidden_size),
        "--num-attention-heads", str(mla.num_heads),
        "--ffn-hidden-size", str(model.mtp.dense_ffn),
        "--seq-length", str(seq),
        "--max-position-embeddings", str(seq),
        "--position-embedding-type", "rope",
        "--rope-type", "rope",  # MLA's default is yarn
        "--rotary-base", str(int(model.rope_base)),
        "--normalization", "RMSNorm",
        # Megatron asks for Apex's persistent LayerNorm kernel by default; NAM56R's norms are TE's or,
        # on the local backend, torch's (WrappedTorchNorm), which refuse the flag.
        "--no-persist-layer-norm",
        "--norm-epsilon", str(model.norm_epsilon),
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0",
        "--init-method-std", str(model.init_std),
        "--multi-latent-attention",
        "--q-lora-rank", str(mla.q_lora_rank),
        "--kv-lora-rank", str(mla.kv_lora_rank),
        "--qk-head-dim", str(mla.qk_head_dim),
        "--qk-pos-emb-head-dim", str(mla.qk_rope_head_dim),
        "--v-head-dim", str(mla.v_head_dim),
        "--qk-layernorm",
        "--experimental-attention-variant", "dsa",
        "--no-rope-fusion",  # DSAttention rejects fused RoPE
        "--dsa-indexer-n-heads", str(dsa.indexer_heads),
        "--dsa-indexer-head-dim", str(dsa.indexer_head_dim),
        "--dsa-indexer-topk", str(dsa.topk),
        "--dsa-indexer-loss-coeff", str(dsa.indexer_loss_coeff),
        "--num-experts", str(moe.num_experts),
        "--moe-router-topk", str(moe.topk),
        "--moe-ffn-hidden-size", str(moe.expert_ffn),
        "--moe-router-score-function", moe.score_function,
        "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-aux-loss-coeff", str(moe.aux_loss_coeff),
        "--moe-router-dtype", "fp32",
        "--moe-token-dispatcher-type", "alltoall",
        "--make-vocab-size-divisible-by", "128",
        # Parallelism and batch
        "--tensor-model-parallel-size", str(recipe.tp),
        "--pipeline-model-parallel-size", str(recipe.pp),
        "--expert-model-parallel-size", str(recipe.ep),
        "--micro-batch-size", str(recipe.micro_batch),
        "--global-batch-size", str(recipe.global_batch),
        "--train-iters", str(recipe.steps),
        # Optimizer and schedule
        "--optimizer", "adam",
        "--lr", str(recipe.lr),
        "--min-lr", str(recipe.min_lr),
        "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(recipe.warmup_steps),
        "--weight-decay", str(recipe.weight_decay),
        "--adam-beta1", str(recipe.adam_beta1),
        "--adam-beta2", str(recipe.adam_beta2),
        "--clip-grad", str(recipe.clip_grad),
        "--seed", str(recipe.seed),
        "--bf16",
        "--transformer-impl", "transformer_engine" if backend == "te" else "local",
        # Data
        "--train-data-path", str(data.train_prefix),
        "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(data.tokenizer_dir),
        "--num-workers", str(recipe.num_workers),
        "--data-cache-path", str(run.layout.dataset_cache),  # not beside the data, which may be read-only
        # Logging
        "--log-interval", str(recipe.log_interval),
        "--tensorboard-dir", str(run.layout.tensorboard),
        "--log-timers-to-tensorboard",
        "--log-memory-to-tensorboard",
        "--log-validation-ppl-to-tensorboard",
        "--log-world-size-to-tensorboard",
        "--timing-log-level", "0",
        # Checkpoints: Megatron's distributed checkpointing
        "--ckpt-format", "torch_dist",
        "--save-interval", str(recipe.save_interval),
    ]
    # fmt: on
    if moe.shared_expert_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(moe.shared_expert_ffn)]
    if moe.expert_bias:
        args += ["--moe-router-enable-expert-bias"]
    if dsa.sparse_indexer_loss:
        args += ["--dsa-indexer-use-sparse-loss"]
    if not dsa.rotate_activation:
        args += ["--no-dsa-indexer-rotate-activation"]  # Megatron's default rotates
    if data.valid_prefix is not None:
        args += [
            "--valid-data-path",
            str(data.valid_prefix),
            "--eval-interval",
            str(recipe.eval_interval),
            "--eval-iters",
            str(recipe.eval_iters),
        ]
    else:
        args += ["--eval-iters", "0"]
    if recipe.data_parallel > 1:
        args += ["--use-distributed-optimizer"]
    if backend == "local":
        # Gradient-accumulation fusion needs APEX's or TE's fused wgrad kernels; the local layers have neither.
        args += ["--no-gradient-accumulation-fusion"]
    if recipe.precision == "fp8-tensorwise":
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    if recipe.cuda_graphs:
        args += ["--cuda-graph-impl", "transformer_engine"]
    if run.save is not None:
        args += ["--save", str(run.save)]
    if run.load is not None:
        args += ["--load", str(run.load), "--exit-on-missing-checkpoint"]
    if recipe.fused_linear_ce:
        args += ["--fused-linear-cross-entropy"]  # TransformerConfig field from Megatron patch 0007
    args += ["--nam56r-model-config", str(run.layout.model_config), "--nam56r-backend", backend]
    return args


def add_nam56r_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our flags on Megatron's parser (its `extra_args_provider`)."""
    group = parser.add_argument_group("nam56r")
    group.add_argument("--nam56r-model-config", required=True, help="the ModelConfig JSON the launcher wrote")
    group.add_argument("--nam56r-backend", choices=("te", "local"), required=True)
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
    """Megatron's MLATransformerConfig derived from parsed flags, as `pretrain` derives it."""
    import contextlib
    import io

    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.training.arguments import core_transformer_config_from_args

    with contextlib.redirect_stdout(io.StringIO()):
        return core_transformer_config_from_args(args, MLATransformerConfig)


def architecture_mismatches(model: ModelConfig, megatron_cfg) -> list[str]:
    """Fields where the config Megatron derives from our flags differs from the one NAM56R defines
    (`nam56r.model.model.megatron_config_fields`, runtime fields excluded). Empty when the lowering is complete."""
    from nam56r.model.model import RUNTIME_FIELDS, megatron_config_fields

    ours = megatron_config_fields(model)
    return [
        f"{name}: flags give {getattr(megatron_cfg, name)!r}, NAM56R defines {value!r}"
        for name, value in sorted(ours.items())
        if name not in RUNTIME_FIELDS and getattr(megatron_cfg, name) != value
    ]
