"""A run directory as `python -m nam56r.training.launcher` leaves one, without training: the launcher's own run
files (model_config.json, recipe.json, command.sh), TensorBoard events under Megatron's tag names and
wall times, then the launcher's own end-of-run summary (metrics.jsonl, summary.json, the plot)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from nam56r.training.launcher.flags import RunPaths
from nam56r.training.launcher.train import _summarize, _write_run_files
from nam56r.training.recipe import RECIPES, Recipe
from nam56r.training.settings import with_overrides

COMMAND = "torchrun --nproc-per-node 1 -m nam56r.training.launcher.pretrain --train-iters {steps}"


def lm_loss(step: int) -> float:
    return 6.0 - 0.1 * step


def write_train_run(run_dir: Path, steps: range, recipe_steps: int = 20, loss: Callable[[int], float] = lm_loss,
                    first_step_after_s: float = 42.0, recipe_name: str = "tiny-1gpu", reference: bool = False,
                    valid_loss: Callable[[int], float] | None = None, valid_every: int = 10) -> Recipe:
    """Events for `steps` of the recipe (run for `recipe_steps`; with `reference`, its reference GPT's run), the first
    loss logged `first_step_after_s` after the TensorBoard writer was made (as Megatron makes it at initialization);
    with `valid_loss`, an evaluation every `valid_every` steps."""
    from torch.utils.tensorboard import SummaryWriter

    # The recipe as defined, not get_recipe's checked one: its fused-kernel check imports Megatron (seconds), beside the point here.
    recipe = with_overrides(RECIPES[recipe_name](), {"steps": recipe_steps})
    recipe = recipe.as_reference() if reference else recipe
    model = recipe.trained_model()
    run = RunPaths(run_dir=run_dir, save=run_dir / "checkpoints", load=None)
    _write_run_files(run, model, recipe, COMMAND.format(steps=recipe_steps))
    writer = SummaryWriter(log_dir=str(run.layout.tensorboard))
    start = time.time()
    for index, step in enumerate(steps):
        wall = start + first_step_after_s + 0.5 * index
        for tag, value in (("batch-size", recipe.batch.global_batch), ("lm loss", loss(step)), ("world-size", recipe.world_size),
                           ("mem-max-allocated-bytes", 2**30 * (3 + step % 2))):
            writer.add_scalar(tag, value, step, walltime=wall)
        if valid_loss is not None and step % valid_every == 0:
            writer.add_scalar("lm loss validation", valid_loss(step), step, walltime=wall)
        if index > 0:  # Megatron logs no iteration time at a run's first iteration
            writer.add_scalar("iteration-time", 0.5, step, walltime=wall)
    writer.close()
    _summarize(run, model, recipe)
    return recipe
