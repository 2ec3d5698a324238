#!/usr/bin/env python3
"""Reproducer: the Mamba-3 SISO backward computes the same masked V @ dO^T tile three times per chunk.

    python repro.py --tree SIDE --reference OTHER_TREE     # SIDE, OTHER_TREE: the base and patched mamba trees

The patch ("Mamba-3 SISO backward: compute the masked V @ dO^T tile once instead of three times")
is a refactor of `mamba3_siso_bwd_kernel_dqkv` (mamba_ssm/ops/triton/mamba3/mamba3_siso_bwd.py):
the product used for the dADT, dK and dQ terms is computed and masked once and reused.

1. Static check (any host): the tree's source is parsed with `ast` and the calls
   `tl.dot(v_block, tl.trans(do_block))` inside `mamba3_siso_bwd_kernel_dqkv` are counted:
   3 on the unpatched release, 1 with the patch. The reference tree's count is shown beside it.
2. Gradient check (CUDA GPU): each tree runs in its own subprocess of this script (hidden `--worker`
   mode: two mamba_ssm packages cannot be imported in one process). A worker builds a Mamba-3 SISO
   layer from its tree (d_model 512, expand 2, head dim 64, d_state 128, chunk 64; float32
   parameters, bf16 autocast; seed 0), runs forward and backward twice on fixed inputs [2, 1024, 512]
   and a fixed output gradient, and saves the gradients of the input and of every parameter, plus the
   median backward time over 20 repeats. Triton's autotuner is pinned to each kernel's first
   configuration, so both trees run the same launch configurations (the autotuner would otherwise
   pick per-run winners and reorder floating-point sums). Some SISO backward kernels accumulate with
   atomic adds, so each worker also reports whether its two runs are bitwise equal. The parent then
   compares the two trees' gradients: bitwise identical, or (when a tree is not run-to-run
   deterministic) a cross-tree max difference within the larger run-to-run difference, counts as equal.
   Both backward times are printed; no speed claim is made from one measurement.

Prints, after the host stamp line:
  BUG_REPRODUCED  --tree computes V @ dO^T 3 times (the static count); the gradient comparison with
                  --reference that follows on a GPU host is informational on this side
  FIX_VALIDATED   --tree computes it once, and its gradients equal --reference's (as above)
  MISMATCH        --tree computes it once but its gradients differ from --reference's
On the patched side --reference must be the unpatched tree (static count 3), or the run stops with
an error. On the unpatched side it may be any tree; given the same tree (or commit) as --tree, as
`packs run` does with `args = ["--reference", "{base}"]`, the comparison is a cross-process
run-to-run check of that one tree and is labelled so.
Proves: the patched kernel gives the same gradients as the unpatched one at this shape and
configuration (dense input, no varlen, one autotuner configuration). Does not prove: equality under
other autotuner configurations or shapes, or any speed change.
Exit codes: 0 the sentinel matches the tree (the fix commit in `git log upstream..HEAD` or not) and,
on a GPU host, both workers ran; 1 otherwise; 3 no CUDA GPU on this host. The static result is
printed on a CPU host too, then NEEDS_GPU and exit 3: the gradient comparison is the evidence for
the patched side, and `packs run` records nothing from a side that exits 3, so no record lacks it.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

EXIT_NO_GPU = 3
FIX_SUBJECT = "Mamba-3 SISO backward: compute the masked V @ dO^T tile once"
KERNEL_FILE = "mamba_ssm/ops/triton/mamba3/mamba3_siso_bwd.py"
KERNEL = "mamba3_siso_bwd_kernel_dqkv"
COUNT_BASE, COUNT_FIXED = 3, 1


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
    import triton

    return (f"host: gpu={gpu}{f' (sm {cap})' if cap else ''} driver={driver or '-'} python={platform.python_version()}"
            f" torch={torch.__version__} triton={triton.__version__} cuda={torch.version.cuda or '-'}"
            f" upstream=mamba base={git(tree, 'rev-parse', 'upstream')[:12]} tree={git(tree, 'rev-parse', 'HEAD')[:12]}")


def _is_tl(node: ast.expr, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name) and node.value.id == "tl"


def count_vdo(tree: Path) -> int:
    """Calls tl.dot(v_block, tl.trans(do_block)) in the dqkv backward kernel of the tree's source."""
    module = ast.parse((tree / KERNEL_FILE).read_text(), filename=KERNEL_FILE)
    kernel = next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == KERNEL)
    count = 0
    for node in ast.walk(kernel):
        if isinstance(node, ast.Call) and _is_tl(node.func, "dot") and len(node.args) >= 2:
            v, t = node.args[:2]
            if (isinstance(v, ast.Name) and v.id == "v_block" and isinstance(t, ast.Call) and _is_tl(t.func, "trans")
                    and len(t.args) == 1 and isinstance(t.args[0], ast.Name) and t.args[0].id == "do_block"):
                count += 1
    return count


def pin_autotuner() -> None:
    import triton

    original = triton.autotune

    def first_config_only(configs: list, *args: Any, **kwargs: Any) -> Any:
        return original(configs[:1], *args, **kwargs)

    triton.autotune = first_config_only


def digest(grads: dict) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(grads):
        h.update(name.encode())
        h.update(grads[name].contiguous().view(-1).view(dtype=torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def worker(tree: Path, save: Path) -> int:
    """One tree, in its own process: gradients twice, backward time, saved to `save`."""
    sys.path.insert(0, str(tree))
    import torch

    pin_autotuner()  # before mamba_ssm is imported: its kernels are decorated at import
    from mamba_ssm.modules import mamba3

    if not Path(mamba3.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {mamba3.__file__}, not the tree {tree}")
        return 1
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
    print(f"grads digest {digest(first)} ({len(first)} tensors); second run {second_run};"
          f" backward median {statistics.median(times):.3f} ms over 20")
    torch.save({"grads": first, "run_to_run": run_to_run, "deterministic": deterministic,
                "backward_ms": statistics.median(times), "tree": str(tree)}, save)
    return 0


def run_worker(tree: Path, save: Path, label: str) -> bool:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(tree), "--save", str(save)]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = (proc.stdout + (proc.stderr if proc.returncode else "")).splitlines()
    for line in lines[-40:] if proc.returncode else lines:  # prefixed, so no worker line reads as a sentinel
        print(f"  [{label}] {line}")
    if proc.returncode != 0:
        print(f"error: the {label} worker exited {proc.returncode}")
    return proc.returncode == 0


def compare(tree: Path, reference: Path) -> tuple[bool, str]:
    """(equal, description) for the two workers' gradients."""
    import torch

    same = tree == reference or git(tree, "rev-parse", "HEAD") == git(reference, "rev-parse", "HEAD")
    with tempfile.TemporaryDirectory(prefix="siso-vdo-") as scratch:
        a, b = Path(scratch) / "tree.pt", Path(scratch) / "reference.pt"
        if not (run_worker(tree, a, "tree") and run_worker(reference, b, "reference")):
            raise RuntimeError("a worker failed")
        ra, rb = torch.load(a), torch.load(b)
    kind = "cross-process run-to-run (--reference is the same commit)" if same else "cross-tree"
    cross = max((ra["grads"][k].float() - rb["grads"][k].float()).abs().max().item() for k in ra["grads"])
    identical = digest(ra["grads"]) == digest(rb["grads"])
    noise = max(ra["run_to_run"], rb["run_to_run"])
    print(f"tree {tree}: backward {ra['backward_ms']:.3f} ms; reference {reference}: backward {rb['backward_ms']:.3f} ms"
          " (one measurement each, no speed claim)")
    if ra["grads"].keys() != rb["grads"].keys():
        return False, f"the trees produce different gradient sets: {sorted(ra['grads'].keys() ^ rb['grads'].keys())}"
    if identical:
        return True, f"all {len(ra['grads'])} gradient tensors bitwise identical ({kind})"
    if not (ra["deterministic"] and rb["deterministic"]) and cross <= noise:
        return True, f"{kind} max diff {cross:.3e} within run-to-run max diff {noise:.3e} (atomic adds)"
    return False, f"{kind} max diff {cross:.3e}, run-to-run {noise:.3e}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="the mamba tree of this side")
    parser.add_argument("--reference", type=Path, help="the other side's mamba tree (required except with --worker)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = args.tree.resolve()
    if args.worker:
        if args.save is None:
            parser.error("--worker needs --save")
        return worker(tree, args.save)
    if args.reference is None:
        parser.error("--reference OTHER_TREE is required")
    reference = args.reference.resolve()
    print(host_stamp(tree), flush=True)
    tree_has_fix = any(s.startswith(FIX_SUBJECT) for s in git(tree, "log", "--format=%s", "upstream..HEAD").splitlines())

    count, ref_count = count_vdo(tree), count_vdo(reference)
    print(f"static: tl.dot(v_block, tl.trans(do_block)) in {KERNEL} ({KERNEL_FILE}): {count} in --tree,"
          f" {ref_count} in --reference; fix commit in --tree: {'yes' if tree_has_fix else 'no'}")
    if count == COUNT_BASE:
        print(f"BUG_REPRODUCED: {KERNEL} computes the masked V @ dO^T tile {count} times per chunk (static count)")
        sentinel_ok = not tree_has_fix
    elif count == COUNT_FIXED:
        if ref_count != COUNT_BASE:
            print(f"error: --reference must be the unpatched tree ({COUNT_BASE} calls) for the patched side's comparison;"
                  f" it has {ref_count}")
            return 1
        sentinel_ok = None  # decided by the gradient comparison
    else:
        print(f"error: expected {COUNT_BASE} (unpatched) or {COUNT_FIXED} (patched) calls, found {count}: the kernel changed")
        return 1

    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: the gradient comparison runs the SISO Triton kernels on CUDA; no CUDA GPU on this host")
        return EXIT_NO_GPU
    try:
        equal, how = compare(tree, reference)
    except RuntimeError as exc:
        print(f"error: {exc}")
        return 1
    if sentinel_ok is not None:  # the unpatched side: the comparison is informational here
        print(f"gradients vs --reference: {'equal' if equal else 'DIFFERENT'}: {how}")
        return 0 if sentinel_ok else 1
    if equal:
        print(f"FIX_VALIDATED: {KERNEL} computes V @ dO^T once and the gradients match --reference: {how}")
        return 0 if tree_has_fix else 1
    print(f"MISMATCH: {how}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
