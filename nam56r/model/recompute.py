"""Activation recompute for the one NAM56R module Megatron has no hook for: the Mamba-3 mixer.

Megatron core_v0.19.0 recomputes attention and MoE submodules selectively (`--recompute-granularity selective
--recompute-modules ...`, read by `Attention`, `MLASelfAttention`, `AbsorbedMLASelfAttention` and `MoELayer`) and
whole layers of every family at once under `--recompute-granularity full` (`HybridStack.forward` ->
`megatron.core.recompute.checkpointed_forward`), but nothing inside a Mamba layer alone: `MambaLayer` reads no
recompute setting, and mamba_ssm's `Mamba3` has no checkpoint option. `checkpointed` is what `Mamba3Mixer` runs
`Mamba3` through when `Mamba3Config.recompute` is on: the mixer's input is kept, and its projections, the
scan kernel's saved tensors and the gate are recomputed in the backward.

It is torch's non-reentrant checkpoint, not Megatron's reentrant `tensor_parallel.checkpoint`: the non-reentrant
one keeps parameter gradients even when no input requires grad, and it runs on CPU (Megatron's reads the CUDA
generator's state unconditionally), so the numerics test runs on any machine. The random state is handled as
Megatron's checkpoint handles it: torch restores the CPU and CUDA default generators for the recompute
(`preserve_rng_state`), and Megatron's CUDA RNG tracker (the model-parallel streams its dropouts fork) is set
back to its state at the forward here, as `tensor_parallel.random._set_all_rng_states` does. Mamba-3 draws no
random numbers in its forward (its one `torch.rand` initializes dt_bias), so this guards the next mixer, not
this one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, keeping only its inputs for the backward and recomputing the rest there."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=_rng_tracker_contexts, **kwargs)


def _rng_tracker_contexts() -> tuple[Any, Any]:
    """(forward context, recompute context): the recompute sees Megatron's RNG tracker as the forward saw it."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if not tracker.is_initialized():
        return nullcontext(), nullcontext()
    return nullcontext(), _tracker_states(tracker, tracker.get_states())


@contextmanager
def _tracker_states(tracker: Any, states: dict[str, torch.Tensor]) -> Iterator[None]:
    current = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(current)
