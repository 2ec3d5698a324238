"""The layout of one training run's directory (`--run-dir`, default runs/<recipe>-<time>/): every path inside
it comes from `RunDir`, for the launcher that writes it and the readers (the run summary, train records, the resume
check, the benches) alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def command(self) -> Path:
        """The exact launch command (shell), written at launch."""
        return self.path / "command.sh"

    @property
    def recipe(self) -> Path:
        """The recipe as run (JSON), written at launch."""
        return self.path / "recipe.json"

    @property
    def model_config(self) -> Path:
        """NAM56R's ModelConfig as trained (JSON), written at launch; the ranks build the model from it."""
        return self.path / "model_config.json"

    @property
    def logs(self) -> Path:
        """torchrun's per-rank logs."""
        return self.path / "logs"

    def launch_gate(self, node_rank: int) -> Path:
        """The verdict of node `node_rank`'s launcher for the ranks it started (`nam56r.training.launcher.launch_gate`): one
        file per node, as each node's launcher gates its own ranks and the run directory may be shared."""
        return self.path / f"launch-node{node_rank}.gate"

    @property
    def tensorboard(self) -> Path:
        """Megatron's TensorBoard events."""
        return self.path / "tensorboard"

    @property
    def torch_profile(self) -> Path:
        """Megatron's PyTorch-profiler traces (`--use-pytorch-profiler`): `rank-<r>.json.gz`, which it writes to
        `<--tensorboard-dir>/../torch_profile`, i.e. here beside `tensorboard`."""
        return self.tensorboard.parent / "torch_profile"

    @property
    def dataset_cache(self) -> Path:
        """Megatron's dataset index cache, kept here since the data may be read-only."""
        return self.path / "dataset-cache"

    @property
    def checkpoints(self) -> Path:
        """Where a run saves when `--save` names no other place."""
        return self.path / "checkpoints"

    @property
    def metrics(self) -> Path:
        """Per-step scalars, tokens/s/GPU and TFLOP/s/GPU (JSON lines), written by the summary."""
        return self.path / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        """The run's headline figures over its steady-state window (JSON)."""
        return self.path / "summary.json"

    @property
    def plot(self) -> Path:
        """Loss and throughput per step (PNG)."""
        return self.path / "loss_throughput.png"
