#!/usr/bin/env python3
"""Reproducer: Megatron-LM DSA `_compute_index_scores` materializes an fp32 [sq, b, h, sk] tensor.

    python repro.py --tree third_party/megatron-lm [--batch 8] [--seq 4096] [--heads 32] [--head-dim 64]

Runs the tree's `_compute_index_scores` on CUDA at the given shape (NAM56R's indexer: 32 heads,
head dim 64, ReLU on) and measures its peak memory above the inputs. The pinned release's version
of the function (read from the tree's `upstream` tag) runs beside it for the "before" figure and a
numerical comparison.

Prints, after the host stamp line:
  BUG_REPRODUCED         the tree's function peaks above 4x its [b, sq, sk] fp32 output (the bug)
  FIX_VALIDATED          it stays within 4x, and matches the pinned release within fp32 tolerance
  MEMORY_SAVE_VERIFIED   with both peak figures, when the fix holds
Exit codes: 0 the sentinel matches the tree (bug on the base, fix on a patched tree), 1 otherwise,
3 no CUDA GPU on this host (nothing was measured).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import platform
import subprocess
import sys
from pathlib import Path

DSA = "megatron/core/transformer/experimental_attention_variant/dsa.py"
EXIT_NO_GPU = 3


def git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout


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
    head = git(tree, "rev-parse", "HEAD").strip()
    base = git(tree, "rev-parse", "upstream").strip()
    return (f"host: gpu={gpu}{f' (sm {cap})' if cap else ''} driver={driver or '-'} python={platform.python_version()}"
            f" torch={torch.__version__} triton={triton_version} cuda={torch.version.cuda or '-'}"
            f" upstream=megatron-lm base={base[:12]} tree={head[:12]}")


def base_function(module, tree: Path, name: str):
    source = git(tree, "show", f"upstream:{DSA}")
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = dict(vars(module))
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"upstream:{DSA}", "exec"), namespace)
    return namespace[name]


def peak_extra_bytes(fn, *args, **kwargs):
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fn(*args, **kwargs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    events[0].record()
    for _ in range(3):
        fn(*args, **kwargs)
    events[1].record()
    torch.cuda.synchronize()
    return out, peak, events[0].elapsed_time(events[1]) / 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="materialized megatron-lm tree (patched or at `upstream`)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: this reproducer measures CUDA memory; no CUDA GPU on this host")
        return EXIT_NO_GPU
    dsa = importlib.import_module("megatron.core.transformer.experimental_attention_variant.dsa")
    if not Path(dsa.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {dsa.__file__}, not the tree {tree}")
        return 1
    tree_is_base = git(tree, "rev-parse", "HEAD").strip() == git(tree, "rev-parse", "upstream").strip()
    original = base_function(dsa, tree, "_compute_index_scores")

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    q = torch.randn(s, b, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    k = torch.randn(s, b, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(s, b, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    output_bytes = b * s * s * 4
    gib = 2.0**30
    tree_out, tree_peak, tree_ms = peak_extra_bytes(dsa._compute_index_scores, q, w, k, use_relu=True)
    ref_out, ref_peak, ref_ms = peak_extra_bytes(original, q, w, k, use_relu=True)
    max_err = (tree_out - ref_out).abs().max().item()
    rel_err = ((tree_out - ref_out).norm() / ref_out.norm()).item()
    print(f"shape: sq=sk={s} b={b} index_heads={h} head_dim={d} relu=on; output [b, sq, sk] fp32 = {output_bytes / gib:.2f} GiB")
    print(f"pinned release: peak {ref_peak / gib:.2f} GiB, {ref_ms:.1f} ms")
    print(f"this tree:      peak {tree_peak / gib:.2f} GiB, {tree_ms:.1f} ms; max abs err {max_err:.3e}, rel err {rel_err:.3e}")
    bug = tree_peak > 4 * output_bytes
    if bug:
        print("BUG_REPRODUCED: the function's peak is "
              f"{tree_peak / output_bytes:.1f}x its output (the fp32 [sq, b, h, sk] intermediate)")
        return 0 if tree_is_base else 1
    correct = rel_err < 1e-5
    if not correct:
        print(f"error: the tree's result differs from the pinned release (rel err {rel_err:.3e})")
        return 1
    print("FIX_VALIDATED: peak within 4x the output and equal to the pinned release within fp32 tolerance")
    print(f"MEMORY_SAVE_VERIFIED: before {ref_peak / gib:.2f} GiB, after {tree_peak / gib:.2f} GiB "
          f"({ref_peak / max(tree_peak, 1):.1f}x less)")
    return 1 if tree_is_base else 0


if __name__ == "__main__":
    sys.exit(main())
