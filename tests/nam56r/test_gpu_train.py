"""GPU: `python -m nam56r.training.launcher` end to end on the tiny recipe: the loss falls on a small corpus, a
run resumed from its step-20 checkpoint repeats the uninterrupted run's steps 21-40 within noise
(nam56r.training.runs.resume_check, which `python -m nam56r.training.gpu_check` runs at 20 steps resumed from 10, and
deselects this test for), and (with two GPUs) expert parallel 2 really runs on two ranks. Each prints
a sentinel line with its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper): the training step runs the CUDA kernels"),
]

STEPS, RESUME_AT = 40, 20
RECIPE = "tiny-1gpu"


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from nam56r.training.recipe import get_recipe
    from nam56r.training.runs.resume_check import build_tiny_data

    return build_tiny_data(tmp_path_factory.mktemp("data") / "cpp", get_recipe(RECIPE).model_config().vocab_size)


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["lm loss"] for row in rows if row.get("lm loss") is not None}


def test_tiny_run_loss_falls_and_resume_repeats_the_curve(megatron_built, tiny_data, tmp_path) -> None:
    from nam56r.training.runs.resume_check import ResumeCheck, run_resume_check

    result = run_resume_check(ResumeCheck(recipe=RECIPE, steps=STEPS, resume_at=RESUME_AT), tmp_path, tiny_data, echo=False)

    assert result.ok, "\n".join(result.problems)
    full = result.runs[0]
    losses = _losses(full.run_dir)
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < 0.8 * first, f"loss did not fall: {first:.3f} -> {last:.3f}"
    print(
        f"TINY_TRAIN_RESUME_OK gpu={torch.cuda.get_device_name()} first5={first:.3f} last5={last:.3f} "
        f"resume_max_abs_diff={result.max_abs_loss_diff:.5f} summary={json.dumps(full.summary(), sort_keys=True)}"
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for expert parallel 2")
def test_two_gpu_expert_parallel_run_is_distributed(megatron_built, tiny_data, tmp_path) -> None:
    from nam56r.training.runs.resume_check import train_run

    run = tmp_path / "ep2"
    launch = train_run("ep2", run, ["--recipe", RECIPE, "--warmup", "4", "--gpus-per-node", "2", "--ep", "2", "--steps", "20",
                                    "--data", str(tiny_data)], timeout_s=900, echo=False)
    assert launch.exit_code == 0, f"{' '.join(launch.command)} failed:\n{launch.tail(80)}"
    rank_logs = sorted(p for p in (run / "logs").rglob("stdout.log"))
    assert len(rank_logs) == 2, f"expected one log per rank, found {rank_logs}"
    assert all(p.stat().st_size > 0 for p in rank_logs)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    print(f"EP2_DISTRIBUTED_OK gpus={torch.cuda.device_count()} logs={[str(p.relative_to(run)) for p in rank_logs]}")
