#!/usr/bin/env python3
"""Reproducer: the Mamba-3 MIMO backward rejects 1 < ngroups < nheads ("G value of 8 is not currently supported!").

    python gpu_check.py --tree third_party/mamba [--d-model 1024] [--groups 8] [--seq 512] [--batch 2]
    python gpu_check.py --tree third_party/mamba --nam56r      # also the NAM56R-shaped layer, bf16

A grouped layer (ngroups G, H heads, head h reading B/C group h // (H // G)) is the same function as
an ungrouped one (ngroups H) whose in_proj rows for the B and C of head h are copies of the rows of
group h // (H // G). So the check builds both from one set of weights and runs forward and backward on
the same input, dense and varlen (two sequences packed in one row through cu_seqlens):
  - outputs and the input gradient must agree;
  - the grouped layer's in_proj gradient rows for (rank r, group g) must equal the sum of the tied
    layer's rows for (rank r, head h) over the heads h of group g; every other parameter gradient
    (the per-head Q/K biases, MIMO projections, D, dt_bias, norms, out_proj) must agree directly.
Tolerance: relative L2 error below 2e-2 for every tensor (bf16 autocast, float32 parameters; the
grouped layer sums bf16 per-head q/k gradients, the tied layer sums them in its in_proj GEMM).

Prints, after the host stamp line:
  BUG_REPRODUCED  the grouped layer's backward raises the release's ngroups error
  FIX_VALIDATED   it runs and matches the tied ungrouped layer (dense and varlen)
With --nam56r it then runs d_model 4096, expand 2, head dim 64 (128 heads), d_state 128, rank 4,
chunk 16, ngroups 8 in bf16 (parameters cast as Float16Module would, batch 2 x 4096 tokens) and
prints NAM56R_LAYER_OK with peak memory and step time when every gradient is finite.
Exit codes: 0 the sentinel matches the tree (fix commit in `git log upstream..HEAD` or not), 1 otherwise,
3 no CUDA GPU on this host.
"""

from __future__ import annotations

import argparse
import copy
import platform
import subprocess
import sys
import time
from pathlib import Path

EXIT_NO_GPU = 3
FIX_SUBJECT = "Mamba-3 MIMO backward: support 1 < ngroups < nheads"
TOLERANCE = 2e-2


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


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def bc_rows(layer) -> tuple[int, int]:
    """Start of the B rows in in_proj (order z, x, B, C, ...) and the size of one of B or C."""
    return 2 * layer.d_inner, layer.d_state * layer.num_bc_heads * layer.mimo_rank


def tie_ungrouped(grouped):
    """An ngroups == nheads copy of `grouped` whose B/C rows for head h are those of group h // (H // G)."""
    import torch
    from mamba_ssm.modules.mamba3 import Mamba3

    H, G, R, N = grouped.nheads, grouped.num_bc_heads, grouped.mimo_rank, grouped.d_state
    tied = Mamba3(d_model=grouped.d_model, d_state=N, expand=grouped.expand, headdim=grouped.headdim, ngroups=H,
                  is_mimo=True, mimo_rank=R, chunk_size=grouped.chunk_size, device="cuda")
    state = {k: v.clone() for k, v in grouped.state_dict().items()}
    w = state["in_proj.weight"]
    start, size = bc_rows(grouped)
    head_to_group = torch.arange(H, device=w.device) // (H // G)
    expanded = []
    for block in (w[start:start + size], w[start + size:start + 2 * size]):  # B, then C: rows (r g n)
        expanded.append(block.view(R, G, N, -1)[:, head_to_group].reshape(R * H * N, -1))
    state["in_proj.weight"] = torch.cat([w[:start], *expanded, w[start + 2 * size:]])
    tied.load_state_dict(state)
    return tied


def fold_tied_grad(grouped, tied_grad):
    """The tied layer's in_proj gradient with each group's heads summed: comparable to the grouped layer's."""
    import torch

    H, G, R, N = grouped.nheads, grouped.num_bc_heads, grouped.mimo_rank, grouped.d_state
    start, _ = bc_rows(grouped)
    tied_size = N * H * R
    folded = [tied_grad[start + i * tied_size:start + (i + 1) * tied_size].float().view(R, G, H // G, N, -1).sum(dim=2)
              .reshape(R * G * N, -1) for i in range(2)]
    return torch.cat([tied_grad[:start].float(), *folded, tied_grad[start + 2 * tied_size:].float()])


def forward_backward(layer, u, cu_seqlens=None):
    import torch

    u = u.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(u, cu_seqlens=cu_seqlens)
    y.float().square().mean().backward()
    return y.detach(), u.grad, {name: p.grad for name, p in layer.named_parameters()}


def compare(grouped, tied, u, cu_seqlens, label: str) -> float:
    y_g, du_g, grads_g = forward_backward(grouped, u, cu_seqlens)
    y_t, du_t, grads_t = forward_backward(tied, u, cu_seqlens)
    errors = {"output": rel_err(y_g, y_t), "input grad": rel_err(du_g, du_t)}
    for name, grad in grads_g.items():
        other = fold_tied_grad(grouped, grads_t[name]) if name == "in_proj.weight" else grads_t[name]
        errors[f"grad {name}"] = rel_err(grad, other)
    worst = max(errors, key=errors.get)
    print(f"{label}: max rel err {errors[worst]:.3e} ({worst}); output {errors['output']:.3e},"
          f" input grad {errors['input grad']:.3e}, in_proj grad {errors['grad in_proj.weight']:.3e}")
    return errors[worst]


def nam56r_layer() -> bool:
    import torch
    from mamba_ssm.modules.mamba3 import Mamba3

    torch.manual_seed(0)
    layer = Mamba3(d_model=4096, d_state=128, expand=2, headdim=64, ngroups=8, is_mimo=True, mimo_rank=4,
                   chunk_size=16, device="cuda").to(torch.bfloat16)
    u = torch.randn(2, 4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the first call compiles
        layer.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        layer(u).float().square().mean().backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finite = all(torch.isfinite(p.grad).all().item() for p in layer.parameters()) and torch.isfinite(u.grad).all().item()
    print(f"nam56r layer: d_model 4096, 128 heads x 64, d_state 128, rank 4, chunk 16, ngroups 8, bf16 parameters;"
          f" input [2, 4096, 4096]; fwd+bwd {seconds * 1e3:.1f} ms (second call);"
          f" peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; gradients finite: {finite}")
    if finite:
        print("NAM56R_LAYER_OK")
    return finite


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a mamba tree (materialized by tools/apply_patches.py)")
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--nam56r", action="store_true", help="also run the NAM56R-shaped layer (needs the fix)")
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
    grouped = Mamba3(d_model=args.d_model, d_state=128, expand=2, headdim=64, ngroups=args.groups, is_mimo=True,
                     mimo_rank=4, chunk_size=16, device="cuda")
    with torch.no_grad():  # move the biases and MIMO projections off their constant init so their grads differ per head
        for p in (grouped.B_bias, grouped.C_bias, grouped.mimo_x, grouped.mimo_z, grouped.mimo_o):
            p.mul_(1 + 0.1 * torch.randn_like(p))
    tied = tie_ungrouped(copy.deepcopy(grouped))
    print(f"layer: d_model={args.d_model} heads={grouped.nheads} ngroups={args.groups} vs tied ngroups={tied.num_bc_heads};"
          f" head dim 64, d_state 128, rank 4, chunk 16; bf16 autocast, float32 parameters")
    u = torch.randn(args.batch, args.seq, args.d_model, device="cuda")
    try:
        dense = compare(grouped, tied, u, None, f"dense [{args.batch}, {args.seq}]")
    except ValueError as exc:
        if "not currently supported" in str(exc):
            print(f"BUG_REPRODUCED: grouped MIMO backward raised ValueError: {exc}")
            return 1 if tree_has_fix else 0
        raise
    cu_seqlens = torch.tensor([0, args.seq // 3, args.seq], dtype=torch.int32, device="cuda")
    varlen = compare(grouped, tied, u[:1], cu_seqlens, f"varlen [1, {args.seq}] as sequences {cu_seqlens.tolist()}")
    if max(dense, varlen) >= TOLERANCE:
        print(f"MISMATCH: the grouped layer's gradients differ from the tied ungrouped layer's (tolerance {TOLERANCE})")
        return 1
    print(f"FIX_VALIDATED: ngroups={args.groups} MIMO backward matches the tied ngroups={tied.num_bc_heads} layer"
          f" (dense and varlen, rel err < {TOLERANCE})")
    if args.nam56r and not nam56r_layer():
        return 1
    return 0 if tree_has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
