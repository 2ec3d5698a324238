"""The import arrows point one way (README, Layout): bench -> training -> model -> kernels, and the patch lane's
pure readers below all of them. Read from every module's AST, lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (the code under this folder, import names it must never reach)
FORBIDDEN = [
    ("tools", ("nam56r", "nam56r_kernels", "nam56r_bench", "torch")),
    ("kernels", ("nam56r", "nam56r_bench", "nam56r_patchlane")),
    ("nam56r/model", ("nam56r.training", "nam56r_bench")),
    ("nam56r", ("nam56r_bench",)),
]


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def reaches(name: str, forbidden: str) -> bool:
    return name == forbidden or name.startswith(forbidden + ".")


@pytest.mark.parametrize(("folder", "forbidden"), FORBIDDEN, ids=[folder for folder, _ in FORBIDDEN])
def test_no_module_imports_against_the_arrows(folder: str, forbidden: tuple[str, ...]) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}"
    wrong = [f"{path.relative_to(ROOT)} imports {name}" for path in files for name in sorted(imported_names(path))
             if any(reaches(name, f) for f in forbidden)]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_arrow(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from nam56r.training.flags import megatron_flags\n")
    assert any(reaches(name, "nam56r.training") for name in imported_names(module))
