"""Whether the checkpoint a run resumes from can be read at the run's expert-parallel size, checked by the launcher
before any rank loads it. Megatron's own failures there come after the model is built, as a KeyError deep in the
optimizer's load (`KeyError: 'optimizer'`, or the patch-0018 `KeyError: 'step'`).

Two rules, from how Megatron's distributed optimizer lays out its state:
- At EP > 1 the expert parameters have an optimizer of their own; at EP = 1 they are in the dense parameters' one
  (`param.allreduce`, `get_megatron_optimizer`). A checkpoint does not cross between EP = 1 and EP > 1.
- Between two EP sizes above 1 the optimizer state moves only in a fully reshardable format (saved with
  `--reshardable-ckpt on`, Megatron's `--dist-ckpt-optim-fully-reshardable`). The default, dp_reshardable, holds
  each rank's buffers as they lie, and resumes at its own EP size (and another data-parallel size).

Neither rule applies when the optimizer state is not loaded (`--no-load-optim`, `--finetune`): the model's weights
move between EP sizes in every format.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nam56r.training.runs.faults import iteration_checkpoint, tracked_checkpoint


@dataclass(frozen=True)
class SavedLayout:
    """What a Megatron torch_dist checkpoint says of the layout it was saved at."""

    path: Path  # the iteration's directory
    expert_parallel: int
    distributed_optimizer: bool
    optimizer_sharding: str | None  # content metadata's distrib_optim_sharding_type (None: not recorded)


def iteration_to_load(load: Path, step: int | None) -> Path | None:
    """The directory a resume from `load` reads: iteration `step` (Megatron's --ckpt-step), else the one its tracker
    names; None when `load` holds neither (Megatron's --exit-on-missing-checkpoint reports that)."""
    path = iteration_checkpoint(load, step) if step is not None else tracked_checkpoint(load)
    return path if path is not None and path.is_dir() else None


def read_saved_layout(path: Path) -> SavedLayout:
    """The layout recorded in the checkpoint at `path` (its common state: the saving run's Megatron args and the
    content metadata), read on the host through Megatron's own loader."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict, load_content_metadata

    common = load_common_state_dict(str(path))
    args = common.get("args")
    if args is None:
        raise ValueError(f"{path} holds no saved Megatron args: not a checkpoint written by Megatron's training loop")
    metadata = load_content_metadata(preloaded_state_dict=common) or {}
    return SavedLayout(path=path, expert_parallel=int(getattr(args, "expert_model_parallel_size", 1)),
                       distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
                       optimizer_sharding=metadata.get("distrib_optim_sharding_type"))


def resume_problems(saved: SavedLayout, expert_parallel: int, loads_optimizer: bool) -> list[str]:
    """Why the run at `expert_parallel` cannot load the optimizer state of `saved`; [] when it can."""
    if not loads_optimizer or saved.expert_parallel == expert_parallel:
        return []
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    at = f"{saved.path} was saved at expert-parallel size {saved.expert_parallel}; this run is at {expert_parallel}"
    if (saved.expert_parallel == 1) != (expert_parallel == 1):
        return [f"{at}. Megatron keeps the expert parameters' optimizer state in the dense parameters' optimizer at "
                "EP=1 and in one of their own above it, so the state does not cross between the two: resume at EP "
                f"{'above 1' if saved.expert_parallel > 1 else '1'}, or pass `-- --no-load-optim` to start a fresh optimizer"]
    reshardable = DistributedOptimizer.checkpoint_fully_reshardable_formats
    if saved.distributed_optimizer and saved.optimizer_sharding not in reshardable:
        return [f"{at}. Its optimizer state is {saved.optimizer_sharding or 'in an unrecorded format'}, which holds "
                f"each rank's buffers and resumes only at EP={saved.expert_parallel}: resume at that size, or save with "
                "--reshardable-ckpt on to move between EP sizes, or pass `-- --no-load-optim` to start a fresh optimizer"]
    return []


def check_resume(margs) -> str | None:
    """The resume check over Megatron's parsed args (`--load`, `--ckpt-step`, `--no-load-optim`, `--finetune`, the
    run's EP size): None when the run resumes from nothing; else a line saying what it loads. Raises ValueError
    naming the problem when the checkpoint cannot be loaded at this layout."""
    if not margs.load:
        return None
    path = iteration_to_load(Path(margs.load), margs.ckpt_step)
    if path is None:
        return f"{margs.load} holds no checkpoint to check (Megatron exits at load: --exit-on-missing-checkpoint)"
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        saved = read_saved_layout(path)
    except (CheckpointingException, OSError, RuntimeError) as exc:
        raise ValueError(f"cannot read the saved layout of {path}: {type(exc).__name__}: {exc}") from exc
    loads_optimizer = not (margs.no_load_optim or margs.finetune)
    if problems := resume_problems(saved, margs.expert_model_parallel_size, loads_optimizer):
        raise ValueError("; ".join(problems))
    return (f"{path}: saved at EP={saved.expert_parallel}, optimizer state "
            f"{saved.optimizer_sharding or 'not distributed'}; loads at EP={margs.expert_model_parallel_size}"
            + ("" if loads_optimizer else " (weights only: --no-load-optim or --finetune)"))
