"""The launcher's resume check (nam56r.training.runs.resume_layout) on a real checkpoint: the tiny-1gpu run's, saved by
Megatron's own `save_checkpoint` with the distributed optimizer on CPU (tests/nam56r/checkpoint_worker.py), read
through Megatron's loader, and judged inside `python -m nam56r.training.launcher --dry-run` over Megatron's parsed
flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nam56r.training.runs.resume_layout import SavedLayout, iteration_to_load, read_saved_layout, resume_problems

WORKER = Path(__file__).with_name("checkpoint_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def saved_at_ep1(megatron_built, tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("resume-layout") / "checkpoints"
    done = subprocess.run([sys.executable, str(WORKER), "--megatron-flag=--use-distributed-optimizer", "save", "--save", str(save),
                           "--iterations", "1", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return save


def test_the_saved_layout_is_read_from_the_checkpoint_megatron_wrote(saved_at_ep1: Path) -> None:
    path = iteration_to_load(saved_at_ep1, None)
    assert path == saved_at_ep1 / "iter_0000002"  # the tracker's iteration
    assert iteration_to_load(saved_at_ep1, 1) == saved_at_ep1 / "iter_0000001"
    assert iteration_to_load(saved_at_ep1, 7) is None and iteration_to_load(saved_at_ep1.parent, None) is None
    saved = read_saved_layout(path)
    assert (saved.expert_parallel, saved.distributed_optimizer, saved.optimizer_sharding) == (1, True, "dp_reshardable")


def _dry_run(capsys, *args: str) -> tuple[int, str]:
    from nam56r.training.launcher.train import main as train_main

    code = train_main(["--dry-run", *args])
    return code, capsys.readouterr().out


def test_a_dry_run_refuses_to_resume_an_ep1_checkpoint_at_ep2_unless_it_leaves_the_optimizer(saved_at_ep1: Path, tmp_path: Path,
                                                                                              capsys) -> None:
    common = ("--recipe", "tiny-1gpu", "--load", str(saved_at_ep1), "--run-dir", str(tmp_path / "run"))
    code, out = _dry_run(capsys, *common)
    assert code == 0 and "ok   resume" in out and "saved at EP=1, optimizer state dp_reshardable; loads at EP=1" in out

    code, out = _dry_run(capsys, *common, "--gpus-per-node", "2", "--ep", "2", "--moe-dispatch", "megatron")
    assert code == 1
    assert "FAIL resume" in out and "saved at expert-parallel size 1; this run is at 2" in out
    assert "does not cross between the two" in out

    code, out = _dry_run(capsys, *common, "--gpus-per-node", "2", "--ep", "2", "--moe-dispatch", "megatron", "--", "--no-load-optim")
    assert code == 0 and "loads at EP=2 (weights only" in out


def test_between_ep_sizes_above_one_only_a_fully_reshardable_optimizer_state_moves(tmp_path: Path, megatron_built) -> None:
    def saved(ep: int, sharding: str | None) -> SavedLayout:
        return SavedLayout(tmp_path / "iter_0000010", ep, True, sharding)

    assert resume_problems(saved(4, "fully_reshardable"), 2, loads_optimizer=True) == []
    assert resume_problems(saved(4, "dp_reshardable"), 4, loads_optimizer=True) == []
    assert resume_problems(saved(4, "dp_reshardable"), 2, loads_optimizer=False) == []
    (problem,) = resume_problems(saved(4, "dp_reshardable"), 2, loads_optimizer=True)
    assert "resumes only at EP=4" in problem and "--reshardable-ckpt on" in problem
    (problem,) = resume_problems(saved(2, "fully_reshardable"), 1, loads_optimizer=True)
    assert "does not cross between the two" in problem and "resume at EP above 1" in problem


def test_a_directory_megatron_did_not_write_is_refused_by_name(tmp_path: Path, megatron_built) -> None:
    from types import SimpleNamespace

    from nam56r.training.runs.resume_layout import check_resume

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3\n")
    (tmp_path / "iter_0000003").mkdir()
    margs = SimpleNamespace(load=str(tmp_path), ckpt_step=None, no_load_optim=False, finetune=False, expert_model_parallel_size=1)
    with pytest.raises(ValueError, match="cannot read the saved layout of .*iter_0000003"):
        check_resume(margs)
    assert check_resume(SimpleNamespace(load=None)) is None
    empty = SimpleNamespace(**{**vars(margs), "load": str(tmp_path / "none")})
    assert "holds no checkpoint to check" in check_resume(empty)
