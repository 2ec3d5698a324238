#!/usr/bin/env python3
"""Reproducer: Mamba-3 MIMO rebuilds its TileLang kernels on every call, so host time dwarfs GPU time.

    python gpu_check.py --tree third_party/mamba [--d-model 4096] [--groups 1] [--seq 4096] [--batch 2] [--iters 5]

Builds a Mamba-3 MIMO layer from the tree (head dim 64, d_state 128, rank 4, chunk 16, expand 2) with
bf16 parameters, runs two warm-up forward+backward passes (the first compiles, or loads TileLang's disk
cache), then measures
  wall: median wall-clock time of one forward+backward (synchronized), over --iters passes;
  gpu:  the sum of the CUDA kernel times of one forward+backward, from torch.profiler.
and prints both and host overhead = wall / gpu - 1.

Prints, after the host stamp line:
  BUG_REPRODUCED  wall > 2 x gpu (the host, not the GPU, sets the step time)
  FIX_VALIDATED   wall <= 1.10 x gpu (the target: wall time within 10% of GPU time)
  NEITHER         in between
Exit codes: 0 the sentinel matches the tree (the fix commit in `git log upstream..HEAD` or not), 1
otherwise, 3 no CUDA GPU on this host.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXIT_NO_GPU = 3
FIX_SUBJECT = "Mamba-3 MIMO: build each TileLang kernel once per static configuration"


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a mamba tree (materialized by tools/apply_patches.py)")
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: the Mamba-3 MIMO kernels are TileLang/Triton CUDA kernels; no CUDA GPU on this host")
        return EXIT_NO_GPU
    from mamba_ssm.modules.mamba3 import Mamba3

    if not Path(sys.modules["mamba_ssm"].__file__).resolve().is_relative_to(tree):
        print(f"error: imported {sys.modules['mamba_ssm'].__file__}, not the tree {tree}")
        return 1
    tree_has_fix = any(s.startswith(FIX_SUBJECT) for s in git(tree, "log", "--format=%s", "upstream..HEAD").splitlines())
    torch.manual_seed(0)
    layer = Mamba3(d_model=args.d_model, d_state=128, expand=2, headdim=64, ngroups=args.groups, is_mimo=True,
                   mimo_rank=4, chunk_size=16, device="cuda").to(torch.bfloat16)
    u = torch.randn(args.batch, args.seq, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    print(f"layer: d_model={args.d_model} heads={layer.nheads} ngroups={args.groups} head dim 64, d_state 128, rank 4,"
          f" chunk 16, bf16 parameters; input [{args.batch}, {args.seq}, {args.d_model}]")

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        u.grad = None
        layer(u).float().square().mean().backward()

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    print(f"first forward+backward (compile or disk cache): {time.perf_counter() - start:.2f} s")
    step()
    torch.cuda.synchronize()
    walls = []
    for _ in range(args.iters):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
    wall_ms, gpu_ms = statistics.median(walls) * 1e3, gpu_us / 1e3
    overhead = wall_ms / gpu_ms - 1
    print(f"wall {wall_ms:.1f} ms per forward+backward (median of {args.iters}: {', '.join(f'{w * 1e3:.1f}' for w in walls)});"
          f" gpu kernels {gpu_ms:.1f} ms; host overhead {overhead * 100:.0f}% of gpu time")
    if wall_ms > 2 * gpu_ms:
        print("BUG_REPRODUCED: wall time is more than twice the GPU time (kernels rebuilt on the host every call)")
        return 1 if tree_has_fix else 0
    if wall_ms <= 1.10 * gpu_ms:
        print("FIX_VALIDATED: wall time within 10% of GPU time")
        return 0 if tree_has_fix else 1
    print("NEITHER: host overhead between 10% and 100% of GPU time")
    return 1


if __name__ == "__main__":
    sys.exit(main())
