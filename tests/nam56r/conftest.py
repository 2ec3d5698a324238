"""Fixtures for the model tests: they build NAM56R on the patched Megatron installed in this
environment (`nox -s build`), on the meta device or, for the tiny preset, on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_cpu_model(megatron_built):
    """nam56r-tiny with real CPU tensors (IndexCache on: 1 Full + 2 Shared DSA layers)."""
    import torch

    from nam56r.model.model import build_model
    from nam56r.model.presets import get_preset

    torch.manual_seed(0)
    return build_model(get_preset("nam56r-tiny"), "local", device="cpu")
