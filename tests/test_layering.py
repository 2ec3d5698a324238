"""The import arrows point one way (README, Layout): bench -> training -> model -> kernels, and the patch lane's
pure readers below all of them; inside nam56r/training, its rooms: core <- data <- runs <- launcher <- gpu_check;
and no modules of nam56r import each other in a circle. Read from every module's AST, lazy imports inside
functions included."""

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
    return imported_names_of(ast.parse(path.read_text(), str(path)))


def imported_names_of(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
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
    module.write_text("def f():\n    from nam56r.training.launcher.flags import megatron_flags\n")
    assert any(reaches(name, "nam56r.training") for name in imported_names(module))


# nam56r/training's rooms, left to right: a module imports only the rooms to its left. "core" is the recipe core
# at the top of nam56r/training, which every room shares and which imports no room.
ROOMS = ("core", "data", "runs", "launcher", "gpu_check")
TRAINING = ROOT / "nam56r" / "training"


def room_of(path: Path, training: Path = TRAINING) -> str:
    """The room of a file of nam56r/training: its first folder there, or the core for a file at its top."""
    parts = path.relative_to(training).parts
    return parts[0] if len(parts) > 1 else "core"


def room_named(name: str) -> str | None:
    """The room an import name of nam56r.training reaches; None for a name outside nam56r.training."""
    if not reaches(name, "nam56r.training"):
        return None
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in ROOMS else "core"


def wrong_arrows(training: Path = TRAINING) -> list[str]:
    """Every import of a module of `training` that reaches a room to the right of its own."""
    wrong = []
    for path in sorted(training.rglob("*.py")):
        rank = ROOMS.index(room_of(path, training))
        for name in sorted(imported_names(path)):
            room = room_named(name)
            if room is not None and ROOMS.index(room) > rank:
                wrong.append(f"{path.relative_to(training.parents[1])} ({room_of(path, training)}) imports {name} ({room})")
    return wrong


def test_every_folder_of_training_is_a_room() -> None:
    folders = {p.name for p in TRAINING.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    rooms = set(ROOMS) - {"core"}
    assert folders == rooms, f"a folder of nam56r/training with no place in ROOMS, or a room gone: {sorted(folders ^ rooms)}"


def test_each_room_imports_only_the_rooms_to_its_left() -> None:
    wrong = wrong_arrows()
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_a_wrong_room_arrow(tmp_path: Path) -> None:
    training = tmp_path / "nam56r" / "training"
    (training / "data").mkdir(parents=True)
    (training / "data" / "layout.py").write_text("def f():\n    from nam56r.training.runs.layout import RunDir\n")
    (training / "recipe.py").write_text("from nam56r.training import launcher\n")
    (training / "launcher").mkdir()
    (training / "launcher" / "train.py").write_text("from nam56r.training.data.layout import DataDir\nfrom nam56r.training import recipe\n")
    assert wrong_arrows(training) == [
        "nam56r/training/data/layout.py (data) imports nam56r.training.runs.layout (runs)",
        "nam56r/training/data/layout.py (data) imports nam56r.training.runs.layout.RunDir (runs)",
        "nam56r/training/recipe.py (core) imports nam56r.training.launcher (launcher)",
    ]


def runtime_imported_names(path: Path) -> set[str]:
    """`imported_names` less the imports under `if TYPE_CHECKING:`, which never run: a module may name another's type
    in its annotations (recipe_checks names Recipe) without the two importing each other."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    return imported_names_of(tree)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports at run time (a name imported from a module counts as that module)."""
    files = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in sorted(package.rglob("*.py"))}

    def module_of(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    return {module: {m for name in runtime_imported_names(path) if (m := module_of(name)) not in (None, module)}
            for module, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while (member := stack.pop()) != module:
                component.append(member)
            component.append(module)
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_modules_of_nam56r_import_each_other_in_a_circle() -> None:
    cycles = import_cycles(import_graph(ROOT / "nam56r"))
    assert not cycles, "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_check_sees_an_import_circle(tmp_path: Path) -> None:
    runs = tmp_path / "nam56r" / "training" / "runs"
    runs.mkdir(parents=True)
    for folder in (tmp_path / "nam56r", runs.parent, runs):
        (folder / "__init__.py").write_text("")
    (runs / "summary.py").write_text("from nam56r.training.runs.plot import plot_run\nfrom nam56r.training.runs.layout import RunDir\n")
    (runs / "plot.py").write_text("def f():\n    from nam56r.training.runs.record import append\n")
    (runs / "record.py").write_text("from nam56r.training.runs import summary\n")
    (runs / "layout.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nam56r.training.runs.summary import S\n")
    (runs / "events.py").write_text("from nam56r.training.runs.layout import RunDir\n")
    assert import_cycles(import_graph(tmp_path / "nam56r")) == [
        ["nam56r.training.runs.plot", "nam56r.training.runs.record", "nam56r.training.runs.summary"],
    ]
