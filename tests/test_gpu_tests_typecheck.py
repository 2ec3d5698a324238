"""The GPU tests run only on a GPU node, so a CPU run never executes a line of them. mypy reads them here instead,
for the mistakes that would fail them there before any GPU work: an attribute or name that does not exist, a call
with arguments the callee does not take."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODES = ("attr-defined", "name-defined", "call-arg")
GPU_MARK = re.compile(r"pytest\.mark\.gpu|pytestmark\s*=.*gpu")


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(paths: list[Path], cache: Path) -> list[str]:
    """mypy's errors of CODES in `paths`, following our packages' real types (the upstreams' are Any)."""
    search = os.pathsep.join(str(ROOT / d) for d in ("", "tools", "kernels", "bench"))
    result = subprocess.run([sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
                             "--no-error-summary", "--show-error-codes", "--cache-dir", str(cache), *map(str, paths)],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, "MYPYPATH": search})
    assert result.returncode in (0, 1), result.stderr  # 2: mypy itself failed
    return [line for line in result.stdout.splitlines() if any(f"[{code}]" in line for code in CODES)]


def gpu_test_files() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if GPU_MARK.search(p.read_text()))


def test_the_gpu_tests_name_only_attributes_names_and_arguments_that_exist(mypy_cache: Path) -> None:
    files = gpu_test_files()
    assert len(files) >= 10, files  # the GPU tests are found

    assert _mypy(files, mypy_cache) == []


def test_the_check_sees_our_real_types(tmp_path: Path, mypy_cache: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from nam56r.training.recipe import get_recipe\n\nget_recipe('proxy-1gpu').backend\n")

    errors = _mypy([probe], mypy_cache)

    assert len(errors) == 1 and '"Recipe" has no attribute "backend"' in errors[0]
