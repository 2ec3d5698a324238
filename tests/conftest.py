"""Fixtures shared by the per-upstream test folders (tests/megatron/, tests/mamba/ ...)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_OF_TEST_FOLDER = {"megatron": "megatron-lm", "mamba": "mamba"}


class PinnedRelease:
    """The unpatched upstream, read from a materialized tree's `upstream` tag."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree

    def source(self, path: str) -> str:
        return subprocess.run(
            ["git", "-C", str(self.tree), "show", f"upstream:{path}"], capture_output=True, text=True, check=True
        ).stdout

    def definition(self, module: ModuleType, path: str, name: str) -> Any:
        """The unpatched function or class `name`, compiled in a copy of the patched module's globals."""
        tree = ast.parse(self.source(path))
        node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
        namespace = dict(vars(module))
        exec(compile(ast.Module(body=[node], type_ignores=[]), f"upstream:{path}", "exec"), namespace)
        return namespace[name]


@pytest.fixture(scope="module")
def pinned_release(request: pytest.FixtureRequest) -> PinnedRelease:
    """The pinned release of the upstream that the requesting test's folder covers."""
    folder = Path(request.path).resolve().relative_to(ROOT / "tests").parts[0]
    return PinnedRelease(ROOT / "third_party" / UPSTREAM_OF_TEST_FOLDER[folder])
