"""`python -m nam56r.training.runs.summarize RUN_DIR --record`: a training run's record in the validation manifest, every
figure from the run's own summary, on run directories written by nam56r.training.launcher's and nam56r.training.runs.summary's
own writers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from trainrun_testlib import COMMAND, lm_loss, write_train_run

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def record_run(run_dir: Path, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nam56r.training.runs.summarize", str(run_dir), "--record", "--root", str(root)],
                          capture_output=True, text=True, env=CPU_ONLY)


def manifest_records(root: Path) -> list[dict]:
    return tomllib.loads((root / "patches" / "manifest.toml").read_text())["record"]


def test_record_appends_the_runs_own_figures(tmp_path: Path) -> None:
    run_dir, root = tmp_path / "run", tmp_path / "checkout"
    write_train_run(run_dir, range(1, 21), recipe_steps=20, first_step_after_s=42.0)

    proc = record_run(run_dir, root)

    assert proc.returncode == 0, proc.stderr
    (record,) = manifest_records(root)
    summary = json.loads((run_dir / "summary.json").read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert record["kind"] == "train" and record["what"] == "train:tiny-1gpu" and record["recipe"] == "tiny-1gpu"
    assert record["commit"] == head and isinstance(record["dirty"], bool)
    assert record["command"] == COMMAND.format(steps=20)
    assert record["exit_code"] == 0  # the events reach the recipe's last step
    assert (record["first_step"], record["last_step"]) == (1, 20)
    assert record["loss_first"] == pytest.approx(lm_loss(1)) and record["loss_final"] == pytest.approx(lm_loss(20))
    assert record["tokens_per_s_per_gpu"] == summary["median_over_window"]["tokens_per_s_per_gpu"]
    assert record["tflops_per_s_per_gpu"] == summary["median_over_window"]["tflops_per_s_per_gpu"]
    assert record["global_batch_size"] == summary["median_over_window"]["global_batch_size"]
    assert record["peak_memory_gib"] == summary["peak_memory"]["gib"] == pytest.approx(4.0)
    assert record["time_to_first_step_s"] == summary["time_to_first_step_s"] == pytest.approx(42.0, abs=1.0)
    assert record["preset"] == summary["preset"] and record["world_size"] == 1
    assert record["host"]["gpu"] == "cpu" and record["run_dir"] == str(run_dir)
    assert f"appended to {root / 'patches' / 'manifest.toml'}: train:tiny-1gpu" in proc.stdout


def test_a_run_that_stopped_short_of_its_recipe_is_recorded_with_exit_1(tmp_path: Path) -> None:
    write_train_run(tmp_path / "run", range(1, 13), recipe_steps=20)

    proc = record_run(tmp_path / "run", tmp_path / "checkout")

    assert proc.returncode == 0, proc.stderr
    (record,) = manifest_records(tmp_path / "checkout")
    assert record["last_step"] == 12 and record["exit_code"] == 1


def test_a_folder_nam56r_train_did_not_write_is_not_recorded(tmp_path: Path) -> None:
    write_train_run(tmp_path / "run", range(1, 21))
    (tmp_path / "run" / "command.sh").unlink()

    proc = record_run(tmp_path / "run", tmp_path / "checkout")

    assert proc.returncode == 1
    assert "not recorded" in proc.stderr and "command.sh not found: not a run directory of nam56r.training.launcher" in proc.stderr
    assert not (tmp_path / "checkout" / "patches" / "manifest.toml").exists()
