"""GPU: `python -m nam56r.train` end to end on the tiny recipe: the loss falls on the default data,
a run resumed from its step-20 checkpoint repeats the uninterrupted run's steps 21-40 within
noise, and (with two GPUs) expert parallel 2 really runs on two ranks. Each prints a sentinel line
with its figures for the validation manifest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper): the training step runs the CUDA kernels"),
]

ROOT = Path(__file__).resolve().parents[2]
STEPS, RESUME_AT = 40, 20


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from nam56r.data import CorpusConfig, build, torch_include_dir

    out = tmp_path_factory.mktemp("data") / "cpp"
    build(out, 512, CorpusConfig(sources=(torch_include_dir(),), max_docs=600))
    return out


def _train(*args: str) -> None:
    cmd = [sys.executable, "-m", "nam56r.train", "--recipe", "tiny-1gpu", "--warmup", "4", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["lm loss"] for row in rows if row.get("lm loss") is not None}


def test_tiny_run_loss_falls_and_resume_repeats_the_curve(megatron_built, tiny_data, tmp_path) -> None:
    from nam56r.runlog import compare_loss_curves

    full = tmp_path / "full"
    _train("--steps", str(STEPS), "--save-interval", str(RESUME_AT), "--data", str(tiny_data), "--run-dir", str(full))
    losses = _losses(full)
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < 0.8 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"

    resumed = tmp_path / "resumed"
    _train(
        "--steps",
        str(STEPS),
        "--save-interval",
        str(STEPS),
        "--data",
        str(tiny_data),
        "--run-dir",
        str(resumed),
        "--load",
        str(full / "checkpoints"),
        "--save",
        str(resumed / "checkpoints"),
        "--",
        "--ckpt-step",
        str(RESUME_AT),
    )
    resumed_losses = _losses(resumed)
    assert min(resumed_losses) == RESUME_AT + 1, "the resumed run did not start after its checkpoint"
    diff = compare_loss_curves(sorted(losses.items()), sorted(resumed_losses.items()), range(RESUME_AT + 1, STEPS + 1))
    assert diff < 0.02, f"resumed steps {RESUME_AT + 1}-{STEPS} differ from the uninterrupted run by up to {diff:.4f}"
    summary = json.loads((full / "summary.json").read_text())
    print(
        f"TINY_TRAIN_RESUME_OK gpu={torch.cuda.get_device_name()} first5={first:.3f} last5={last:.3f} "
        f"resume_max_abs_diff={diff:.5f} summary={json.dumps(summary, sort_keys=True)}"
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for expert parallel 2")
def test_two_gpu_expert_parallel_run_is_distributed(megatron_built, tiny_data, tmp_path) -> None:
    run = tmp_path / "ep2"
    _train("--gpus-per-node", "2", "--ep", "2", "--steps", "20", "--data", str(tiny_data), "--run-dir", str(run))
    rank_logs = sorted(p for p in (run / "logs").rglob("stdout.log"))
    assert len(rank_logs) == 2, f"expected one log per rank, found {rank_logs}"
    assert all(p.stat().st_size > 0 for p in rank_logs)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    print(f"EP2_DISTRIBUTED_OK gpus={torch.cuda.device_count()} logs={[str(p.relative_to(run)) for p in rank_logs]}")
