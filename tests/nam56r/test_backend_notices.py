"""Without TransformerEngine and Apex, importing the stack states the backend once instead of Megatron's dozen
fallback warnings; any other warning still shows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE installed: no fallbacks")

PROBE = """
import logging, warnings
logging.basicConfig(level=logging.WARNING)
warnings.simplefilter("default")
import nam56r
from nam56r.specs import resolve_backend, hybrid_stack_spec
import megatron.core.optimizer, megatron.core.models.backends, megatron.core.transformer.torch_norm
from nam56r.presets import get_preset
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
