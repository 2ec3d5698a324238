"""Fixtures shared by the per-upstream test folders (tests/megatron/, tests/mamba/ ...)."""

from __future__ import annotations

import warnings
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
