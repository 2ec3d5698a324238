"""Fixtures shared by the test folders: the pinned upstream of a per-upstream folder (tests/megatron/,
tests/mamba/ ...), the patched Megatron's presence, and Triton's CPU interpreter for the fused kernels
(tests/kernels/, and the layers that call them in tests/nam56r/)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from nam56r_patchlane.pinned import PinnedRelease

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_OF_TEST_FOLDER = {"megatron": "megatron-lm", "mamba": "mamba"}


@pytest.fixture(scope="module")
def pinned_release(request: pytest.FixtureRequest) -> PinnedRelease:
    """The pinned release of the upstream that the requesting test's folder covers."""
    folder = Path(request.path).resolve().relative_to(ROOT / "tests").parts[0]
    return PinnedRelease(ROOT / "third_party" / UPSTREAM_OF_TEST_FOLDER[folder])


@pytest.fixture(scope="session")
def megatron_built() -> None:
    """The patched Megatron is materialized (`nox -s build`): tests that import or parse against it skip otherwise."""
    if not (ROOT / "third_party" / "megatron-lm" / ".git").exists():
        pytest.skip("third_party/megatron-lm is not materialized: run `nox -s build`")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl).*")


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
