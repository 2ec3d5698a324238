"""A recipe's DSA phases: a dense warm-up for the first N steps, then sparse (`nam56r.model.dsa_warmup`
says what each phase computes and why).

Steps are Megatron's, numbered from 1: step `s` is the one Megatron runs with `args.curr_iteration ==
s - 1`. The phase of a step is a function of that number alone, so nothing of ours is counted or
saved: a run resumed with `--load` continues from the iteration Megatron reads from the checkpoint and
is in the phase of its next step. Resumed at iteration k < N, it finishes the warm-up and switches at
step N + 1; resumed at k >= N, it is sparse from its first step.

`PhaseSwitch` is the per-rank part: the forward step (`nam56r.training.launcher.pretrain.forward_step`) hands it
the model and Megatron's current step; it sets the DSA layers when the phase differs from the one they
are in and logs each change (the first step of a run, and the switch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nam56r.model.dsa_warmup import DsaPhase, apply_dsa_phase
from nam56r.training.settings import setting

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DsaPhases:
    """Steps 1..dense_warmup_steps are the dense warm-up; later steps are sparse. 0: sparse from step 1."""

    dense_warmup_steps: int = setting(
        0, cli="--dense-warmup-steps", metavar="N",
        help="DSA phases: steps 1..N attend every causal key while the indexer learns Megatron's dense KL, later steps "
             "attend the indexer's top-k (0: sparse from the first step; below --steps). Megatron's step number decides "
             "the phase, so a resumed run continues in its own")

    def phase_at(self, step: int) -> DsaPhase:
        """The phase of Megatron's step `step` (1-based)."""
        if step < 1:
            raise ValueError(f"steps are numbered from 1, got {step}")
        return "dense-warmup" if step <= self.dense_warmup_steps else "sparse"

    def problems(self, train_steps: int) -> list[str]:
        """What is wrong with this schedule for a run of `train_steps` steps; empty when nothing is."""
        n = self.dense_warmup_steps
        if n < 0:
            return [f"dense_warmup_steps must be >= 0 (0: sparse from the first step), got {n} (set it with --dense-warmup-steps)"]
        if n and n >= train_steps:
            return [
                f"dense_warmup_steps {n} must be below steps {train_steps}: the run would end in the dense warm-up and never "
                "train sparse; lower --dense-warmup-steps (0 turns the warm-up off) or raise --steps"
            ]
        return []

    def describe(self) -> str:
        n = self.dense_warmup_steps
        return f"dense warm-up steps 1-{n}, sparse from step {n + 1}" if n else "sparse from step 1 (no dense warm-up)"


@dataclass
class PhaseSwitch:
    """Puts a model's DSA layers in the phase of Megatron's current step; `log` gets one line per change."""

    phases: DsaPhases
    seq_length: int
    log: Callable[[str], None] = print
    _applied: dict[int, DsaPhase] = field(default_factory=dict)  # id(model chunk) -> the phase it was set to

    def enter(self, model: torch.nn.Module, step: int) -> DsaPhase:
        """Set `model` (a model chunk as Megatron's forward step gets it) for `step`; returns the phase."""
        phase = self.phases.phase_at(step)
        previous = self._applied.get(id(model))
        if previous != phase:
            layers = apply_dsa_phase(model, phase, self.seq_length)
            self._applied[id(model)] = phase
            what = (
                f"dense warm-up (every causal key of {self.seq_length} attended, the indexer trained by Megatron's dense KL) "
                f"until step {self.phases.dense_warmup_steps}"
                if phase == "dense-warmup"
                else "sparse (the indexer's top-k attended, top-k KL)"
            )
            verb = "starts in" if previous is None else "switches to"
            self.log(f"DSA phase: step {step} {verb} {phase}: {what}; {layers} DSA layer(s) set")
        return phase
