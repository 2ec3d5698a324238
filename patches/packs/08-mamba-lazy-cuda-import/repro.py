#!/usr/bin/env python3
"""Reproducer: `import mamba_ssm.modules.mamba3` fails when the Mamba-1 CUDA extension is absent.

    python repro.py --tree third_party/mamba

mamba-ssm installs built with MAMBA_SKIP_CUDA_BUILD=TRUE (any install that needs only the Triton and
TileLang Mamba-2/Mamba-3 kernels, and every CPU install) have no `selective_scan_cuda` extension. The
script makes sure the extension is absent whatever the host has: a meta-path finder placed first on
`sys.meta_path` raises ModuleNotFoundError for that one name. Then it imports `mamba_ssm.modules.mamba3`
from the tree and, if that works, calls the Mamba-1 op `selective_scan_fn` on small CPU tensors, which
needs the extension.

Prints, after the host stamp line:
  BUG_REPRODUCED  the Mamba-3 import fails with ImportError for `selective_scan_cuda`, raised by the
                  module-level import in mamba_ssm/ops/selective_scan_interface.py (reached through
                  mamba_ssm/__init__.py)
  FIX_VALIDATED   Mamba-3 imports (mamba_ssm.Mamba3 is its class), and the Mamba-1 op raises, when
                  called, an ImportError naming `selective_scan_cuda` and MAMBA_SKIP_CUDA_BUILD
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise.

What it does not show: that Mamba-1 ops still work when the extension is installed (the patch only
moves the import into the ops; nothing here loads the real extension), nor that Mamba-3 runs: its
kernels need a CUDA GPU, and only the import is checked.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import platform
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

UPSTREAM = "mamba"
FIX_SUBJECT = "Import the Mamba-1 CUDA extension lazily so Mamba-3 imports without it"
EXTENSION = "selective_scan_cuda"


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


class BlockExtension(importlib.abc.MetaPathFinder):
    """Makes `selective_scan_cuda` unimportable, as on an install built with MAMBA_SKIP_CUDA_BUILD=TRUE."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> None:
        if fullname == EXTENSION:
            raise ModuleNotFoundError(f"No module named '{EXTENSION}' (blocked by repro.py)", name=EXTENSION)
        return None


def raising_frame(exc: BaseException, tree: Path) -> str:
    """The innermost traceback frame inside the tree, as 'path:line'."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve().is_relative_to(tree)]
    if not frames:
        return "?"
    return f"{Path(frames[-1].filename).resolve().relative_to(tree)}:{frames[-1].lineno}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized mamba tree (base or patched)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or spec.origin is None or not Path(spec.origin).resolve().is_relative_to(tree):
        print(f"error: mamba_ssm resolves to {spec.origin if spec else None}, not the tree {tree}")
        return 1
    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r})")
    installed = importlib.machinery.PathFinder.find_spec(EXTENSION) is not None
    sys.meta_path.insert(0, BlockExtension())
    print(f"{EXTENSION}: {'installed on this host, blocked' if installed else 'absent on this host (also blocked)'}"
          " by a meta-path finder")

    try:
        mamba3 = importlib.import_module("mamba_ssm.modules.mamba3")
    except ImportError as exc:
        where = raising_frame(exc, tree)
        print(f"import mamba_ssm.modules.mamba3: {type(exc).__name__}: {exc} (raised at {where})")
        if exc.name == EXTENSION and where.startswith("mamba_ssm/ops/selective_scan_interface.py"):
            print(f"BUG_REPRODUCED: Mamba-3 cannot be imported without the Mamba-1 CUDA extension: {where} imports"
                  f" {EXTENSION} at module level, and mamba_ssm/__init__.py imports that module")
            return 1 if has_fix else 0
        print("error: the import failed for another reason than the missing extension")
        return 1
    import mamba_ssm

    if not Path(mamba3.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {mamba3.__file__}, not the tree {tree}")
        return 1
    print(f"import mamba_ssm.modules.mamba3: ok ({Path(mamba3.__file__).resolve().relative_to(tree)});"
          f" mamba_ssm.Mamba3 is mamba3.Mamba3: {mamba_ssm.Mamba3 is mamba3.Mamba3}")
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn

    gen = torch.Generator().manual_seed(0)
    b, d, n, length = 1, 4, 2, 8
    u, delta = torch.randn(b, d, length, generator=gen), torch.rand(b, d, length, generator=gen)
    a, bmat, cmat = -torch.rand(d, n, generator=gen), torch.randn(b, n, length, generator=gen), torch.randn(b, n, length, generator=gen)
    try:
        selective_scan_fn(u, delta, a, bmat, cmat)
        print("error: the Mamba-1 op ran although the extension is blocked")
        return 1
    except ImportError as exc:
        message = str(exc)
        print(f"selective_scan_fn(...): {type(exc).__name__}: {message}")
    if not (EXTENSION in message and "MAMBA_SKIP_CUDA_BUILD" in message and mamba_ssm.Mamba3 is mamba3.Mamba3):
        print("error: Mamba-3 imports, but the Mamba-1 op's error does not name the extension and how to build it")
        return 1
    print(f"FIX_VALIDATED: Mamba-3 imports without {EXTENSION}, and a Mamba-1 op raises, when called, an ImportError"
          " naming the extension and MAMBA_SKIP_CUDA_BUILD")
    return 0 if has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
