#!/usr/bin/env python3
"""Check: the SISO backward with V @ dO^T computed once gives the same gradients as the unpatched one.

    python gpu_check.py run --tree TREE --save grads-TREE.pt     # once per tree (base, patched)
    python gpu_check.py compare grads-base.pt grads-patched.pt

`run` builds a Mamba-3 SISO layer from TREE (d_model 512, head dim 64, d_state 128, chunk 64),
runs forward and backward twice on fixed inputs, and saves the gradients of the input and of every
parameter plus the median backward time over 20 repeats. Triton's autotuner is pinned to each
kernel's first configuration, so both trees run the same launch configurations (the autotuner
would otherwise pick per-run winners and reorder floating-point sums). Some SISO backward kernels
accumulate with atomic adds, so `run` also reports whether two runs on the same tree are bitwise
equal; `compare` then prints, after the host stamp line:
  FIX_VALIDATED  gradients bitwise identical across trees (or, if a tree is not run-to-run
                 deterministic, the cross-tree difference is within its run-to-run difference)
  MISMATCH       otherwise
and both backward times (no speed claim is made from one measurement).
Exit codes: 0 FIX_VALIDATED, 1 MISMATCH, 3 no CUDA GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import subprocess
import sys
from pathlib import Path

EXIT_NO_GPU = 3


def host_stamp() -> str:
    import torch

    gpu, cap, driver = "cpu", "", ""
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        cap = "{}.{}".format(*torch.cuda.get_device_capability(0))
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        driver = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    import triton

    return (f"host: gpu={gpu}{f' (sm {cap})' if cap else ''} driver={driver or '-'} python={platform.python_version()}"
            f" torch={torch.__version__} triton={triton.__version__} cuda={torch.version.cuda or '-'} upstream=mamba")


def pin_autotuner() -> None:
    import triton

    original = triton.autotune

    def first_config_only(configs, *args, **kwargs):
        return original(configs[:1], *args, **kwargs)

    triton.autotune = first_config_only


def digest(grads: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(grads):
        h.update(name.encode())
        h.update(grads[name].contiguous().view(-1).view(dtype=__import__("torch").uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def run(tree: Path, save: Path) -> int:
    sys.path.insert(0, str(tree))
    print(host_stamp(), flush=True)
    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: the SISO kernels are Triton CUDA kernels")
        return EXIT_NO_GPU
    pin_autotuner()
    from mamba_ssm.modules import mamba3

    torch.manual_seed(0)
    layer = mamba3.Mamba3(d_model=512, d_state=128, expand=2, headdim=64, is_mimo=False, chunk_size=64, device="cuda")
    u = torch.randn(2, 1024, 512, device="cuda")
    grad_y = torch.randn(2, 1024, 512, device="cuda")

    def step() -> dict:
        layer.zero_grad(set_to_none=True)
        x = u.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(grad_y.to(y.dtype))
        grads = {"input": x.grad.detach().clone()}
        grads.update({n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None})
        return grads

    first, second = step(), step()
    times = []
    for _ in range(20):
        x = u.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        y.backward(grad_y.to(y.dtype))
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    run_to_run = max((first[k].float() - second[k].float()).abs().max().item() for k in first)
    deterministic = digest(first) == digest(second)
    second_run = "bitwise equal" if deterministic else f"differs (max {run_to_run:.3e})"
    print(f"tree {tree}: grads digest {digest(first)}; second run {second_run};"
          f" backward median {statistics.median(times):.3f} ms over 20")
    torch.save({"grads": first, "run_to_run": run_to_run, "deterministic": deterministic,
                "backward_ms": statistics.median(times), "tree": str(tree)}, save)
    return 0


def compare(a: Path, b: Path) -> int:
    import torch

    print(host_stamp(), flush=True)
    ra, rb = torch.load(a), torch.load(b)
    cross = max((ra["grads"][k].float() - rb["grads"][k].float()).abs().max().item() for k in ra["grads"])
    identical = digest(ra["grads"]) == digest(rb["grads"])
    noise = max(ra["run_to_run"], rb["run_to_run"])
    print(f"{ra['tree']}: backward {ra['backward_ms']:.3f} ms; {rb['tree']}: backward {rb['backward_ms']:.3f} ms")
    if identical:
        print(f"FIX_VALIDATED: all {len(ra['grads'])} gradient tensors bitwise identical across trees")
        return 0
    if not (ra["deterministic"] and rb["deterministic"]) and cross <= noise:
        print(f"FIX_VALIDATED: cross-tree max diff {cross:.3e} within run-to-run max diff {noise:.3e} (atomic adds)")
        return 0
    print(f"MISMATCH: cross-tree max diff {cross:.3e}, run-to-run {noise:.3e}")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--tree", type=Path, required=True)
    r.add_argument("--save", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args()
    return run(args.tree.resolve(), args.save) if args.command == "run" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
