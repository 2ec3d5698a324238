#!/usr/bin/env python3
"""Regression guard: every Mamba-3 MIMO TileLang kernel is built with TMA lowering off, and runs.

    python repro.py --tree third_party/mamba [--groups N] [--seq 512] [--batch 2] [--varlen]

The Mamba-3 MIMO backward (mamba_ssm/ops/tilelang/mamba3/mamba3_mimo_bwd.py, and its varlen twin)
allocates rank-3 shared-memory buffers `[chunk_size, R, R]` (`qk_dot_shared`), which TileLang's TMA
lowering does not handle (the forward has `[chunk_size, R, P]` ones). This release builds every
MIMO kernel with `TL_DISABLE_TMA_LOWER: True`, so the default path never meets that lowering.
This guard checks that it stays so:

1. Static check (any host): every `@tilelang.jit(...)` in mamba_ssm/ops/tilelang/mamba3/*.py is
   parsed with `ast` and must carry `pass_configs={..., tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER:
   True, ...}`. Where tilelang imports (it does on a CPU host with the wheel installed, and on the GPU
   host), the modules are also imported and each tilelang JITImpl object's `pass_configs` is read
   back, so a value set anywhere but the decorator literal is seen too. The rank-3
   `T.alloc_shared` buffers found are listed.
2. GPU run: a MIMO layer from the tree, `Mamba3(d_model=1024, d_state=128, expand=2, headdim=64,
   ngroups=G, is_mimo=True, mimo_rank=4, chunk_size=16, device="cuda")` (float32 parameters, bf16
   autocast), forward and backward on an input [2, 512, 1024]; every parameter gradient and the input
   gradient must be finite. G defaults to 8 (NAM56R's grouping; 32 heads) where the tree's MIMO
   backward accepts 1 < ngroups < nheads (our patch 0005, pack 13), and to 1 on the pinned release,
   whose backward raises "G value of 8 is not currently supported!" (pack 13's bug, not this
   guard's subject). `--varlen` adds the varlen kernels (two sequences packed in one row).
   TileLang's kernel cache is off (TILELANG_DISABLE_CACHE=1 unless set), so every kernel is compiled.

Prints, after the host stamp line:
  FIX_VALIDATED    TMA lowering is off in every MIMO kernel and the default path compiles and runs
                   (finite gradients); also printed, with a note, if TMA lowering is on and it still runs
  BUG_REPRODUCED   TMA lowering is on in some kernel and the layer fails to compile or run
  OTHER_FAILURE    the layer fails although TMA lowering is off everywhere, or gradients are not finite
Proves: the default MIMO kernels of this tree compile and run forward and backward at this shape with
TMA lowering off. Does not prove: anything with TMA lowering on (pack 16 tries that), other shapes
or ranks, numerical accuracy (pack 02 and 13 compare outputs), or speed.
Exit codes (a regression guard: FIX_VALIDATED is expected on every tree): 0 FIX_VALIDATED, 1 otherwise,
3 no CUDA GPU on this host (the static result is printed first; nothing is run).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import platform
import re
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

EXIT_NO_GPU = 3
KERNEL_DIR = "mamba_ssm/ops/tilelang/mamba3"
TMA_KEY = "TL_DISABLE_TMA_LOWER"
GROUPS_RESTRICTION = "is not currently supported"  # the release's 1 < ngroups < nheads error in mamba3_mimo_bwd.py


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout.strip()


def host_stamp(tree: Path) -> str:
    import torch
    import triton

    gpu, cap, driver = "cpu", "", ""
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        cap = "{}.{}".format(*torch.cuda.get_device_capability(0))
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    return (f"host: gpu={gpu}{f' (sm {cap})' if cap else ''} driver={driver or '-'} python={platform.python_version()}"
            f" torch={torch.__version__} triton={triton.__version__} cuda={torch.version.cuda or '-'}"
            f" upstream=mamba base={git(tree, 'rev-parse', 'upstream')[:12]} tree={git(tree, 'rev-parse', 'HEAD')[:12]}")


@dataclass
class JitSite:
    module: str
    function: str
    line: int
    tma_disabled: bool | None  # None: no literal TL_DISABLE_TMA_LOWER entry in the decorator


def _is_attr(node: ast.expr, owner: str, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name) and node.value.id == owner


def jit_sites(tree: Path) -> tuple[list[JitSite], list[str]]:
    """Each @tilelang.jit in the kernel folder with its literal TL_DISABLE_TMA_LOWER value; rank-3 shared buffers."""
    sites, rank3 = [], []
    for path in sorted((tree / KERNEL_DIR).glob("*.py")):
        module = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(module):
            if isinstance(node, ast.FunctionDef):
                for deco in node.decorator_list:
                    call = deco if isinstance(deco, ast.Call) else None
                    if not _is_attr(call.func if call else deco, "tilelang", "jit"):
                        continue
                    value = None
                    for kw in call.keywords if call else []:
                        if kw.arg == "pass_configs" and isinstance(kw.value, ast.Dict):
                            for key, val in zip(kw.value.keys, kw.value.values, strict=True):
                                if isinstance(key, ast.Attribute) and key.attr == TMA_KEY:
                                    value = isinstance(val, ast.Constant) and val.value is True
                    sites.append(JitSite(path.stem, node.name, deco.lineno, value))
            if (isinstance(node, ast.Call) and _is_attr(node.func, "T", "alloc_shared") and node.args
                    and isinstance(node.args[0], ast.List | ast.Tuple) and len(node.args[0].elts) == 3):
                rank3.append(f"{path.stem}:{node.lineno} [{', '.join(ast.unparse(e) for e in node.args[0].elts)}]")
    return sites, rank3


def stub_mamba1_extension(tree: Path) -> str | None:
    """The pinned release imports the Mamba-1 CUDA extension at `import mamba_ssm` (our patch 0001 makes
    that lazy). Where the tree does so and the extension is not installed, a stub stands in: Mamba-3
    never calls it, and any use of it raises."""
    source = (tree / "mamba_ssm/ops/selective_scan_interface.py").read_text()
    if not re.search(r"^import selective_scan_cuda\b", source, re.MULTILINE):
        return None
    try:
        import selective_scan_cuda  # noqa: F401
    except ImportError as exc:
        reason = str(exc)
        stub = types.ModuleType("selective_scan_cuda")

        def missing(name: str) -> None:
            raise AttributeError(f"selective_scan_cuda.{name}: a stub from this guard ({reason}); Mamba-1 ops cannot run")

        stub.__dict__["__getattr__"] = missing
        sys.modules["selective_scan_cuda"] = stub
        return f"selective_scan_cuda (the Mamba-1 CUDA extension) is not installed ({reason}): stubbed, Mamba-3 does not use it"
    return None


def imported_pass_configs(tree: Path) -> dict[str, bool] | str:
    """function -> TL_DISABLE_TMA_LOWER as read from the imported JITImpl objects, or why it could not be read."""
    try:
        import tilelang
        from tilelang.jit import JITImpl
    except Exception as exc:
        return f"tilelang does not import here ({type(exc).__name__}: {exc})"
    key = tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER
    found: dict[str, bool] = {}
    for path in sorted((tree / KERNEL_DIR).glob("*.py")):
        if path.stem == "__init__":
            continue
        name = f"{KERNEL_DIR.replace('/', '.')}.{path.stem}"
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            return f"{name} does not import here ({type(exc).__name__}: {exc})"
        if not Path(module.__file__).resolve().is_relative_to(tree):
            return f"imported {module.__file__}, not the tree {tree}"
        for attr, obj in vars(module).items():
            if isinstance(obj, JITImpl) and getattr(obj.func, "orig_func", None) is not None \
                    and obj.func.orig_func.__module__ == name:
                found[f"{path.stem}.{attr}"] = (obj.pass_configs or {}).get(key) is True
    return found


def run_layer(tree: Path, groups: int, seq: int, batch: int, varlen: bool) -> None:
    """Forward and backward of a MIMO layer; raises on failure or non-finite gradients."""
    import torch
    from mamba_ssm.modules.mamba3 import Mamba3

    if not Path(sys.modules["mamba_ssm"].__file__).resolve().is_relative_to(tree):
        raise RuntimeError(f"imported {sys.modules['mamba_ssm'].__file__}, not the tree {tree}")
    torch.manual_seed(0)
    layer = Mamba3(d_model=1024, d_state=128, expand=2, headdim=64, ngroups=groups, is_mimo=True, mimo_rank=4,
                   chunk_size=16, device="cuda")
    print(f"layer: d_model 1024, {layer.nheads} heads x 64, d_state 128, rank 4, chunk 16, ngroups {groups};"
          f" float32 parameters, bf16 autocast")
    passes: list[tuple[str, torch.Tensor, torch.Tensor | None]] = [
        (f"dense [{batch}, {seq}, 1024]", torch.randn(batch, seq, 1024, device="cuda"), None)]
    if varlen:
        cu = torch.tensor([0, seq // 3, seq], dtype=torch.int32, device="cuda")
        passes.append((f"varlen [1, {seq}, 1024] as sequences {cu.tolist()}", torch.randn(1, seq, 1024, device="cuda"), cu))
    for label, u, cu_seqlens in passes:
        layer.zero_grad(set_to_none=True)
        x = u.requires_grad_(True)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x, cu_seqlens=cu_seqlens) if cu_seqlens is not None else layer(x)
        y.float().square().mean().backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        bad = [n for n, p in layer.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        if not torch.isfinite(x.grad).all():
            bad.append("input")
        missing = [n for n, p in layer.named_parameters() if p.requires_grad and p.grad is None]
        print(f"{label}: forward+backward {seconds:.1f} s (first call: includes TileLang compilation);"
              f" non-finite gradients: {bad or 'none'}; parameters without gradient: {missing or 'none'}")
        if bad:
            raise FloatingPointError(f"non-finite gradients in {label}: {bad}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a mamba tree (the pinned release or patched)")
    parser.add_argument("--groups", type=int, help="ngroups (default: 8 where the tree supports it, else 1)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--varlen", action="store_true", help="also run the varlen kernels")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    os.environ.setdefault("TILELANG_DISABLE_CACHE", "1")  # a real compile, not a kernel from TileLang's disk cache
    print(host_stamp(tree), flush=True)

    sites, rank3 = jit_sites(tree)
    tma_on = [f"{s.module}.{s.function} (line {s.line}): {'no TL_DISABLE_TMA_LOWER entry' if s.tma_disabled is None else 'not True'}"
              for s in sites if not s.tma_disabled]
    print(f"static (ast): {len(sites)} @tilelang.jit kernels in {KERNEL_DIR}: "
          + ", ".join(f"{s.module}.{s.function}" for s in sites))
    print(f"static (ast): TMA lowering left on in: {tma_on or 'none'}")
    print(f"static (ast): rank-3 shared buffers: {', '.join(rank3) or 'none'}")
    if not sites:
        print(f"error: no @tilelang.jit found in {KERNEL_DIR}: the layout changed, the guard needs updating")
        return 1
    note = stub_mamba1_extension(tree)
    if note:
        print(f"note: {note}")
    imported = imported_pass_configs(tree)
    if isinstance(imported, str):
        print(f"imported JITImpl pass_configs: not read: {imported}")
    else:
        off = sorted(k for k, v in imported.items() if v)
        on = sorted(k for k, v in imported.items() if not v)
        print(f"imported JITImpl pass_configs: TL_DISABLE_TMA_LOWER True in {len(off)} of {len(imported)} kernels;"
              f" TMA lowering on in: {on or 'none'}")
        if len(imported) != len(sites):
            print(f"note: {len(sites)} decorators in the source but {len(imported)} JITImpl objects imported")
        tma_on += [f"{k} (imported)" for k in on]

    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: the MIMO kernels are TileLang CUDA kernels; no CUDA GPU on this host (static result above)")
        return EXIT_NO_GPU
    restricted = GROUPS_RESTRICTION in (tree / KERNEL_DIR / "mamba3_mimo_bwd.py").read_text()
    groups = args.groups if args.groups is not None else (1 if restricted else 8)
    if args.groups is None:
        print(f"ngroups {groups}: " + ("this tree's MIMO backward rejects 1 < ngroups < nheads (pack 13), so 1"
                                       if restricted else "the tree accepts grouped B/C heads"))
    try:
        run_layer(tree, groups, args.seq, args.batch, args.varlen)
    except Exception as exc:
        lines = f"{type(exc).__name__}: {exc}".strip().splitlines()
        message = " | ".join(lines[:8])
        if tma_on:
            print(f"BUG_REPRODUCED: TMA lowering is on in {tma_on} and the MIMO layer fails: {message}")
        else:
            print(f"OTHER_FAILURE: the MIMO layer fails with TMA lowering off everywhere: {message}")
        return 1
    if tma_on:
        print(f"FIX_VALIDATED: the MIMO layer compiles and runs (finite gradients) although TMA lowering is on in"
              f" {tma_on}: TileLang now lowers these kernels with TMA; this guard's premise has changed")
    else:
        print("FIX_VALIDATED: the default TMA-off path compiles and runs: every MIMO kernel sets"
              " TL_DISABLE_TMA_LOWER True, and forward+backward give finite gradients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
