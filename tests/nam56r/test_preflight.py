"""Preflight: patch series applied by checksum, fused paths importable and taking the shapes, GPU supported."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from nam56r.model.presets import get_preset
from nam56r.training.launcher.preflight import applied_series_problems, run_preflight


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def built_root(tmp_path: Path) -> Path:
    """A checkout with one upstream whose tree has its one-patch series applied and recorded."""
    (tmp_path / "patches" / "up").mkdir(parents=True)
    patch = tmp_path / "patches" / "up" / "0001-fix.patch"
    patch.write_text("the patch\n")
    (tmp_path / "patches" / "up" / "series").write_text("# comment\n0001-fix.patch\n")
    tree = tmp_path / "third_party" / "up"
    tree.mkdir(parents=True)
    _git(tree, "init", "-q")
    (tree / "a.py").write_text("x = 1\n")
    _git(tree, "add", "a.py")
    _git(tree, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "fix")
    entry = {"name": "0001-fix.patch", "sha256": hashlib.sha256(patch.read_bytes()).hexdigest(), "commit": _git(tree, "rev-parse", "HEAD")}
    state = {"applied": [entry]}
    (tree / ".git" / "nam56r-patchlane.json").write_text(json.dumps(state))
    return tmp_path


def test_applied_series_passes(built_root: Path) -> None:
    assert applied_series_problems(built_root, "up") == []


def test_series_comments_are_read_as_the_patch_lane_reads_them(built_root: Path) -> None:
    # The patch lane's reader strips inline and indented comments; the preflight reads the same series.
    (built_root / "patches" / "up" / "series").write_text("  # indented comment\n0001-fix.patch  # why it exists\n\n")
    assert applied_series_problems(built_root, "up") == []


def test_edited_patch_file_fails_by_checksum(built_root: Path) -> None:
    (built_root / "patches" / "up" / "0001-fix.patch").write_text("the patch, edited\n")
    (problem,) = applied_series_problems(built_root, "up")
    assert "0001-fix.patch changed since it was applied" in problem and "nox -s build" in problem


def test_new_patch_in_series_fails(built_root: Path) -> None:
    (built_root / "patches" / "up" / "series").write_text("0001-fix.patch\n0002-more.patch\n")
    (problem,) = applied_series_problems(built_root, "up")
    assert "series lists ['0001-fix.patch', '0002-more.patch']" in problem


def test_uncommitted_tree_edit_fails(built_root: Path) -> None:
    (built_root / "third_party" / "up" / "a.py").write_text("x = 2\n")
    (problem,) = applied_series_problems(built_root, "up")
    assert "uncommitted edits that are in no patch (a.py)" in problem


def test_tree_without_state_fails(tmp_path: Path) -> None:
    (tmp_path / "patches" / "up").mkdir(parents=True)
    (tmp_path / "patches" / "up" / "series").write_text("0001-fix.patch\n")
    (tmp_path / "third_party" / "up" / ".git").mkdir(parents=True)
    (problem,) = applied_series_problems(tmp_path, "up")
    assert "was not built by the patch lane" in problem


def test_this_checkout_passes_except_for_the_missing_gpu(megatron_built) -> None:
    import torch

    report = run_preflight(get_preset("nam56r"))
    failing = {c.name for c in report.failures}
    assert failing == (set() if torch.cuda.is_available() else {"gpu"}), report.format()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="gpu: no CUDA GPU visible"):
            report.raise_if_failed()


def test_shapes_the_fused_kernels_refuse_fail_the_preflight_without_a_gpu(megatron_built) -> None:
    """The tiny preset as it was (4 indexer heads, top-k 16) passed the preflight, then the H100 refused
    it at the first DSA layer; the preflight now names it, on a machine without a GPU too."""
    from dataclasses import replace

    tiny = get_preset("nam56r-tiny")
    old = replace(tiny, seq_length=64, dsa=replace(tiny.dsa, indexer_heads=4, topk=16)).validate()
    (check,) = [c for c in run_preflight(old, require_gpu=False).checks if c.name == "fused kernel shapes"]
    assert not check.ok and "indexer heads 4 unsupported by the TileLang indexer backward" in check.detail
    assert "top-k 16 is not a multiple of 64" in check.detail
    (check,) = [c for c in run_preflight(tiny, require_gpu=False).checks if c.name == "fused kernel shapes"]
    assert check.ok, check.detail


def test_preflight_cli_reports_the_fused_shapes_with_no_gpu(megatron_built) -> None:
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "nam56r.training.launcher.preflight", "--preset", "nam56r-h3584", "--no-gpu"], capture_output=True, text=True
    )
    (line,) = [line for line in proc.stdout.splitlines() if "fused kernel shapes" in line]
    assert proc.returncode == 1 and line.startswith("FAIL") and "kernel heads 56 (mla.num_heads 56)" in line
