"""Tests of the Megatron-LM series: the patched tree is installed editable in this environment; the
unpatched base comes from the `pinned_release` fixture (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

MEGATRON_TREE = Path(__file__).resolve().parents[2] / "third_party" / "megatron-lm"

if not (MEGATRON_TREE / ".git").exists():
    pytest.skip("third_party/megatron-lm is not materialized: run `nox -s build`", allow_module_level=True)
