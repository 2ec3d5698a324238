"""Helpers for the kernels' tests: running a comparison under Triton's CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_interpreted(script: str, timeout: float = 300) -> str:
    """Run ``script`` in a fresh Python with TRITON_INTERPRET=1 (it must be set before triton is imported);
    returns its stdout, failing the test with the script's output if it exits non-zero."""
    path = os.pathsep.join([str(ROOT / "kernels"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"interpreted script exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc.stdout


@pytest.fixture
def run_interpreted() -> Callable[..., str]:
    return _run_interpreted
