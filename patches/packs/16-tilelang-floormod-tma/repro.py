#!/usr/bin/env python3
"""Bug report / guard: TileLang's layout inference divides by zero (FloorMod) when the Mamba-3 MIMO
backward kernels are lowered with TMA on.

    python repro.py --tree third_party/tilelang [--mamba-tree third_party/mamba] [--shapes static|dynamic|both]
                    [--arch sm_90a] [--lower-only]

Reported for TMA lowering of Mamba-3 backward kernels and believed fixed in TileLang 0.1.12
(tile-ai/tilelang #2469). The mamba_ssm release builds every MIMO kernel with TL_DISABLE_TMA_LOWER
True (pack 15 guards that), so this only bites a caller that turns TMA lowering on.

With the tilelang of --tree first on sys.path (the stamp line says which tilelang was imported and
its version; a tilelang already importable from elsewhere is reported, not refused) and mamba_ssm
from --mamba-tree (default: third_party/mamba of this repository), the JIT factories
`mamba_mimo_bwd_fwd` and `mamba_mimo_bwd_bwd` of mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_bwd
(tilelang JITImpl dataclasses) are copied with
`dataclasses.replace(f, pass_configs={**f.pass_configs, TL_DISABLE_TMA_LOWER: False})` and built
with the arguments `mamba_mimo_bwd_combined` passes: N=128, P=64, R=4, hasZ, hasD and reduceO True,
chunk_size 16, rotary_dim_divisor 4, dtype "bfloat16", threads 128 (bwd_fwd) / 256 (bwd_bwd),
num_stages 0, and
  static:   B=1, S=256, H=8, G=1;
  dynamic:  B, S, H, G as T.dynamic symbols, as mamba_mimo_bwd_combined builds them.
On a CUDA host each is compiled the way mamba_ssm does it (calling the JITImpl: lowering, CUDA source,
nvcc; target from the GPU). On a host without CUDA (or with --lower-only) each is lowered with
`tilelang.lower` for an explicit target (`--arch`, default sm_90a: TMA needs Hopper) under the
factory's pass configs: every TIR pass, layout inference included, and CUDA source generation, but
no nvcc and no kernel load. Layout inference, where the reported FloorMod arises, is a host-side
pass, so this needs no GPU. When a TMA-on build fails, the release's own configuration (TMA off)
is built once at the first shape as a control. TileLang's kernel cache is off for the run. The
reproducer runs with the z3-solver wheel's lib folder first on LD_LIBRARY_PATH (see
z3_first_on_library_path: from a tree, libtvm.so would otherwise resolve libz3.so from the system
search path, which may hold none); the libz3 mapped is printed.

Prints, after the host stamp line:
  BUG_REPRODUCED   a build raised with "FloorMod" / "divide by zero" in the message (first lines shown)
  NOT_REPRODUCED   no build raised it; says exactly what was tried
  FIX_VALIDATED    with NOT_REPRODUCED, when every TMA-on build succeeded: the guard holds
  OTHER_FAILURE    a TMA-on build failed with another error. On tilelang 0.1.8 all four fail with
                   "Check failed: (shared_layout->InputDim() == 2) is false: Cannot detect TMA
                   layout." (our CPU run): TMA copy lowering wants 2-D shared layouts and these
                   kernels copy into 1-D and 3-D shared buffers (pack 15), so the build stops before
                   a FloorMod could show; the TMA-off control builds
Proves: whether these two kernels build with TMA lowering on, with this tilelang, at these shapes.
Does not prove: anything at other shapes, the varlen kernels, kernel correctness or speed with TMA
on, or (when not reproduced) that #2469 is fixed: only that this command does not trigger it.
Exit codes: 0 FIX_VALIDATED, or BUG_REPRODUCED on a tilelang older than 0.1.12 (the report's affected
range); 1 otherwise (BUG_REPRODUCED on >= 0.1.12 is a regression of the fix).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIXED_IN = (0, 1, 12)
MODULE = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_bwd"
FACTORIES = (("mamba_mimo_bwd_fwd", 128), ("mamba_mimo_bwd_bwd", 256))
PARAMS = ["B", "S", "H", "G", "N", "P", "R", "hasZ", "hasD", "reduceO", "chunk_size", "rotary_dim_divisor", "dtype",
          "threads", "num_stages"]
FLOORMOD = re.compile(r"floormod|divide by zero", re.IGNORECASE)
DEFAULT_MAMBA = Path(__file__).resolve().parents[3] / "third_party" / "mamba"


def git_head(tree: Path, rev: str = "HEAD") -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", rev], capture_output=True, text=True)
    return out.stdout.strip()[:12] if out.returncode == 0 else "-"


def host_stamp(tree: Path, mamba_tree: Path, tilelang: types.ModuleType | None) -> str:
    import torch
    import triton

    gpu, cap, driver = "cpu", "", ""
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        cap = "{}.{}".format(*torch.cuda.get_device_capability(0))
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    if tilelang is None:
        imported = "tilelang=none"
    else:
        origin = Path(tilelang.__file__).resolve().parent.parent
        where = "tree" if origin == tree else str(origin)
        imported = f"tilelang={tilelang.__version__} imported_from={where}"
    try:
        imported += f" installed={importlib.metadata.version('tilelang')}"  # a tilelang distribution in this environment
    except importlib.metadata.PackageNotFoundError:
        imported += " installed=none"
    return (f"host: gpu={gpu}{f' (sm {cap})' if cap else ''} driver={driver or '-'} python={platform.python_version()}"
            f" torch={torch.__version__} triton={triton.__version__} cuda={torch.version.cuda or '-'}"
            f" upstream=tilelang base={git_head(tree, 'upstream')} tree={git_head(tree)} {imported}"
            f" mamba={git_head(mamba_tree)}")


def z3_first_on_library_path() -> str:
    """libtvm.so NEEDs libz3.so, found through its RUNPATH $ORIGIN/../../z3/lib only in a site-packages
    install; imported from a tree it falls back to the system search path, which on a GPU node may hold
    none (and a system libz3 made lowering 10x slower on our CPU host). Preloading the wheel's library
    does not satisfy that NEEDED entry (its soname is libz3.so.4.15), and the loader reads
    LD_LIBRARY_PATH only when a process starts: so the reproducer re-executes itself once with the
    z3-solver wheel's lib folder first on LD_LIBRARY_PATH."""
    spec = importlib.util.find_spec("z3")
    lib_dir = Path(spec.origin).parent / "lib" if spec and spec.origin else None
    if lib_dir is None or not (lib_dir / "libz3.so").exists():
        return "z3-solver's libz3.so not found: libtvm.so resolves libz3.so from the system search path"
    paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if not paths or paths[0] != str(lib_dir):
        os.environ["LD_LIBRARY_PATH"] = ":".join([str(lib_dir), *paths])
        os.execv(sys.executable, [sys.executable, *sys.argv])
    return f"{lib_dir} first on LD_LIBRARY_PATH"


def mapped_z3() -> list[str]:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if "libz3" in line})


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def stub_mamba1_extension(mamba_tree: Path) -> str | None:
    """The mamba_ssm release imports the Mamba-1 CUDA extension at `import mamba_ssm` (our mamba patch 0001
    makes that lazy). Where the tree does so and the extension is not installed, a stub stands in: the
    MIMO kernels never call it, and any use of it raises."""
    source = (mamba_tree / "mamba_ssm/ops/selective_scan_interface.py").read_text()
    if not re.search(r"^import selective_scan_cuda\b", source, re.MULTILINE):
        return None
    try:
        import selective_scan_cuda  # noqa: F401
    except ImportError as exc:
        reason = str(exc)
        stub = types.ModuleType("selective_scan_cuda")

        def missing(name: str) -> None:
            raise AttributeError(f"selective_scan_cuda.{name}: a stub from this reproducer ({reason})")

        stub.__dict__["__getattr__"] = missing
        sys.modules["selective_scan_cuda"] = stub
        return f"selective_scan_cuda (the Mamba-1 CUDA extension) is not installed ({reason}): stubbed, unused here"
    return None


def short(exc: BaseException, lines: int = 6) -> str:
    """The error's first lines, and its last line when that is further down (TVM puts the check message there)."""
    text = [ln.rstrip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
    keep = text[:lines] + (["...", text[-1]] if len(text) > lines else [])
    return " | ".join(keep)


def build(factory: Any, args: tuple, lower_only: bool, arch: str) -> None:
    """Compile (CUDA host) or lower for an explicit target (no CUDA / --lower-only); raises on failure."""
    if not lower_only:
        factory(*args)  # what mamba_ssm does: the JITImpl call lowers, generates CUDA and compiles it
        return
    import tilelang
    import tvm
    from tvm.target import Target

    prim = factory.get_tir(*args)
    target = Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(opt_level=3, config=dict(factory.pass_configs or {})), target:
        tilelang.lower(prim, target=target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a tilelang tree (the unpacked wheel; its folder is the import root)")
    parser.add_argument("--mamba-tree", type=Path, default=DEFAULT_MAMBA, help=f"a mamba tree (default {DEFAULT_MAMBA})")
    parser.add_argument("--shapes", choices=["static", "dynamic", "both"], default="both")
    parser.add_argument("--arch", default=None, help="CUDA arch for lowering without a GPU (default sm_90a)")
    parser.add_argument("--lower-only", action="store_true", help="lower for --arch even on a CUDA host (no nvcc)")
    args = parser.parse_args()
    z3_note = z3_first_on_library_path()
    tree, mamba_tree = args.tree.resolve(), args.mamba_tree.resolve()
    os.environ.setdefault("TILELANG_DISABLE_CACHE", "1")  # every build below is a real build
    sys.path.insert(0, str(tree))
    sys.path.insert(1, str(mamba_tree))
    try:
        tilelang = importlib.import_module("tilelang")
        import_error = None
    except Exception as exc:
        tilelang, import_error = None, exc
    print(host_stamp(tree, mamba_tree, tilelang), flush=True)
    if tilelang is None:
        print(f"OTHER_FAILURE: tilelang does not import: {short(import_error)}")
        return 1
    print(f"note: z3: {z3_note}; libz3 mapped: {', '.join(mapped_z3()) or '-'}")
    if Path(tilelang.__file__).resolve().parent.parent != tree:
        print(f"note: tilelang {tilelang.__version__} was imported from {tilelang.__file__}, not from --tree {tree}")
    import tilelang.language as T
    import torch

    note = stub_mamba1_extension(mamba_tree)
    if note:
        print(f"note: {note}")
    module = importlib.import_module(MODULE)
    if not Path(module.__file__).resolve().is_relative_to(mamba_tree):
        print(f"OTHER_FAILURE: imported {module.__file__}, not the mamba tree {mamba_tree}")
        return 1
    lower_only = args.lower_only or not torch.cuda.is_available()
    arch = args.arch or "sm_90a"
    how = (f"lowered with tilelang.lower for target cuda {arch} (every TIR pass and CUDA source generation; no nvcc)"
           if lower_only else "compiled by calling the JITImpl (target from the GPU, nvcc included)")
    print(f"mode: {how}")

    key = tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER
    shapes: dict[str, Callable[[], tuple]] = {
        "static": lambda: (1, 256, 8, 1),
        "dynamic": lambda: (T.dynamic("B"), T.dynamic("S"), T.dynamic("H"), T.dynamic("G")),
    }
    chosen = ["static", "dynamic"] if args.shapes == "both" else [args.shapes]
    tried, floormod, other = [], [], []
    for name, threads in FACTORIES:
        factory = getattr(module, name)
        params = list(factory.signature.parameters)
        if params != PARAMS:
            print(f"OTHER_FAILURE: {name} takes ({', '.join(params)}), not ({', '.join(PARAMS)}): the reproducer needs updating")
            return 1
        tma_on = dataclasses.replace(factory, pass_configs={**(factory.pass_configs or {}), key: False})
        for shape in chosen:
            bshg = shapes[shape]()
            build_args = (*bshg, 128, 64, 4, True, True, True, 16, 4, "bfloat16", threads, 0)
            label = f"{name} TMA on, {shape} (B, S, H, G) = ({', '.join(map(str, bshg))}), threads {threads}"
            start = time.perf_counter()
            try:
                build(tma_on, build_args, lower_only, arch)
                print(f"{label}: builds ({time.perf_counter() - start:.0f} s)")
            except Exception as exc:
                kind = "FloorMod / divide by zero" if FLOORMOD.search(str(exc)) else "error"
                print(f"{label}: fails after {time.perf_counter() - start:.0f} s, {kind}: {short(exc)}")
                (floormod if kind != "error" else other).append((label, exc))
            tried.append(label)
    if floormod or other:  # control: the release's own configuration (TMA off) at the first shape
        name = (floormod or other)[0][0].split(" ", 1)[0]  # the first failing factory
        threads = dict(FACTORIES)[name]
        factory = getattr(module, name)
        control_args = (*shapes[chosen[0]](), 128, 64, 4, True, True, True, 16, 4, "bfloat16", threads, 0)
        start = time.perf_counter()
        try:
            build(factory, control_args, lower_only, arch)
            print(f"control: {name} with the release's pass configs (TMA off), {chosen[0]} shapes: builds"
                  f" ({time.perf_counter() - start:.0f} s): the failure above needs TMA lowering")
        except Exception as exc:
            print(f"control: {name} with the release's pass configs (TMA off) fails too: {short(exc)}")

    version = tilelang.__version__
    if floormod:
        label, exc = floormod[0]
        print(f"BUG_REPRODUCED: tilelang {version}: {label}: {short(exc, 8)}")
        return 0 if version_tuple(version) < FIXED_IN else 1
    what = "; ".join(tried)
    print(f"NOT_REPRODUCED: no FloorMod / divide-by-zero error on tilelang {version} ({how}) for: {what}")
    if other:
        label, exc = other[0]
        hint = (" (this TileLang's TMA copy lowering needs a 2-D shared layout, and these kernels copy global memory"
                " into 1-D shared buffers and 3-D shared buffers or views: [chunk_size], [chunk_size, R, R],"
                " T.view(q_shared, [chunk_size, R, N]); the build stops there, so a FloorMod later in lowering"
                " cannot show)" if "Cannot detect TMA layout" in str(exc) else "")
        print(f"OTHER_FAILURE: {len(other)} of {len(tried)} TMA-on builds fail with another error{hint}; first: {label}: {short(exc)}")
        return 1
    print(f"FIX_VALIDATED: TMA-lowered builds of both MIMO backward kernels succeed on tilelang {version}"
          " (FloorMod divide-by-zero not reproduced with this command)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
