"""Patch megatron-lm 0010: in a tree installed from the sdist (no Makefile in megatron/core/datasets),
`compile_helpers` imports the helpers_cpp extension that setup.py built instead of running make, and
names the build command when the extension is missing. A tree with a Makefile still runs make.

Runs the real `compile_helpers` and `megatron.training.initialize._compile_dependencies` in the
materialized tree. `make` is found through PATH; a `make` placed first on PATH records each call.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import shutil
import stat
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch

utils_mod = pytest.importorskip("megatron.core.datasets.utils")

UTILS_PATH = "megatron/core/datasets/utils.py"
DATASETS_DIR = Path(utils_mod.__file__).resolve().parent
BUILD_ADVICE = ("pip install -e .", "python setup.py build_ext --inplace")


@pytest.fixture
def sdist_tree() -> Path:
    if (DATASETS_DIR / "Makefile").exists():
        pytest.skip(f"{DATASETS_DIR} has a Makefile: the tree is a source checkout, not the sdist")
    return DATASETS_DIR


@pytest.fixture
def make_calls(tmp_path, monkeypatch) -> Path:
    """A `make` first on PATH that records its arguments and fails; returns the record file."""
    record = tmp_path / "make-calls"
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    shim = shim_dir / "make"
    shim.write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit 2\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{shim_dir}{os.pathsep}{os.environ['PATH']}")
    return record


def patched_compile_helpers_at(datasets_dir: Path):
    """The tree's compile_helpers, compiled as if its module lived in `datasets_dir`."""
    namespace = dict(vars(utils_mod), __file__=str(datasets_dir / "utils.py"))
    source = textwrap.dedent(inspect.getsource(utils_mod.compile_helpers))
    exec(compile(source, UTILS_PATH, "exec"), namespace)
    return namespace["compile_helpers"]


def test_the_install_built_helpers_for_this_interpreter(sdist_tree) -> None:
    from megatron.core.datasets import helpers_cpp

    built = Path(helpers_cpp.__file__)
    assert built.parent == sdist_tree, built
    assert built.name == "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"), built


def test_compile_helpers_uses_the_built_extension_without_make(sdist_tree, make_calls) -> None:
    assert utils_mod.compile_helpers() is None
    assert not make_calls.exists(), make_calls.read_text()


def test_compile_dependencies_at_training_start_needs_no_make(sdist_tree, make_calls, monkeypatch) -> None:
    from megatron.training import global_vars, initialize

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", argparse.Namespace())
    initialize._compile_dependencies()
    assert not make_calls.exists(), make_calls.read_text()


def test_missing_extension_names_the_build_command(sdist_tree, make_calls, monkeypatch, caplog) -> None:
    import megatron.core.datasets

    # As if the extension were not built: importing it raises ImportError.
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)
    monkeypatch.delattr(megatron.core.datasets, "helpers_cpp", raising=False)
    with caplog.at_level(logging.ERROR, logger=utils_mod.__name__), pytest.raises(SystemExit) as exit_info:
        utils_mod.compile_helpers()
    assert exit_info.value.code == 1
    message = caplog.text
    assert all(advice in message for advice in BUILD_ADVICE), message
    assert str(sdist_tree) in message and sys.version.split()[0] in message, message
    assert not make_calls.exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_pinned_release_runs_make_where_there_is_no_makefile(sdist_tree, pinned_release) -> None:
    """The bug: the pinned release's compile_helpers runs make in the sdist tree and exits 1."""
    base = pinned_release.definition(utils_mod, UTILS_PATH, "compile_helpers")
    with pytest.raises(SystemExit) as exit_info:
        base()
    assert exit_info.value.code == 1


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_tree_with_a_makefile_still_runs_make(tmp_path) -> None:
    (tmp_path / "Makefile").write_text("default:\n\ttouch made\n")
    assert patched_compile_helpers_at(tmp_path)() is None
    assert (tmp_path / "made").exists()

    (tmp_path / "Makefile").write_text("default:\n\tfalse\n")
    with pytest.raises(SystemExit) as exit_info:
        patched_compile_helpers_at(tmp_path)()
    assert exit_info.value.code == 1
