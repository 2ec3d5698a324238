#!/usr/bin/env python3
"""Reproducer: Mamba-3's autograd functions cannot train under non-reentrant activation checkpointing.

    python repro.py --tree third_party/mamba

`_Mamba3Function.backward` (mamba_ssm/ops/tilelang/mamba3/mamba3_mimo.py, the MIMO path) and
`_Mamba3Function.backward` (mamba_ssm/ops/triton/mamba3/mamba3_siso_combined.py, the SISO path) read
`ctx.saved_tensors` twice. Under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` every read
runs the checkpoint's unpack hook, which hands out each saved tensor once, so the second read raises
`CheckpointError` in the first backward.

The script runs the tree's real MIMO autograd function (`mamba3_mimo`) on small CPU tensors, forward and
backward, inside a non-reentrant checkpoint, and then without one. The numeric kernels under it (TileLang
and Triton, which need a CUDA GPU) are replaced by functions that return zeros of their outputs' shapes:
the bug is in the autograd function's Python, which runs as released. The SISO function is checked by
reading its backward's source: its kernels cannot be replaced as cleanly (it calls Triton launchers
inside the function body).

Prints, after the host stamp line:
  BUG_REPRODUCED  the checkpointed backward raises torch.utils.checkpoint.CheckpointError ("Unpack is being
                  triggered for a tensor that was already unpacked once"), while the same backward without
                  checkpointing runs
  FIX_VALIDATED   the checkpointed backward runs, its gradients are those of the backward without
                  checkpointing, each backward reads ctx.saved_tensors once, and so does the SISO backward
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or not),
1 otherwise.

What it does not show: the kernels' numbers (they are replaced), or a GPU training step (NAM56R's
`--recompute mamba` runs are that check).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

UPSTREAM = "mamba"
FIX_SUBJECT = "Mamba-3: read ctx.saved_tensors once in the MIMO and SISO backward"
MIMO = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo"
SISO = "mamba_ssm/ops/triton/mamba3/mamba3_siso_combined.py"
B, S, R, G, H, N, P, CHUNK = 1, 32, 2, 1, 2, 16, 32, 16  # head dims mamba's wrapper lists as tested


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


def zero_kernels(module) -> None:
    """The numeric kernels `_Mamba3Function` calls, as zeros of their outputs' shapes (CPU-runnable)."""
    import torch

    def angle_dt_fwd(angles, dt, chunk_size, return_output_state=False, cu_seqlens=None):
        return torch.zeros_like(angles), torch.zeros(angles.shape[0], angles.shape[2], angles.shape[3])

    def segsum(adt, chunk_size, **_):
        b, h, s = adt.shape
        return torch.zeros_like(adt), torch.zeros_like(adt), torch.zeros(b, h, s // chunk_size, chunk_size, chunk_size)

    def forward(q, k, v, *args, **kwargs):
        return torch.zeros_like(v), None, None

    def backward(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, da_cs, da_cs_rev, dt, trap, d, *args, **kwargs):
        # Gradients that depend on the incoming one, so a backward that unpacks the wrong tensors would differ.
        g = dout.float().sum()
        return (q * 0 + g, k * 0 + g, v * 0 + g, da_cs * 0 + g, dt * 0 + g, trap * 0 + g, q_bias * 0 + g, k_bias * 0 + g,
                mimo_v * 0 + g, mimo_z * 0 + g, mimo_o * 0 + g, angles * 0 + g, d * 0 + g, z * 0 + g)

    def angle_dt_bwd(grad_out, angle, dt, **_):
        return grad_out.clone(), torch.zeros_like(dt), None

    module.angle_dt_fwd, module.angle_dt_bwd = angle_dt_fwd, angle_dt_bwd
    module.compute_dacs_segsum_triton = segsum
    module.mamba_mimo_forward, module.mamba_mimo_bwd_combined = forward, backward


def inputs():
    import torch

    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    bf16 = torch.bfloat16
    return [leaf(B, S, R, G, N, dtype=bf16), leaf(B, S, R, G, N, dtype=bf16), leaf(B, S, H, P, dtype=bf16),
            leaf(B, H, S), leaf(B, H, S), leaf(B, H, S), leaf(H, R, N), leaf(H, R, N), leaf(H, R, P), leaf(H, R, P),
            leaf(H, R, P), leaf(B, S, H, N // 4), leaf(H), leaf(B, S, H, P, dtype=bf16)]


class SavedTensorReads:
    """Counts reads of `ctx.saved_tensors` in autograd functions' backward (a property of the C++ node)."""

    def __init__(self) -> None:
        self.reads = 0

    def __enter__(self):
        import torch

        self.cls = torch.autograd.function.BackwardCFunction
        self.original = self.cls.saved_tensors
        counter = self

        class Counting:
            def __get__(self, obj, objtype=None):
                counter.reads += 1
                return counter.original.__get__(obj, objtype)

        self.cls.saved_tensors = Counting()
        return self

    def __exit__(self, *exc) -> None:
        self.cls.saved_tensors = self.original


def run(module, checkpointed: bool):
    import torch
    from torch.utils.checkpoint import checkpoint

    args = inputs()

    def step(*tensors):
        return module.mamba3_mimo(*tensors, CHUNK, 4, torch.bfloat16)

    with SavedTensorReads() as reads:
        out = checkpoint(step, *args, use_reentrant=False) if checkpointed else step(*args)
        out.float().sum().backward()
    return [a.grad for a in args], reads.reads


def siso_reads(tree: Path) -> int:
    """How many times the SISO backward's source reads `ctx.saved_tensors`."""
    source = (tree / SISO).read_text()
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "_Mamba3Function")
    backward = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "backward")
    return sum(isinstance(n, ast.Attribute) and n.attr == "saved_tensors" for n in ast.walk(backward))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized mamba tree (base or patched)")
    tree = parser.parse_args().tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    spec = importlib.util.find_spec(MIMO)
    if spec is None or spec.origin is None or not Path(spec.origin).resolve().is_relative_to(tree):
        print(f"error: {MIMO} resolves to {spec.origin if spec else None}, not the tree {tree}")
        return 1
    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r})")
    module = importlib.import_module(MIMO)
    zero_kernels(module)

    plain, plain_reads = run(module, checkpointed=False)
    print(f"without checkpointing: backward ran, ctx.saved_tensors read {plain_reads} time(s)")
    try:
        ckpt, ckpt_reads = run(module, checkpointed=True)
    except torch.utils.checkpoint.CheckpointError as exc:
        print(f"checkpoint(use_reentrant=False): {type(exc).__name__}: {str(exc).splitlines()[0]}")
        print("BUG_REPRODUCED: Mamba-3's MIMO backward reads ctx.saved_tensors twice, which non-reentrant activation"
              " checkpointing refuses")
        return 1 if has_fix else 0
    same = all(torch.equal(a, b) for a, b in zip(plain, ckpt, strict=True))
    siso = siso_reads(tree)
    print(f"checkpoint(use_reentrant=False): backward ran, ctx.saved_tensors read {ckpt_reads} time(s);"
          f" gradients equal to the plain backward's: {same}; SISO backward reads ctx.saved_tensors {siso} time(s) in its source")
    if not (same and plain_reads == ckpt_reads == 1 and siso == 1):
        print("error: the checkpointed backward ran, but not as one read of the saved tensors with the plain backward's gradients")
        return 1
    print("FIX_VALIDATED: the MIMO backward reads its saved tensors once and trains under non-reentrant checkpointing with"
          " the gradients of the plain backward; the SISO backward reads them once too")
    return 0 if has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
