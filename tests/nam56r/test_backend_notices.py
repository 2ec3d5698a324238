"""Without TransformerEngine and Apex, importing the stack states the backend once instead of Megatron's dozen
fallback warnings; any other warning still shows."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed: no fallbacks")

PROBE = """
import logging, warnings
logging.basicConfig(level=logging.WARNING)
warnings.simplefilter("default")
import nam56r
from nam56r.model.specs import resolve_backend, hybrid_stack_spec
import megatron.core.optimizer, megatron.core.models.backends, megatron.core.transformer.torch_norm
from nam56r.model.presets import get_preset
resolve_backend("auto")
hybrid_stack_spec(get_preset("nam56r-tiny"), "local")
warnings.warn("a warning of our own", UserWarning)
"""


def test_megatron_fallback_warnings_are_replaced_by_one_backend_line(megatron_built) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Transformer Engine and Apex are not installed" not in proc.stderr
    assert "Apex is not installed" not in proc.stderr
    assert proc.stderr.count("NAM56R layer backend: local") == 1
    assert "a warning of our own" in proc.stderr


def test_verbose_shows_the_known_warnings_and_reaches_the_ranks(megatron_built) -> None:
    """With NAM56R_VERBOSE set (as `nam56r.training.launcher --verbose` sets it for itself and for torchrun's ranks)
    Megatron's fallback warnings show again; `show_known_warnings` undoes the filters in a running process."""
    from nam56r import VERBOSE_ENV

    shown = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env={**os.environ, VERBOSE_ENV: "1"})
    assert shown.returncode == 0, shown.stderr
    assert "Apex is not installed. Falling back to Torch Norm" in shown.stderr and "a warning of our own" in shown.stderr

    undo = ("import warnings; warnings.simplefilter('default'); import nam56r; nam56r.show_known_warnings();"
            " warnings.warn('Apex is not installed. Falling back to Torch Norm', UserWarning)")
    assert "Falling back to Torch Norm" in subprocess.run([sys.executable, "-c", undo], capture_output=True, text=True).stderr

    launcher = ("import os; from nam56r.training.launcher.train import main; main(['--verbose', '--list']); "
                "print('ENV', os.environ.get('NAM56R_VERBOSE'))")
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=300)
    assert "ENV 1" in out.stdout, out.stderr
