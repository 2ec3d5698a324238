#!/usr/bin/env python3
"""Reproducer: Megatron-LM's TileLang sparse MLA only runs the DeepSeek V3.2/GLM5 absorbed head
(576 = 512 value + 64 rope); other MLA shapes silently take the unfused path.

    python repro.py --tree third_party/megatron-lm [--heads 32 --dim 64 --tail 64 --topk 256 --seq 1024]

Runs the tree's SparseMLA (TileLang forward and backward) at NAM56R's absorbed MLA shape (kv_lora
64 as the value part, qk rope 64 as the tail, 32 heads, top-k 256) and compares output and
gradients with a float32 PyTorch reference of sparse MLA (softmax over the selected keys only).
Claims: the kernels compile, run and agree numerically at the shapes tested. Nothing about speed.

Prints, after the host stamp line:
  BUG_REPRODUCED   the tree refuses the shape (assertion / argument error naming 576 or 512)
  FIX_VALIDATED    forward and backward run; rel L2 error of out, dq and dkv < 2e-2 (bf16 inputs)
Exit codes: 0 when the sentinel matches the tree (it holds the fix commit, found by subject in
`git log upstream..HEAD`, or not), 1 otherwise, 3 no CUDA GPU on this host.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path

EXIT_NO_GPU = 3
FIX_SUBJECT = "DSA sparse MLA: plumb the value dimension"


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
            f" upstream=megatron-lm base={git(tree, 'rev-parse', 'upstream')[:12]} tree={git(tree, 'rev-parse', 'HEAD')[:12]}")


def reference(q, kv, indices, scale, d_v):
    """Float32 sparse MLA: q [b, s, h, d+t], kv [b, skv, 1, d+t], indices [b, s, 1, k] (-1 = none)."""
    import torch

    q, kv = q.float(), kv.float()
    b, s, h, _ = q.shape
    idx = indices[:, :, 0, :].long()  # [b, s, k]
    valid = idx >= 0
    gathered = torch.gather(kv[:, :, 0, :].unsqueeze(1).expand(b, s, -1, -1), 2,
                            idx.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, kv.size(-1)))  # [b, s, k, d+t]
    logits = torch.einsum("bshd,bskd->bshk", q, gathered) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("bshk,bskd->bshd", probs, gathered[..., :d_v])


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64, help="value part of the absorbed head (kv_lora_rank)")
    parser.add_argument("--tail", type=int, default=64, help="rope tail (qk_pos_emb_head_dim)")
    parser.add_argument("--topk", type=int, default=256)
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: the sparse MLA kernels are TileLang CUDA kernels; no CUDA GPU on this host")
        return EXIT_NO_GPU
    from megatron.core.transformer.experimental_attention_variant.ops import sparse_mla

    if not Path(sparse_mla.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {sparse_mla.__file__}, not the tree {tree}")
        return 1
    has_fix = any(line.startswith(FIX_SUBJECT) for line in git(tree, "log", "--format=%s", "upstream..HEAD").splitlines())
    b, s, h, d, t, k = args.batch, args.seq, args.heads, args.dim, args.tail, args.topk
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d + t, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(b, s, 1, d + t, device="cuda", dtype=torch.bfloat16)
    # Causal top-k: query i picks k keys among 0..i (fewer for early rows, padded with -1).
    pos = torch.arange(s, device="cuda")
    scores = torch.rand(s, s, device="cuda").masked_fill(pos[None, :] > pos[:, None], -1.0)
    top = scores.topk(k, dim=-1)
    indices = top.indices.masked_fill(top.values < 0, -1).to(torch.int32)[None, :, None, :].expand(b, -1, -1, -1).contiguous()
    scale = (d + t) ** -0.5
    print(f"shape: batch {b} seq {s} heads {h} absorbed head {d}+{t} (value+rope) top-k {k}; bf16")
    q1, kv1 = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    try:
        out, _ = sparse_mla.SparseMLA.apply(q1, kv1, indices, scale, d) if has_fix else sparse_mla.SparseMLA.apply(q1, kv1, indices, scale)
        torch.cuda.synchronize()
        if out.size(-1) != d:
            raise AssertionError(f"output value dim {out.size(-1)} != {d}")
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        torch.cuda.synchronize()
    except (AssertionError, TypeError, RuntimeError) as exc:
        print(f"BUG_REPRODUCED: sparse MLA refused the {d}+{t} head: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 1 if has_fix else 0
    q2, kv2 = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    ref = reference(q2, kv2, indices, scale, d)
    ref.backward(grad_out.float())
    errs = {"out": rel(out, ref), "dq": rel(q1.grad, q2.grad), "dkv": rel(kv1.grad, kv2.grad)}
    print("rel L2 vs float32 reference: " + ", ".join(f"{n} {e:.3e}" for n, e in errs.items()))
    if all(e < 2e-2 for e in errs.values()):
        print(f"FIX_VALIDATED: TileLang sparse MLA forward and backward run at the {d}+{t} head and match the reference")
        return 0 if has_fix else 1
    print("error: sparse MLA ran but does not match the reference")
    return 1


if __name__ == "__main__":
    sys.exit(main())
