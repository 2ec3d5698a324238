"""The patch-lane and pack CLIs on an interpreter without GitPython: one line naming how to get it, no traceback."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A fresh venv that sees no site-packages: the real interpreter, and no GitPython."""
    env = tmp_path_factory.mktemp("bare-env")
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env)
    return env / "bin" / "python"


@pytest.mark.parametrize(("script", "args", "session"), [("apply_patches.py", ["status"], "patches"), ("packs.py", ["list"], "packs")])
def test_a_cli_without_gitpython_says_in_one_line_how_to_get_it(bare_python: Path, script: str, args: list[str], session: str) -> None:
    proc = subprocess.run([str(bare_python), str(TOOLS / script), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"nox -s {session} -- ..." in lines[0] and "pip install gitpython" in lines[0]
