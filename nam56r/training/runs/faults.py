"""How a training process stops when the run cannot go on: a checkpoint save that fails, a loss
that turns NaN/Inf. Each stop names the step, what went wrong, the last complete checkpoint and
the way on; nothing already saved is touched.

The policy for a non-finite loss is to stop, never to skip the batch: a skipped step changes the
run silently, and the last checkpoint is the point to resume from once the cause is known.
`--nam56r-nonfinite-loss-at-step N` plants a NaN loss at step N, to test that stop end to end.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's name, written last by a complete save
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
MIB = 1 << 20
RUN_STOPPED_EXIT = 3  # a training process that stops with RunStopped exits with this code


def iteration_checkpoint(save_dir: str | Path, iteration: int) -> Path:
    """Megatron's directory for the checkpoint of `iteration` under `save_dir`."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def tracked_checkpoint(save_dir: str | Path) -> Path | None:
    """The checkpoint directory Megatron's tracker in `save_dir` names (whether or not it exists), or None when there
    is no readable tracker holding an iteration."""
    tracker = Path(save_dir) / TRACKER
    text = tracker.read_text().strip() if tracker.is_file() else ""
    return iteration_checkpoint(save_dir, int(text)) if text.isdigit() else None


class RunStopped(RuntimeError):
    """The run cannot go on; the message says why and how to resume."""


class NonFiniteLoss(RunStopped, FloatingPointError):
    pass


class CheckpointSaveFailed(RunStopped):
    pass


def last_complete_checkpoint(save_dir: str | Path | None) -> str:
    """What a resume from `save_dir` loads, in words: Megatron's tracker names the last save that finished."""
    if not save_dir:
        return "none: this run saves no checkpoints (no --save)"
    tracker = Path(save_dir) / TRACKER
    try:
        text = tracker.read_text().strip()
    except FileNotFoundError:
        return f"none yet in {save_dir} (no {TRACKER})"
    except OSError as exc:
        return f"unknown: {tracker} is unreadable ({exc})"
    if not text:
        return f"unknown: {tracker} is empty"
    return f"iteration {text} in {save_dir} (resume with `--load {save_dir}`)"


def nonfinite_loss_message(loss: float, step: int | None, rank: int, save_dir: str | Path | None) -> str:
    where = f"at step {step}" if step is not None else "outside a training step"
    return (
        f"the loss is {loss} {where} (rank {rank}); the run stops rather than skip the batch. "
        f"Last complete checkpoint: {last_complete_checkpoint(save_dir)}. Look for the cause (a too-high "
        f"learning rate, bad data at this step, a kernel) before resuming; a resume replays the same batches."
    )


def _disk_errno(exc: BaseException) -> int | None:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_ERRNOS:
            return current.errno
        todo += [current.__cause__, current.__context__]
    return None


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def save_failure_message(exc: BaseException, iteration: int, save_dir: str | Path) -> str:
    """Why the save of `iteration` into `save_dir` failed, as far as the filesystem tells, and what to do."""
    save_dir = Path(save_dir)
    partial = iteration_checkpoint(save_dir, iteration)
    free = shutil.disk_usage(save_dir).free if save_dir.exists() else None
    last = last_complete_checkpoint(save_dir)
    previous = tracked_checkpoint(save_dir)
    needed = _bytes_under(previous) if previous is not None else 0
    code = _disk_errno(exc)
    if code is not None or (free is not None and (free < 64 * MIB or free < needed)):
        why = f"{errno.errorcode.get(code, 'out of space')}: " if code is not None else ""
        cause = (
            f"the disk is full ({why}{free / MIB:.0f} MiB free on {save_dir}'s filesystem"
            + (f", the last checkpoint takes {needed / MIB:.0f} MiB)" if needed else ")")
        )
        fix = "free space there or pass a --save directory on a larger filesystem, then resume"
    else:
        cause = f"{type(exc).__name__}: {exc}"
        fix = "fix the cause above, then resume"
    return (
        f"checkpoint save of iteration {iteration} to {save_dir} failed: {cause}. "
        f"Last complete checkpoint: {last}. The partial {partial} is never loaded (the tracker is written "
        f"last); delete it to reclaim its space. To go on: {fix}."
    )


@contextlib.contextmanager
def explain_save_failures(save_dir: str | Path | None) -> Iterator[None]:
    """While inside, a failing Megatron `save_checkpoint` raises CheckpointSaveFailed (from the original
    error) naming the iteration, the cause and the last complete checkpoint. Megatron's training loop
    calls the function through two module attributes; both are wrapped, and restored on exit."""
    from megatron.training import checkpointing, training

    original: Callable = checkpointing.save_checkpoint

    @functools.wraps(original)
    def save_checkpoint(iteration, *args, **kwargs):
        try:
            return original(iteration, *args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) or not save_dir:
                raise
            raise CheckpointSaveFailed(save_failure_message(exc, int(iteration), save_dir)) from exc

    owners = [module for module in (checkpointing, training) if getattr(module, "save_checkpoint", None) is original]
    for module in owners:
        module.save_checkpoint = save_checkpoint
    try:
        yield
    finally:
        for module in owners:
            module.save_checkpoint = original


def planted_nonfinite(step: int, plant_at_step: int | None) -> float:
    """The factor a loss is multiplied by: NaN at the planted step, else 1."""
    return math.nan if plant_at_step is not None and step == plant_at_step else 1.0
