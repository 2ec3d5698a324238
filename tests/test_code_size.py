"""Every module under nam56r/, bench/, kernels/ and tools/ stays small enough to read in one sitting: at most
MAX_FILE_LINES lines a file and MAX_FUNCTION_LINES lines a function (its `def` line to its last, nested functions
counted again on their own). A module that outgrows them splits by job."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("nam56r", "bench", "kernels", "tools")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function in `source` longer than `limit` lines."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit]


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_file_and_no_function_is_too_long(folder: str) -> None:
    files = modules(folder)
    assert files, f"no Python files under {folder}"
    wrong = []
    for path in files:
        source, name = path.read_text(), path.relative_to(ROOT)
        if (lines := len(source.splitlines())) > MAX_FILE_LINES:
            wrong.append(f"{name}: {lines} lines (at most {MAX_FILE_LINES}): split it by job")
        wrong += [f"{name}:{line} {function}: {length} lines (at most {MAX_FUNCTION_LINES})"
                  for function, line, length in long_functions(source, MAX_FUNCTION_LINES)]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_long_function() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}\n"
    assert long_functions(source, MAX_FUNCTION_LINES) == [("long", 6, MAX_FUNCTION_LINES + 1)]
