"""The unpatched pinned release inside a materialized tree: its files and definitions at the `upstream` tag.

Tests and benchmarks compare a patched function with the one it replaced in the same process; this reads
the original source from the tree's base tag and compiles one definition in the patched module's globals.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

from nam56r_patchlane.errors import PatchlaneError
from nam56r_patchlane.gittree import BASE_TAG


class PinnedRelease:
    """The unpatched upstream, read from a materialized tree's `upstream` tag."""

    def __init__(self, tree: Path) -> None:
        self.tree = Path(tree)

    def source(self, path: str) -> str:
        proc = subprocess.run(["git", "-C", str(self.tree), "show", f"{BASE_TAG}:{path}"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise PatchlaneError(f"{self.tree}: no {path} at tag {BASE_TAG!r} ({proc.stderr.strip()}); run `nox -s build` first")
        return proc.stdout

    def definition(self, module: ModuleType, path: str, name: str) -> Any:
        """The unpatched function or class `name`, compiled in a copy of the patched module's globals."""
        tree = ast.parse(self.source(path))
        nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
        if not nodes:
            raise PatchlaneError(f"{path} at tag {BASE_TAG!r} defines no top-level {name!r}")
        namespace = dict(vars(module))
        exec(compile(ast.Module(body=nodes[:1], type_ignores=[]), f"{BASE_TAG}:{path}", "exec"), namespace)
        return namespace[name]
