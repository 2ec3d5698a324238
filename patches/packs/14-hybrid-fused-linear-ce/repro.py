#!/usr/bin/env python3
"""Reproducer: Megatron's HybridModel LM head materializes [s, b, V] logits for its loss.

    python repro.py --tree third_party/megatron-lm [--seq 4096] [--batch 4] [--hidden 4096] [--vocab 131072]

Runs HybridModel.forward from the given tree on its last pipeline stage (the decoder replaced by an
identity, so only the output layer and the loss run), with a bf16 output layer at the given shape
and a per-token loss mask, forward and backward, and records the peak CUDA memory above the inputs:
  unfused: the release's path (output layer, then compute_language_model_loss on the logits);
  fused:   TransformerConfig.fused_linear_cross_entropy=True (megatron-lm patches 0007/0008), on a
           tree that has it.
Numerics are checked at a small shape (seq 256, batch 2, hidden 512, vocab 8192) against the
unfused path: loss and input/weight gradients within relative L2 error 1e-2 (bf16 inputs; both
accumulate in fp32).

Prints, after the host stamp line:
  BUG_REPRODUCED        the tree has no fused option; the unfused peak is printed
  MEMORY_SAVE_VERIFIED  unfused and fused peaks (GiB), when fused <= unfused / 4
  FIX_VALIDATED         the fused path matches the unfused one and saves the memory
Exit codes: 0 the sentinel matches the tree, 1 otherwise, 3 no CUDA GPU on this host.
This shows memory and numerics of the LM-head path at the shapes run; the MTP depths (patch 0008)
use the same function and are checked on CPU (tests/megatron/test_0007_0008_fused_linear_ce.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

EXIT_NO_GPU = 3


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
            f" upstream=megatron-lm base={git(tree, 'rev-parse', 'upstream')[:12]} tree={git(tree, 'rev-parse', 'HEAD')[:12]}")


class OutputLayer:
    """The output layer's contract as HybridModel calls it: (logits, bias) = layer(hidden, weight=...)."""

    def __init__(self, weight):
        self.weight = weight
        self.sequence_parallel = False

    def __call__(self, hidden, weight=None, runtime_gather_output=None):
        return hidden @ (self.weight if weight is None else weight).T, None


def lm_head_loss(config, hidden, weight, labels, mask):
    """HybridModel.forward's loss on the last stage, then the masked sum a training step backpropagates."""
    import torch
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    model = SimpleNamespace(config=config, pre_process=False, post_process=True, mtp_process=False,
                            position_embedding_type="none", decoder=lambda hidden_states, **kwargs: hidden_states,
                            share_embeddings_and_output_weights=False, output_layer=OutputLayer(weight),
                            tp_group=torch.distributed.group.WORLD, _scale_logits=lambda logits: logits)
    model.compute_language_model_loss = lambda lab, logits: LanguageModule.compute_language_model_loss(model, lab, logits)
    loss = HybridModel.forward(model, input_ids=None, position_ids=None, attention_mask=None, decoder_input=hidden,
                               labels=labels)
    return loss, (loss * mask).sum()


def run(config, s, b, h, v, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(s, b, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5).requires_grad_(True)
    labels = torch.randint(0, v, (b, s), device="cuda", generator=g)
    mask = (torch.rand(b, s, device="cuda", generator=g) > 0.1).float()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, total = lm_head_loss(config, hidden, weight, labels, mask)
    total.backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return loss.detach(), hidden.grad, weight.grad, peak


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a megatron-lm tree (materialized by tools/apply_patches.py)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=131072)
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: the fused linear cross-entropy is a Triton CUDA kernel; no CUDA GPU on this host")
        return EXIT_NO_GPU
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.distributed.init_process_group("nccl", world_size=1, rank=0)
    import megatron.core
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not Path(megatron.core.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {megatron.core.__file__}, not the tree {tree}")
        return 1
    has_fix = any(f.name == "fused_linear_cross_entropy" for f in dataclasses.fields(TransformerConfig))
    unfused_cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1)
    s, b, h, v = args.seq, args.batch, args.hidden, args.vocab
    print(f"LM head: seq {s}, micro-batch {b}, hidden {h}, vocab {v}, bf16; logits would be {s * b * v * 2 / 2**30:.1f} GiB in bf16")
    *_, unfused_peak = run(unfused_cfg, s, b, h, v)
    print(f"unfused (release path): peak {unfused_peak:.2f} GiB above inputs")
    if not has_fix:
        print(f"BUG_REPRODUCED: TransformerConfig has no fused_linear_cross_entropy; the LM head peaks at {unfused_peak:.2f} GiB")
        return 0
    fused_cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1, fused_linear_cross_entropy=True)
    torch.cuda.empty_cache()
    *_, fused_peak = run(fused_cfg, s, b, h, v)
    print(f"fused (fused_linear_cross_entropy): peak {fused_peak:.2f} GiB above inputs")
    small = (256, 2, 512, 8192)
    ref = run(unfused_cfg, *small, seed=1)
    got = run(fused_cfg, *small, seed=1)
    errors = {name: rel_err(x, y) for name, x, y in zip(("loss", "input grad", "weight grad"), got[:3], ref[:3], strict=True)}
    print("numerics at seq 256, batch 2, hidden 512, vocab 8192: " + ", ".join(f"{k} rel err {e:.2e}" for k, e in errors.items()))
    ok = True
    if fused_peak <= unfused_peak / 4:
        print(f"MEMORY_SAVE_VERIFIED: LM head peak {unfused_peak:.2f} GiB -> {fused_peak:.2f} GiB"
              f" ({unfused_peak / max(fused_peak, 1e-9):.1f}x less)")
    else:
        print(f"error: fused peak {fused_peak:.2f} GiB is not at most a quarter of the unfused {unfused_peak:.2f} GiB")
        ok = False
    if max(errors.values()) >= 1e-2:
        print("error: the fused path does not match the unfused one")
        ok = False
    if ok:
        print("FIX_VALIDATED: the fused LM head matches the release's loss and gradients without materializing logits")
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
