"""Patch megatron-lm 0001: `import megatron.training` works on the Python our CI runs (3.11)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from_typing = "from typing import Any, Callable, ClassVar, Literal, override"
FILES = ("megatron/training/models/gpt.py", "megatron/training/models/hybrid.py")


def test_patched_megatron_training_imports() -> None:
    proc = subprocess.run([sys.executable, "-c", "import megatron.training.models.gpt, megatron.training.models.hybrid"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("path", FILES)
def test_unpatched_base_imports_typing_override(pinned_release, path: str) -> None:
    """The pinned release imports typing.override, which Python 3.11 lacks: the bug the patch fixes."""
    assert from_typing in pinned_release.source(path)
    if sys.version_info < (3, 12):
        with pytest.raises(ImportError, match="override"):
            exec(from_typing, {})
