#!/usr/bin/env python3
"""Reproducer: megatron.training's start-up runs `make -C megatron/core/datasets`, which fails in a
tree made from the megatron-core sdist or wheel (they ship no Makefile there), so training exits with
"Failed to compile the C++ dataset helper functions" although setup.py already built helpers_cpp.

    python repro.py --tree third_party/megatron-lm

TREE must be a tree unpacked from the sdist (megatron/core/datasets has helpers.cpp and no
Makefile). If helpers_cpp is not built in it for this interpreter, the script builds it the way an
install does, with the tree's setup.py (`python setup.py build_ext --inplace`: a C++ compiler,
pybind11 and the Python headers are needed). Then it imports helpers_cpp from the tree and runs the
training start-up step that compiles the helpers, `megatron.training.initialize._compile_dependencies`
(rank 0 of a single-process gloo group, world size 1, in-memory HashStore; it reads no arguments).

Prints, after the host stamp line:
  BUG_REPRODUCED  _compile_dependencies runs make in the tree without a Makefile and exits 1 (or
                  fails because make is not installed), although helpers_cpp imports
  FIX_VALIDATED   _compile_dependencies returns without running make (make -C on a directory
                  without a Makefile always fails, so a return means it was not run), and with
                  helpers_cpp made unimportable compile_helpers exits 1 with a message that names
                  the interpreter, the directory and the build commands (pip install -e . /
                  python setup.py build_ext --inplace)
  NOT_REPRODUCED  the tree has a Makefile in megatron/core/datasets (a source checkout, which the
                  bug does not affect)
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise.

What it does not show: a source checkout with a Makefile (make runs there as before, not exercised);
a wheel installed into site-packages (same code path: no Makefile, helpers_cpp built at install time);
multi-rank start-up (only rank 0 compiles; the others wait at the barrier that follows).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

UPSTREAM = "megatron-lm"
FIX_SUBJECT = "compile_helpers: import the helpers_cpp that setup.py built when the tree has no Makefile"
BUILD_ADVICE = ("pip install -e .", "python setup.py build_ext --inplace")


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout.strip()


def host_stamp(tree: Path) -> str:
    import torch

    gpu, cap, driver = "cpu", "", ""
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        cap = "{}.{}".format(*torch.cuda.get_device_capability(0))
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "-"
    return (f"host: gpu={gpu}{f' (sm {cap})' if cap else ''} driver={driver or '-'} python={platform.python_version()}"
            f" torch={torch.__version__} triton={triton_version} cuda={torch.version.cuda or '-'}"
            f" upstream={UPSTREAM} base={git(tree, 'rev-parse', 'upstream^{commit}')[:12]}"
            f" tree={git(tree, 'rev-parse', 'HEAD')[:12]}")


def tree_has_fix(tree: Path) -> bool:
    return any(s.startswith(FIX_SUBJECT) for s in git(tree, "log", "--format=%s", "upstream..HEAD").splitlines())


def build_helpers_like_an_install(tree: Path, built: Path) -> None:
    """setup.py's optional helpers_cpp extension, built in place for this interpreter."""
    version = importlib.import_module("megatron.core.package_info").__version__
    env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION": version}
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not built.is_file():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"error: `python setup.py build_ext --inplace` in {tree} did not build {built.name}:\n{tail}")
    print(f"built: {built.name} with `python setup.py build_ext --inplace` (what installing the sdist does)")


def missing_extension_message(utils_mod) -> tuple[int | None, str]:
    """compile_helpers with helpers_cpp unimportable: its exit code and what it logged."""
    import megatron.core.datasets as datasets_pkg

    records: list[str] = []
    handler = logging.Handler(level=logging.ERROR)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger(utils_mod.__name__)
    logger.addHandler(handler)
    saved_module = sys.modules.get("megatron.core.datasets.helpers_cpp")
    saved_attr = datasets_pkg.__dict__.pop("helpers_cpp", None)
    sys.modules["megatron.core.datasets.helpers_cpp"] = None  # importing it raises ImportError
    try:
        utils_mod.compile_helpers()
        code = None
    except SystemExit as exc:
        code = exc.code
    finally:
        logger.removeHandler(handler)
        sys.modules["megatron.core.datasets.helpers_cpp"] = saved_module
        if saved_attr is not None:
            datasets_pkg.helpers_cpp = saved_attr
    return code, "\n".join(records)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a megatron-lm tree made from the sdist (base or patched)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    utils_mod = importlib.import_module("megatron.core.datasets.utils")
    if not Path(utils_mod.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {utils_mod.__file__}, not the tree {tree}")
        return 1
    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r})")
    datasets_dir = Path(utils_mod.__file__).resolve().parent
    if (datasets_dir / "Makefile").exists():
        print(f"NOT_REPRODUCED: {datasets_dir} has a Makefile (a source checkout); run on a tree made from the sdist")
        return 1
    print(f"datasets: {datasets_dir} has helpers.cpp: {(datasets_dir / 'helpers.cpp').is_file()}, Makefile: False")
    built = datasets_dir / ("helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX"))
    if not built.is_file():
        build_helpers_like_an_install(tree, built)
    helpers_cpp = importlib.import_module("megatron.core.datasets.helpers_cpp")
    print(f"import: megatron.core.datasets.helpers_cpp from {helpers_cpp.__file__}", flush=True)

    from megatron.training import global_vars, initialize

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    global_vars.set_args(argparse.Namespace())
    try:
        initialize._compile_dependencies()
    except SystemExit as exc:
        print(f"BUG_REPRODUCED: _compile_dependencies ran make in megatron/core/datasets (no Makefile there) and exited {exc.code}"
              f" although helpers_cpp imports")
        return 1 if has_fix else 0
    except FileNotFoundError as exc:
        print(f"BUG_REPRODUCED: _compile_dependencies needs make, which is not installed ({exc}), although helpers_cpp imports")
        return 1 if has_fix else 0
    print("start-up: _compile_dependencies returned without running make")

    code, message = missing_extension_message(utils_mod)
    print(f"without helpers_cpp: compile_helpers exit code {code}, logged: {message!r}")
    python_version = sys.version.split()[0]
    problems = []
    if code != 1:
        problems.append(f"exit code {code}, expected 1")
    for needed in (*BUILD_ADVICE, str(datasets_dir), python_version):
        if needed not in message:
            problems.append(f"the message does not name {needed!r}")
    if problems:
        print("error: " + "; ".join(problems))
        return 1
    print("FIX_VALIDATED: a tree without a Makefile uses the helpers_cpp its install built, and says how to build it when missing")
    return 0 if has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
