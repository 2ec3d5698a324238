"""Patch mamba 0006: the Mamba-3 backward reads ctx.saved_tensors once, so the MIMO autograd function trains under
non-reentrant activation checkpointing, which is what NAM56R's `--recompute mamba` (nam56r.model.recompute) wraps
the mixer in. The pack's reproducer runs the real autograd function with its GPU kernels replaced by zeros of
their output shapes; here it runs on our tree, and our recompute wrapper runs that function the same way."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "third_party" / "mamba"
REPRO = ROOT / "patches" / "packs" / "23-mamba3-saved-tensors-once" / "repro.py"
KERNELS = ("angle_dt_fwd", "angle_dt_bwd", "compute_dacs_segsum_triton", "mamba_mimo_forward", "mamba_mimo_bwd_combined")

pytestmark = pytest.mark.skipif(not (TREE / ".git").exists(), reason="third_party/mamba is not materialized: run `nox -s build`")


def _repro():
    spec = importlib.util.spec_from_file_location("mamba_saved_tensors_repro", REPRO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reproducer_validates_the_fix_on_our_tree() -> None:
    proc = subprocess.run([sys.executable, str(REPRO), "--tree", str(TREE)], capture_output=True, text=True)
    assert "FIX_VALIDATED" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0


def test_our_recompute_wrapper_trains_the_real_mimo_function(monkeypatch: pytest.MonkeyPatch, megatron_built) -> None:
    from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo

    from nam56r.model.recompute import checkpointed

    repro = _repro()
    for name in KERNELS:
        monkeypatch.setattr(mamba3_mimo, name, getattr(mamba3_mimo, name))  # restored after the test
    repro.zero_kernels(mamba3_mimo)

    def step(*tensors: torch.Tensor) -> torch.Tensor:
        return mamba3_mimo.mamba3_mimo(*tensors, repro.CHUNK, 4, torch.bfloat16)

    grads = {}
    for wrapped in (False, True):
        args = repro.inputs()
        out = checkpointed(step, *args) if wrapped else step(*args)
        out.float().sum().backward()
        grads[wrapped] = [a.grad for a in args]
    for got, want in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
