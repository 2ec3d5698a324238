"""Helpers for tests of the Megatron-LM series: the patched tree is installed editable in this
environment; the unpatched base is read from the tree's `upstream` tag."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEGATRON_TREE = ROOT / "third_party" / "megatron-lm"

if not (MEGATRON_TREE / ".git").exists():
    pytest.skip("third_party/megatron-lm is not materialized: run `nox -s build`", allow_module_level=True)


class PinnedRelease:
    """Read the unpatched Megatron-LM from the materialized tree's `upstream` tag."""

    @staticmethod
    def source(path: str) -> str:
        return subprocess.run(
            ["git", "-C", str(MEGATRON_TREE), "show", f"upstream:{path}"], capture_output=True, text=True, check=True
        ).stdout

    def definition(self, module: ModuleType, path: str, name: str) -> Any:
        """The unpatched function or class `name`, compiled in a copy of the patched module's globals."""
        tree = ast.parse(self.source(path))
        node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name)
        namespace = dict(vars(module))
        exec(compile(ast.Module(body=[node], type_ignores=[]), f"upstream:{path}", "exec"), namespace)
        return namespace[name]


@pytest.fixture(scope="session")
def pinned_release() -> PinnedRelease:
    return PinnedRelease()
