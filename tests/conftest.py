"""Fixtures shared by the per-upstream test folders (tests/megatron/, tests/mamba/ ...)."""

from __future__ import annotations

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
