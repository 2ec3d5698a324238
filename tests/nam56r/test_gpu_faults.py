"""GPU: faults in a real tiny training run (`python -m nam56r.training.launcher`, Megatron's `pretrain`).

A SIGKILL while a checkpoint is being written leaves the last complete checkpoint as the one that
loads: Megatron writes `latest_checkpointed_iteration.txt` after the checkpoint's files, and the run
resumed from it repeats the killed run's steps. A loss planted NaN at one step stops the run there,
naming the step and the last complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper): the training step runs the CUDA kernels"),
]

RECIPE, STEPS, SAVE_EVERY = "tiny-1gpu", 20, 5
KILLED_AT = 2 * SAVE_EVERY  # killed while writing this checkpoint
TRACKER = "latest_checkpointed_iteration.txt"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from nam56r.training.recipe import get_recipe
    from nam56r.training.runs.resume_check import build_tiny_data

    return build_tiny_data(tmp_path_factory.mktemp("data") / "cpp", get_recipe(RECIPE).model_config().vocab_size)


def _train_command(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nam56r.training.launcher", "--recipe", RECIPE, "--warmup", "4", "--steps", str(STEPS),
            "--data", str(data), "--run-dir", str(run_dir), *extra]


def _kill_when_written(command: list[str], log: Path, checkpoint_dir: Path, timeout_s: float = 900.0) -> dict:
    """Run `command` and SIGKILL it with every process under it (torchrun's ranks run in sessions of
    their own) the moment `checkpoint_dir` appears, that is while Megatron writes it; what the tracker
    and the directory held then, and the pids killed."""
    from nam56r.training.runs.logged_run import kill_tree

    killed: list[int] = []
    with log.open("w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        try:
            while not checkpoint_dir.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{' '.join(command)} ended (exit {proc.returncode}) before writing {checkpoint_dir}:\n"
                                         + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
                time.sleep(0.002)
            killed = kill_tree(proc.pid)
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.wait()
    tracker = checkpoint_dir.parent / TRACKER
    return {"exit_code": proc.returncode, "tracker": tracker.read_text().strip() if tracker.is_file() else None,
            "partial_files": sorted(p.name for p in checkpoint_dir.iterdir()), "killed": killed}


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists() and _state(pid) not in ("Z", "X")]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_a_kill_during_a_checkpoint_save_resumes_from_the_last_complete_checkpoint(megatron_built, tiny_data, tmp_path) -> None:
    from nam56r.training.runs.events import compare_loss_curves, logged_loss_curve, loss_curve
    from nam56r.training.runs.summary import resolve_tensorboard_dir

    killed_dir = tmp_path / "killed"
    checkpoints = killed_dir / "checkpoints"
    writing = checkpoints / f"iter_{KILLED_AT:07d}"
    killed_log = tmp_path / "killed.log"

    seen = _kill_when_written(_train_command(killed_dir, tiny_data, "--save-interval", str(SAVE_EVERY)), killed_log, writing)

    assert seen["exit_code"] == -signal.SIGKILL or seen["exit_code"] == 128 + signal.SIGKILL, seen
    assert len(seen["killed"]) >= 3, f"the launcher, torchrun and the rank: {seen}"
    assert seen["tracker"] == str(SAVE_EVERY), f"the tracker moved before {writing.name} was complete: {seen}"
    time.sleep(10)  # longer than the save takes: a rank that outlived the kill would have moved the tracker by now
    assert not _alive(seen["killed"]), f"processes of the killed run still alive: {_alive(seen['killed'])}"
    assert (checkpoints / TRACKER).read_text().strip() == str(SAVE_EVERY)

    resumed_dir = tmp_path / "resumed"
    resumed = subprocess.run(_train_command(resumed_dir, tiny_data, "--save-interval", str(STEPS), "--load", str(checkpoints),
                                            "--save", str(resumed_dir / "checkpoints")),
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
    log = resumed.stdout + resumed.stderr
    (tmp_path / "resumed.log").write_text(log)
    assert resumed.returncode == 0, "\n".join(log.splitlines()[-60:])

    # The killed run's TensorBoard events died unflushed: its curve comes from its log lines (steps from
    # the third on are per-step losses); the resumed run's, from its events.
    killed_curve = [(step, loss) for step, loss in logged_loss_curve(killed_log.read_text(errors="replace")) if step >= 3]
    resumed_curve = loss_curve(resolve_tensorboard_dir(resumed_dir))
    assert resumed_curve[0][0] == SAVE_EVERY + 1, f"the resumed run started at step {resumed_curve[0][0]}, not {SAVE_EVERY + 1}"
    assert resumed_curve[-1][0] == STEPS
    overlap = range(SAVE_EVERY + 1, max(step for step, _ in killed_curve) + 1)
    diff = compare_loss_curves(killed_curve, resumed_curve, overlap)
    assert len(overlap) >= SAVE_EVERY - 1 and diff < 0.02, f"steps {overlap.start}-{overlap.stop - 1} differ by up to {diff}"
    print(f"KILL_DURING_SAVE_OK gpu={torch.cuda.get_device_name()} killed_while_writing={writing.name}"
          f" partial_files={len(seen['partial_files'])} tracker={seen['tracker']} resumed_from={SAVE_EVERY}"
          f" compared_steps={overlap.start}-{overlap.stop - 1} max_abs_loss_diff={diff:.6f}")


def test_a_nonfinite_loss_stops_the_run_naming_the_step_and_the_last_checkpoint(megatron_built, tiny_data, tmp_path) -> None:
    from nam56r.training.runs.faults import RUN_STOPPED_EXIT

    nan_step = SAVE_EVERY + 3
    run_dir = tmp_path / "nan"
    command = _train_command(run_dir, tiny_data, "--save-interval", str(SAVE_EVERY), "--", "--nam56r-nonfinite-loss-at-step", str(nan_step))
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    rank_logs = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").rglob("*")) if p.is_file())
    log = done.stdout + done.stderr + rank_logs
    (tmp_path / "nan.log").write_text(log)
    assert done.returncode != 0, "the run went on past a NaN loss"
    checkpoints = run_dir / "checkpoints"
    expected = f"error: the loss is nan at step {nan_step} (rank 0)"
    assert expected in log, f"no `{expected}` line:\n" + "\n".join(log.splitlines()[-60:])
    assert f"Last complete checkpoint: iteration {SAVE_EVERY} in {checkpoints}" in log
    assert f"exitcode  : {RUN_STOPPED_EXIT}" in log or done.returncode == RUN_STOPPED_EXIT, log[-3000:]
    assert (checkpoints / TRACKER).read_text().strip() == str(SAVE_EVERY)
    line = next(x for x in log.splitlines() if expected in x)
    print(f"NONFINITE_LOSS_STOP_OK gpu={torch.cuda.get_device_name()} exit={done.returncode} message={line.strip()[:240]!r}")
