"""Patch mamba 0001: mamba_ssm (and Mamba-3) import without the Mamba-1 CUDA extension; a Mamba-1 op
that needs the extension raises a clear ImportError when called, not at import."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TREE = Path(__file__).resolve().parents[2] / "third_party" / "mamba"
INTERFACE = "mamba_ssm/ops/selective_scan_interface.py"

pytestmark = [
    pytest.mark.skipif(not (TREE / ".git").exists(), reason="third_party/mamba is not materialized: run `nox -s build`"),
    pytest.mark.skipif(importlib.util.find_spec("selective_scan_cuda") is not None,
                       reason="this environment has the CUDA extension; the test is about installs without it"),
]


def test_mamba3_imports_without_the_extension() -> None:
    proc = subprocess.run([sys.executable, "-c", "import mamba_ssm, mamba_ssm.modules.mamba3; print(mamba_ssm.Mamba3.__name__)"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "Mamba3"


def test_mamba1_op_raises_a_clear_error_when_called() -> None:
    import torch
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    b, d, n, length = 1, 4, 2, 8
    u, delta = torch.randn(b, d, length), torch.rand(b, d, length)
    a, bmat, cmat = -torch.rand(d, n), torch.randn(b, n, length), torch.randn(b, n, length)
    with pytest.raises(ImportError, match=r"selective_scan_cuda.*MAMBA_SKIP_CUDA_BUILD"):
        selective_scan_fn(u, delta, a, bmat, cmat)


def test_pinned_release_imports_the_extension_at_module_import() -> None:
    """The bug: the pinned release's interface module imports selective_scan_cuda at top level."""
    base = subprocess.run(["git", "-C", str(TREE), "show", f"upstream:{INTERFACE}"], capture_output=True, text=True, check=True).stdout
    top_level = [n for n in ast.parse(base).body if isinstance(n, ast.Import)]
    assert any(alias.name == "selective_scan_cuda" for n in top_level for alias in n.names)
    with pytest.raises(ImportError):
        exec("import selective_scan_cuda", {})
