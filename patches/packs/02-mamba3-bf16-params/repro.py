#!/usr/bin/env python3
"""Reproducer: a bf16-cast Mamba-3 MIMO layer fails in the TileLang kernel (Q_BIAS dtype expected float32).

    python repro.py --tree third_party/mamba [--d-model 512] [--seq 256] [--batch 2]

Builds a Mamba-3 MIMO layer (head dim 64, d_state 128, rank 4, chunk 16, ngroups 1) from the given
mamba tree, casts it to bf16 as Megatron's Float16Module does, and runs forward and backward. The
reference is the same weights with float32 parameters under bf16 autocast.

Prints, after the host stamp line:
  BUG_REPRODUCED   the bf16 module raises the kernel's float32 dtype error
  FIX_VALIDATED    it runs, its output matches the float32-parameter reference within bf16 tolerance
                   (relative L2 error < 2e-2) and all gradients are finite
Exit codes: 0 the sentinel matches the tree (the tree holds the fix commit, found by its subject
in `git log upstream..HEAD`, or it does not), 1 otherwise, 3 no CUDA GPU on this host.
The unpatched side is the series without this patch: mamba patch 0001 (lazy CUDA-extension import) is
needed to import mamba_ssm at all without the Mamba-1 extension.
"""

from __future__ import annotations

import argparse
import copy
import platform
import subprocess
import sys
from pathlib import Path

EXIT_NO_GPU = 3
FIX_SUBJECT = "Mamba-3: pass float32 D, dt_bias, Q/K biases and MIMO projections to the kernels"


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
            f" upstream=mamba base={git(tree, 'rev-parse', 'upstream')[:12]} tree={git(tree, 'rev-parse', 'HEAD')[:12]}")


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: the Mamba-3 MIMO kernels are TileLang/Triton CUDA kernels; no CUDA GPU on this host")
        return EXIT_NO_GPU
    from mamba_ssm.modules import mamba3

    if not Path(mamba3.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {mamba3.__file__}, not the tree {tree}")
        return 1
    tree_is_base = not any(line.startswith(FIX_SUBJECT) for line in git(tree, "log", "--format=%s", "upstream..HEAD").splitlines())
    torch.manual_seed(0)
    kwargs = dict(d_model=args.d_model, d_state=128, expand=2, headdim=64, ngroups=1, is_mimo=True, mimo_rank=4,
                  chunk_size=16, device="cuda")
    reference = mamba3.Mamba3(**kwargs)
    low = copy.deepcopy(reference).to(torch.bfloat16)
    u = torch.randn(args.batch, args.seq, args.d_model, device="cuda", dtype=torch.bfloat16)
    print(f"layer: d_model={args.d_model} heads={reference.nheads} head_dim=64 d_state=128 rank=4 chunk=16 ngroups=1;"
          f" input [{args.batch}, {args.seq}, {args.d_model}] bf16")

    u_ref = u.detach().clone().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = reference(u_ref)
    y_ref.float().square().mean().backward()

    u_low = u.detach().clone().requires_grad_(True)
    try:
        y_low = low(u_low)
        y_low.float().square().mean().backward()
    except Exception as exc:  # the pinned release's failure is a kernel argument check
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "float32" in message or "dtype" in message:
            print(f"BUG_REPRODUCED: bf16-cast MIMO layer failed: {type(exc).__name__}: {message}")
            return 0 if tree_is_base else 1
        raise
    torch.cuda.synchronize()
    out_err = rel_err(y_low, y_ref)
    grad_err = rel_err(u_low.grad, u_ref.grad)
    finite = all(torch.isfinite(p.grad).all().item() for p in low.parameters() if p.grad is not None)
    print(f"bf16 parameters vs float32 parameters: output rel err {out_err:.3e}, input-grad rel err {grad_err:.3e},"
          f" parameter grads finite: {finite}")
    if out_err < 2e-2 and grad_err < 5e-2 and finite:
        print("FIX_VALIDATED: the bf16-cast MIMO layer runs forward and backward and matches the float32-parameter layer")
        return 1 if tree_is_base else 0
    print("error: the bf16-cast layer ran but does not match the float32-parameter reference")
    return 1


if __name__ == "__main__":
    sys.exit(main())
