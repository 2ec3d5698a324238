#!/usr/bin/env python3
"""Regression guard: Liger's fused linear cross-entropy with reduction="none" must backpropagate a
per-token (non-uniform) grad_output, e.g. a loss mask, correctly.

    python repro.py --tree third_party/liger-kernel [--tokens 4096 --hidden 2048 --vocab 32768]

Liger-Kernel through v0.8.1 got this backward wrong; v0.8.2 (our pin) fixed it. The guard compares
input and weight gradients of LigerFusedLinearCrossEntropyFunction(reduction="none") under a random
per-token grad_output (a quarter of the tokens masked to 0) against eager PyTorch (bf16 matmul, fp32
cross-entropy) at the given shape, in bf16.

Prints, after the host stamp line:
  BUG_REPRODUCED   a gradient differs from the reference by more than bf16 noise (rel L2 > 2e-2)
  FIX_VALIDATED    all gradients and the per-token loss match within bf16 noise
Exit codes: 0 when the sentinel is the expected one for the tree's version (bug for < 0.8.2, fix for
>= 0.8.2; read from the tree's PKG-INFO or pyproject), 1 otherwise, 3 no CUDA GPU on this host.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
from pathlib import Path

EXIT_NO_GPU = 3
FIXED_IN = (0, 8, 2)


def tree_version(tree: Path) -> tuple[int, ...]:
    for name in ("PKG-INFO", "pyproject.toml"):
        path = tree / name
        if path.is_file():
            match = re.search(r'^(?:Version: |version = ")(\d+)\.(\d+)\.(\d+)', path.read_text(), re.M)
            if match:
                return tuple(int(g) for g in match.groups())
    raise SystemExit(f"error: no version found in {tree}/PKG-INFO or pyproject.toml")


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
    head = "-"
    if (tree / ".git").exists():
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "-"
    return (f"host: gpu={gpu}{f' (sm {cap})' if cap else ''} driver={driver or '-'} python={platform.python_version()}"
            f" torch={torch.__version__} triton={triton_version} cuda={torch.version.cuda or '-'}"
            f" upstream=liger-kernel version={'.'.join(map(str, tree_version(tree)))} tree={head[:12]}")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a Liger-Kernel tree (src/ layout)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree / "src"))
    print(host_stamp(tree), flush=True)
    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: Liger's kernels are Triton CUDA kernels; no CUDA GPU on this host")
        return EXIT_NO_GPU
    from liger_kernel.ops import fused_linear_cross_entropy as flce

    if not Path(flce.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {flce.__file__}, not the tree {tree}")
        return 1
    expect_fix = tree_version(tree) >= FIXED_IN
    torch.manual_seed(0)
    bt, h, v = args.tokens, args.hidden, args.vocab
    x = (torch.randn(bt, h, device="cuda") * 0.5).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda") * h**-0.5).to(torch.bfloat16)
    y = torch.randint(0, v, (bt,), device="cuda")
    y[::17] = -100  # some ignored tokens too
    grad_out = torch.rand(bt, device="cuda")
    grad_out[torch.rand(bt, device="cuda") < 0.25] = 0.0  # a loss mask

    xf, wf = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = flce.LigerFusedLinearCrossEntropyFunction.apply(xf, wf, y, None, None, -100, 0.0, 0.0, "none")
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward(grad_out)

    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy((xr @ wr.t()).float(), y, ignore_index=-100, reduction="none")
    ref.backward(grad_out)
    errs = {"loss": rel(loss, ref), "grad_input": rel(xf.grad, xr.grad), "grad_weight": rel(wf.grad, wr.grad)}
    print(f"shape: tokens={bt} hidden={h} vocab={v} bf16; rel L2 vs eager: "
          + ", ".join(f"{k} {e:.3e}" for k, e in errs.items()))
    if all(e < 2e-2 for e in errs.values()):
        print("FIX_VALIDATED: reduction='none' backward with a per-token grad_output matches eager PyTorch")
        return 0 if expect_fix else 1
    print("BUG_REPRODUCED: reduction='none' backward with a per-token grad_output differs from eager PyTorch")
    return 1 if expect_fix else 0


if __name__ == "__main__":
    sys.exit(main())
