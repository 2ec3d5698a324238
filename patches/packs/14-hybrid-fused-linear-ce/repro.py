#!/usr/bin/env python3
"""Reproducer: Megatron's HybridModel LM head and MTP depths materialize [s, b, V] logits for their loss.

    python repro.py --tree third_party/megatron-lm [--seq 4096] [--batch 4] [--hidden 4096] [--vocab 131072] [--mtp-depths 2]

Runs HybridModel.forward from the given tree on its last pipeline stage (the decoder replaced by an
identity, so only the output layer and the loss run), with a bf16 output layer at the given shape
and a per-token loss mask, forward and backward, and records the peak CUDA memory above the inputs:
  unfused: the release's path (output layer, then compute_language_model_loss on the logits);
  fused:   TransformerConfig.fused_linear_cross_entropy=True (megatron-lm patches 0007/0008), on a
           tree that has it.
Then the same for the MTP depths: process_mtp_loss in training mode (loss, acceptance metric and the
MTPLossAutoScaler backward) over --mtp-depths depths sharing the output weight (megatron-lm 0008).
Numerics are checked at a small shape (seq 256, batch 2, hidden 512, vocab 8192) against the
unfused path: loss and input/weight gradients within relative L2 error 1e-2 (bf16 inputs; both
accumulate in fp32); for MTP also the acceptance counts, which may differ only where two logits tie
in bf16.

Prints, after the host stamp line:
  BUG_REPRODUCED        the tree has no fused option; the unfused peaks are printed
  MEMORY_SAVE_VERIFIED  unfused and fused peaks (GiB), when fused <= unfused / 4 (one line each for
                        the LM head and the MTP depths)
  FIX_VALIDATED         both fused paths match the unfused ones and save the memory
Exit codes: 0 the sentinel matches the tree, 1 otherwise, 3 no CUDA GPU on this host.
This shows memory and numerics at the shapes run, at tensor-parallel size 1 (the fused path rejects
TP > 1); it does not show step time.
"""

from __future__ import annotations

import argparse
import dataclasses
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


def mtp_loss(config, hidden, weight, labels, mask):
    """process_mtp_loss in training mode, then the backward a training step runs through MTPLossAutoScaler."""
    import torch
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer import multi_token_prediction as mtp

    model = SimpleNamespace(config=config, tp_group=torch.distributed.group.WORLD)
    mtp.MTPLossLoggingHelper.clean_metrics_in_tracker()
    out = mtp.process_mtp_loss(
        hidden_states=hidden, labels=labels, loss_mask=mask, output_layer=OutputLayer(weight), output_weight=None,
        runtime_gather_output=None, is_training=True,
        compute_language_model_loss=lambda lab, logits: LanguageModule.compute_language_model_loss(model, lab, logits),
        config=config, tp_group=torch.distributed.group.WORLD,
    )
    out.float().sum().backward()
    tracker = mtp.MTPLossLoggingHelper.tracker
    return torch.stack([tracker["loss_values"], tracker["correct_values"], tracker["total_values"]])


def run_mtp(config, s, b, h, v, seed=0):
    import torch

    depths = config.mtp_num_layers
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn((1 + depths) * s, b, h, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=g) / h**0.5).requires_grad_(True)
    labels = torch.randint(0, v, (b, s), device="cuda", generator=g)
    mask = (torch.rand(b, s, device="cuda", generator=g) > 0.1).float()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    metrics = mtp_loss(config, hidden, weight, labels, mask)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return metrics, hidden.grad, weight.grad, peak


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a megatron-lm tree (materialized by tools/apply_patches.py)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--mtp-depths", type=int, default=2, help="MTP depths (NAM56R: 2)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    if not torch.cuda.is_available():
        print("NEEDS_GPU: the fused linear cross-entropy is a Triton CUDA kernel; no CUDA GPU on this host")
        return EXIT_NO_GPU
    # An in-process store: a fixed TCP port collides with the other packs and runs a check starts beside this one.
    torch.distributed.init_process_group("nccl", store=torch.distributed.HashStore(), world_size=1, rank=0)
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not Path(megatron.core.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {megatron.core.__file__}, not the tree {tree}")
        return 1
    parallel_state.initialize_model_parallel()
    has_fix = any(f.name == "fused_linear_cross_entropy" for f in dataclasses.fields(TransformerConfig))
    unfused_cfg = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=1)
    s, b, h, v = args.seq, args.batch, args.hidden, args.vocab
    print(f"LM head: seq {s}, micro-batch {b}, hidden {h}, vocab {v}, bf16; logits would be {s * b * v * 2 / 2**30:.1f} GiB in bf16")
    *_, unfused_peak = run(unfused_cfg, s, b, h, v)
    print(f"unfused (release path): peak {unfused_peak:.2f} GiB above inputs")
    torch.cuda.empty_cache()
    mtp_unfused_cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, mtp_num_layers=args.mtp_depths)
    *_, mtp_unfused_peak = run_mtp(mtp_unfused_cfg, s, b, h, v)
    print(f"MTP, {args.mtp_depths} depths, unfused (release path): peak {mtp_unfused_peak:.2f} GiB above inputs")
    if not has_fix:
        print(f"BUG_REPRODUCED: TransformerConfig has no fused_linear_cross_entropy; the LM head peaks at"
              f" {unfused_peak:.2f} GiB and the MTP depths at {mtp_unfused_peak:.2f} GiB")
        return 0
    fused_cfg = dataclasses.replace(unfused_cfg, fused_linear_cross_entropy=True)
    mtp_fused_cfg = dataclasses.replace(mtp_unfused_cfg, fused_linear_cross_entropy=True)
    torch.cuda.empty_cache()
    *_, fused_peak = run(fused_cfg, s, b, h, v)
    print(f"LM head fused (fused_linear_cross_entropy): peak {fused_peak:.2f} GiB above inputs")
    torch.cuda.empty_cache()
    *_, mtp_fused_peak = run_mtp(mtp_fused_cfg, s, b, h, v)
    print(f"MTP fused: peak {mtp_fused_peak:.2f} GiB above inputs")
    small = (256, 2, 512, 8192)
    ok = True
    for label, runner, unfused, fused in (("LM head", run, unfused_cfg, fused_cfg),
                                          ("MTP", run_mtp, mtp_unfused_cfg, mtp_fused_cfg)):
        ref, got = runner(unfused, *small, seed=1), runner(fused, *small, seed=1)
        if label == "MTP":  # first item: rows (loss, correct, total) per depth
            (ref_metrics, *ref), (got_metrics, *got) = ref, got
            ref, got = (ref_metrics[0], *ref), (got_metrics[0], *got)
            print(f"MTP acceptance per depth (correct/total): unfused {ref_metrics[1].tolist()}/{ref_metrics[2].tolist()},"
                  f" fused {got_metrics[1].tolist()}/{got_metrics[2].tolist()}")
            if not torch.equal(ref_metrics[2], got_metrics[2]) or (ref_metrics[1] - got_metrics[1]).abs().max() > 2:
                print("error: the fused MTP acceptance counts differ from the unfused ones by more than bf16 ties explain")
                ok = False
        errors = {name: rel_err(x, y) for name, x, y in zip(("loss", "input grad", "weight grad"), got[:3], ref[:3], strict=True)}
        print(f"{label} numerics at seq 256, batch 2, hidden 512, vocab 8192: "
              + ", ".join(f"{k} rel err {e:.2e}" for k, e in errors.items()))
        if max(errors.values()) >= 1e-2:
            print(f"error: the fused {label} path does not match the unfused one")
            ok = False
    for label, before, after in (("LM head", unfused_peak, fused_peak), ("MTP depths", mtp_unfused_peak, mtp_fused_peak)):
        if after <= before / 4:
            print(f"MEMORY_SAVE_VERIFIED: {label} peak {before:.2f} GiB -> {after:.2f} GiB ({before / max(after, 1e-9):.1f}x less)")
        else:
            print(f"error: {label} fused peak {after:.2f} GiB is not at most a quarter of the unfused {before:.2f} GiB")
            ok = False
    if ok:
        print("FIX_VALIDATED: the fused LM head and MTP depths match the release's loss and gradients without materializing logits")
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
