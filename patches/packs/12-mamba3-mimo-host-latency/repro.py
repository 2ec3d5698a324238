#!/usr/bin/env python3
"""Reproducer: Mamba-3 MIMO rebuilds its TileLang kernels on every call, so host time dwarfs GPU time.

    python repro.py --tree third_party/mamba [--d-model 4096] [--groups 1] [--seq 4096] [--batch 1 2] [--iters 5]

Builds a bf16 Mamba-3 MIMO layer from the tree at NAM56R's shape (d_model 4096, head dim 64, so 128
heads, d_state 128, rank 4, chunk 16, expand 2) and, for each --batch size (default 1 and 2, each
x --seq 4096 tokens), runs two warm-up forward+backward passes (the first compiles, or loads
TileLang's disk cache) and then measures one forward+backward:
  wall:  median wall-clock time, synchronized, over --iters passes;
  host:  median time until the forward and backward calls return (the host's issue time, before
         synchronizing; when the host is the bottleneck it approaches wall);
  gpu:   the sum of the CUDA kernel times of one pass, from torch.profiler.
It also prints how many kernels each tilelang.jit factory holds in its in-memory cache: one per
distinct (B, S, H, G) when the cache hits, one more per call when it misses.
ngroups defaults to 1: the base tree's backward supports only ngroups 1 or nheads (NAM56R's 8 needs
mamba patch 0005, which comes after this pack's patch).

Prints, after the host stamp line:
  BUG_REPRODUCED  wall > 2 x gpu for some batch size (the host, not the GPU, sets the step time)
  FIX_VALIDATED   wall <= 1.10 x gpu for every batch size (wall time within 10% of GPU time)
  NEITHER         otherwise
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
from dataclasses import dataclass
from pathlib import Path

EXIT_NO_GPU = 3
FIX_SUBJECT = "Mamba-3 MIMO: call the TileLang kernel factories with plain-int shapes"


@dataclass
class Timing:
    """One batch size's forward+backward, in milliseconds."""

    batch: int
    first: float
    wall: float
    host: float
    gpu: float
    walls: list[float]

    @property
    def host_bound(self) -> bool:
        return self.wall > 2 * self.gpu

    @property
    def within_target(self) -> bool:
        return self.wall <= 1.10 * self.gpu


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


def jit_cache_sizes() -> str:
    """Kernels held by each MIMO factory's tilelang.jit in-memory cache (a JITImpl's _kernel_cache)."""
    from mamba_ssm.ops.tilelang.mamba3 import mamba3_mimo_bwd, mamba3_mimo_fwd

    factories = {
        "mamba_mimo_fwd": mamba3_mimo_fwd.mamba_mimo_fwd,
        "mamba_mimo_bwd_fwd": mamba3_mimo_bwd.mamba_mimo_bwd_fwd,
        "mamba_mimo_bwd_bwd": mamba3_mimo_bwd.mamba_mimo_bwd_bwd,
    }
    sizes = {name: len(getattr(f, "_kernel_cache", ())) for name, f in factories.items()}
    return " ".join(f"{name}={n}" for name, n in sizes.items())


def measure(layer, batch: int, seq: int, d_model: int, iters: int) -> Timing:
    import torch

    u = torch.randn(batch, seq, d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        u.grad = None
        layer(u).float().square().mean().backward()

    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    step()
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
    return Timing(batch=batch, first=first * 1e3, wall=statistics.median(walls) * 1e3, host=statistics.median(hosts) * 1e3,
                  gpu=gpu_us / 1e3, walls=[w * 1e3 for w in walls])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a mamba tree (materialized by tools/apply_patches.py)")
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--groups", type=int, default=1, help="ngroups (the base tree's backward supports 1 or nheads)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2], help="batch sizes to measure, in order")
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
    print(f"layer: d_model={args.d_model} heads={layer.nheads} ngroups={args.groups} head dim 64, d_state 128, rank 4,"
          f" chunk 16, bf16 parameters; input [B, {args.seq}, {args.d_model}] for B in {args.batch}")

    timings = []
    for batch in args.batch:
        t = measure(layer, batch, args.seq, args.d_model, args.iters)
        timings.append(t)
        print(f"batch {batch} x {args.seq}: first forward+backward (compile or disk cache) {t.first:.0f} ms; then per forward+backward:"
              f" wall {t.wall:.1f} ms (median of {args.iters}: {', '.join(f'{w:.1f}' for w in t.walls)}),"
              f" host {t.host:.1f} ms, gpu kernels {t.gpu:.1f} ms; wall - gpu = {t.wall - t.gpu:.1f} ms"
              f" ({(t.wall / t.gpu - 1) * 100:.0f}% of gpu time)", flush=True)
    passes = len(args.batch) * (args.iters + 3)
    print(f"tilelang.jit cache after {passes} forward+backward passes at {len(args.batch)} shape(s): {jit_cache_sizes()}")

    if any(t.host_bound for t in timings):
        worst = max(timings, key=lambda t: t.wall / t.gpu)
        print(f"BUG_REPRODUCED: at batch {worst.batch}, wall {worst.wall:.1f} ms is more than twice the GPU time {worst.gpu:.1f} ms"
              " (the kernels are rebuilt on the host every call)")
        return 1 if tree_has_fix else 0
    if all(t.within_target for t in timings):
        print(f"FIX_VALIDATED: wall time within 10% of GPU time at every batch size ({', '.join(str(b) for b in args.batch)})")
        return 0 if tree_has_fix else 1
    print("NEITHER: host overhead between 10% and 100% of GPU time for some batch size")
    return 1


if __name__ == "__main__":
    sys.exit(main())
