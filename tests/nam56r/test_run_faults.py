"""Faults during a training run, on CPU with Megatron's own checkpointing (`checkpoint_worker.py`
drives the real `save_checkpoint` / `load_checkpoint` on the tiny recipe's model and optimizer):

- the tracker `latest_checkpointed_iteration.txt` is the last file a save writes;
- a SIGKILL before the checkpoint's metadata, or between the tracker's open and its write, leaves the
  previous checkpoint as the one that loads (Megatron patch 0012 makes the tracker's write atomic);
- a full disk during a save stops the run with a message naming the cause and the last complete
  checkpoint, which still loads;
- a NaN loss stops the run naming the step and the last complete checkpoint;
- the distributed optimizer's checkpoint round trip holds on the local backend with the parameters
  NAM56R keeps in fp32 (Megatron patches 0013-0015: the index of each parameter's optimizer state,
  the state dict of a fresh optimizer without Apex/TE, the dp_reshardable load into fp32 parameters).

The GPU twin (`test_gpu_faults.py`) kills a whole `nam56r.training.launcher` run during a save and resumes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from nam56r.training.runs.faults import iteration_checkpoint, tracked_checkpoint

WORKER = Path(__file__).with_name("checkpoint_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TRACKER = "latest_checkpointed_iteration.txt"


def _worker(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the worker in a session of its own and kill what it leaves: Megatron's checkpoint writer
    starts multiprocessing helpers that outlive a SIGKILLed parent (and would hold its pipes open)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, str(WORKER), *args], cwd=ROOT, stdout=out, stderr=err, text=True,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def _records(out: str, tag: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith(tag + " ")]


def _tail(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def saved_then_killed(megatron_built, tmp_path_factory) -> dict:
    """Three runs of two saves each: one complete with every open logged, and two killed in the second
    save (before its metadata is opened; after the tracker is opened, before it is written). Then one
    fresh process loads each directory."""
    root = tmp_path_factory.mktemp("checkpoints")
    complete = _worker("save", "--save", str(root / "complete"), "--iterations", "1", "2", "--log-opens", str(root / "opens.log"))
    assert complete.returncode == 0, _tail(complete)
    kill_points = {"metadata": ("--kill-at-open", "iter_0000002/.metadata*"), "tracker": ("--kill-at-write", f"{TRACKER}*")}
    killed = {name: _worker("save", "--save", str(root / name), "--iterations", "1", "2", *kill) for name, kill in kill_points.items()}
    loaded = _worker("load", *(str(root / name) for name in ("complete", *killed)))
    return {
        "root": root, "complete": complete, "killed": killed,
        "loaded": {Path(r["dir"]).name: r for r in _records(loaded.stdout, "LOADED")},
        "load_failed": _records(loaded.stdout, "LOAD_FAILED"),
        "saved": {r["iteration"]: r["checksum"] for r in _records(complete.stdout, "SAVED")},
    }


def test_the_tracker_is_the_last_file_a_save_writes(saved_then_killed) -> None:
    root = saved_then_killed["root"]
    opens = (root / "opens.log").read_text().splitlines()
    second = opens[opens.index(next(p for p in opens if p.startswith("iter_0000002/"))):]
    assert second[-1].startswith(TRACKER), f"the last write of the save is {second[-1]}, not the tracker: {second}"
    files = {str(p.relative_to(root / "complete")) for p in (root / "complete" / "iter_0000002").iterdir()}
    written_before_tracker = {p.replace(".metadata.tmp", ".metadata") for p in second[:-1]}
    assert files <= written_before_tracker, f"files of iter_0000002 not written before the tracker: {files - written_before_tracker}"
    assert (root / "complete" / TRACKER).read_text().strip() == "2"
    assert tracked_checkpoint(root / "complete") == iteration_checkpoint(root / "complete", 2) == root / "complete" / "iter_0000002"


@pytest.mark.parametrize("iteration", [1, 10, 1234567, 12345678])
def test_the_checkpoint_directory_is_megatrons_iter_name(megatron_built, tmp_path, iteration) -> None:
    """The resume check and the saved-layout probe find checkpoints by Megatron's `iter_%07d` directory name."""
    from megatron.training.checkpointing import get_checkpoint_name

    megatron_dir = Path(get_checkpoint_name(str(tmp_path), iteration, return_base_dir=True))
    assert iteration_checkpoint(tmp_path, iteration) == megatron_dir
    assert megatron_dir.name == f"iter_{iteration:07d}"
    (tmp_path / TRACKER).write_text(f"{iteration}\n")
    assert tracked_checkpoint(tmp_path) == megatron_dir


def test_the_checkpoint_of_iteration_10_is_iter_0000010(tmp_path) -> None:
    assert iteration_checkpoint(tmp_path, 10) == tmp_path / "iter_0000010"
    (tmp_path / TRACKER).write_text("10\n")
    assert tracked_checkpoint(tmp_path) == tmp_path / "iter_0000010"


@pytest.mark.parametrize("point", ["metadata", "tracker"])
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(saved_then_killed, point) -> None:
    done = saved_then_killed["killed"][point]
    assert done.returncode == -signal.SIGKILL, _tail(done)
    assert "KILL_POINT" in done.stderr and [r["iteration"] for r in _records(done.stdout, "SAVED")] == [1], _tail(done)
    directory = saved_then_killed["root"] / point
    assert (directory / TRACKER).read_text().strip() == "1"
    assert (directory / "iter_0000002").is_dir(), "the kill landed after the second save had started"
    assert not saved_then_killed["load_failed"], saved_then_killed["load_failed"]
    loaded = saved_then_killed["loaded"][point]
    assert loaded["iteration"] == 1
    assert loaded["checksum"] == saved_then_killed["saved"][1], "the load did not restore the first save's parameters"
    assert saved_then_killed["loaded"]["complete"]["checksum"] == saved_then_killed["saved"][2]


def _size_limited_dir_works() -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m none /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _size_limited_dir_works(), reason="a size-limited directory needs `unshare -rm` and a tmpfs mount")
def test_a_full_disk_stops_the_save_with_a_clear_error_and_the_previous_checkpoint_loads(megatron_built, tmp_path) -> None:
    """A 40 MiB tmpfs holds one tiny checkpoint (about 27 MiB) but not two: the second save fails."""
    mount = tmp_path / "small"
    mount.mkdir()
    save = mount / "checkpoints"
    python, worker = shlex.quote(sys.executable), shlex.quote(str(WORKER))
    script = (
        f"mount -t tmpfs -o size=40m none {mount} || exit 99; "
        f"{python} {worker} save --save {save} --iterations 1 2 --explain-save-failures; echo SAVE_EXIT $?; "
        f"{python} {worker} load {save}"
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    assert done.returncode == 0, _tail(done)
    assert "SAVE_EXIT 0" not in done.stdout and "SAVE_EXIT" in done.stdout, _tail(done)
    assert [r["iteration"] for r in _records(done.stdout, "SAVED")] == [1]
    error = next((line for line in done.stderr.splitlines() if "CheckpointSaveFailed:" in line), None)
    assert error is not None, _tail(done)
    assert f"checkpoint save of iteration 2 to {save} failed: the disk is full" in error
    assert f"Last complete checkpoint: iteration 1 in {save} (resume with `--load {save}`)" in error
    assert "pass a --save directory on a larger filesystem" in error
    loaded = _records(done.stdout, "LOADED")
    assert [r["iteration"] for r in loaded] == [1], _tail(done)
    saved = _records(done.stdout, "SAVED")[0]
    assert loaded[0]["checksum"] == saved["checksum"]


def test_a_nonfinite_loss_names_the_step_and_the_last_checkpoint(megatron_built, tmp_path) -> None:
    """Megatron's real global args, parsed from the tiny recipe's flags plus the fault-injection flag,
    reach the loss function through `forward_step`, as in `pretrain`."""
    from megatron.training import global_vars

    from nam56r.training.data.layout import DataPaths
    from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate
    from nam56r.training.launcher.pretrain import forward_step
    from nam56r.training.recipe import get_recipe
    from nam56r.training.runs.faults import NonFiniteLoss

    recipe = get_recipe("tiny-1gpu")
    save = tmp_path / "checkpoints"
    save.mkdir()
    (save / TRACKER).write_text("5")
    argv = megatron_flags(recipe, recipe.model_config(), DataPaths(Path("/data/train"), None, Path("/data/tokenizer")),
                 RunPaths(tmp_path / "run", save, None), "local")
    args = megatron_validate([*argv, "--nam56r-nonfinite-loss-at-step", "8"], recipe.world_size)
    batch = {"tokens": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long),
             "loss_mask": torch.ones(1, 4), "position_ids": torch.arange(4).view(1, 4)}

    class PerTokenLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, tokens, position_ids, attention_mask, *, labels, loss_mask):
            return self.w * torch.ones(tokens.shape)

    saved_args = global_vars._GLOBAL_ARGS
    global_vars._GLOBAL_ARGS = args
    try:
        losses = {}
        for completed in (6, 7, 8):  # Megatron's curr_iteration: steps completed before this one
            args.curr_iteration = completed
            output, loss_func = forward_step(iter([batch]), PerTokenLoss())
            try:
                losses[completed + 1] = loss_func(output)[0].item()
            except NonFiniteLoss as exc:
                losses[completed + 1] = exc
    finally:
        global_vars._GLOBAL_ARGS = saved_args
    assert losses[7] == 4.0 and losses[9] == 4.0, losses
    message = str(losses[8])
    assert isinstance(losses[8], NonFiniteLoss), losses
    assert message.startswith("the loss is nan at step 8 (rank 0); the run stops rather than skip the batch"), message
    assert f"Last complete checkpoint: iteration 5 in {save} (resume with `--load {save}`)" in message


DISTRIBUTED = "--megatron-flag=--use-distributed-optimizer"


def test_a_distributed_optimizer_checkpoint_saves_and_loads_every_parameter_and_moment(megatron_built, tmp_path) -> None:
    save = tmp_path / "checkpoints"
    saved = _worker(DISTRIBUTED, "save", "--save", str(save), "--iterations", "1", "2")
    assert saved.returncode == 0, _tail(saved)
    records = _records(saved.stdout, "SAVED")
    assert [r["iteration"] for r in records] == [1, 2]
    loaded = _worker(DISTRIBUTED, "load", str(save))
    assert loaded.returncode == 0 and not _records(loaded.stdout, "LOAD_FAILED"), _tail(loaded)
    (back,) = _records(loaded.stdout, "LOADED")
    assert back["iteration"] == 2
    assert back["checksum"] == records[-1]["checksum"], "parameters or fp32 main parameters differ after the load"
    assert back["moments"] == pytest.approx(records[-1]["moments"], rel=1e-12), "Adam's moments differ after the load"
    assert records[-1]["moments"] != 0, "the optimizer took no step"
