#!/usr/bin/env python3
"""Reproducer: Megatron-LM's fused DSA paths decline silently and fall back to the PyTorch path.

    python repro.py --tree third_party/megatron-lm

With `dsa_kernel_backend="tilelang"`, two fused paths are given inputs they cannot run, through the
same entry points that DSAttention calls:
  - the fused indexer (`dsa_kernels.run_fused_qk_topk`) with float32 q and k (the kernel is bf16-only);
  - the DSA layer's absorbed sparse attention (`dsa._run_sparse_attention`) with a head dim of 200
    (the TileLang SparseMLA kernel is specialized for other absorbed dims).
Each call is made three times with every logger captured at DEBUG. The sparse-attention result is
compared with the `dsa_kernel_backend="none"` (PyTorch) result. Then the same calls are made with a
config that sets `dsa_strict_fused_paths=True`, if the tree's TransformerConfig has that field.
Both declines are evaluated before any kernel launch, so this runs on a CPU host.

Prints, after the host stamp line:
  BUG_REPRODUCED  the paths fall back without any warning naming the failed condition (at most a
                  DEBUG breadcrumb), and there is no strict option to make a decline an error
  FIX_VALIDATED   each decline logs exactly one WARNING naming the path and the condition (once per
                  reason over repeated calls), the fallback result is unchanged, and a strict config
                  raises FusedDSAPathDeclined naming the condition
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise.

What it does not show: the TileLang kernels themselves, the post-kernel output-shape check, the two
DSAttention.forward gates (mask layout, dense indexer loss), the cuDNN backend's declines, or the
cost of the PyTorch fallback (see the DSA memory pack for that).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import platform
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

UPSTREAM = "megatron-lm"
FIX_SUBJECT = "DSA: report every fused-path decline once, and add dsa_strict_fused_paths"
PKG = "megatron.core.transformer.experimental_attention_variant"
SQ, B, HEADS, TOPK = 8, 2, 16, 64
REPEATS = 3


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
            f" upstream={UPSTREAM} base={git(tree, 'rev-parse', 'upstream^{commit}')[:12]}"
            f" tree={git(tree, 'rev-parse', 'HEAD')[:12]}")


def tree_has_fix(tree: Path) -> bool:
    return any(s.startswith(FIX_SUBJECT) for s in git(tree, "log", "--format=%s", "upstream..HEAD").splitlines())


class Recorder(logging.Handler):
    """Keeps every log record emitted while installed on the root logger."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[logging.LogRecord]:
        records, self.records = self.records, []
        return records


def indexer_call(dsa_kernels: Any, config: Any) -> Callable[[], Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(SQ, B, 8, 32, generator=gen)  # float32: the fused indexer is bf16-only
    k = torch.randn(SQ, B, 32, generator=gen)
    weights = torch.randn(SQ, B, 8, generator=gen)
    ends = torch.arange(1, SQ + 1, dtype=torch.int32)
    return lambda: dsa_kernels.run_fused_qk_topk(config, q, k, weights, 4, torch.zeros_like(ends), ends, block_size=8)


def sparse_attention_call(dsa: Any, config: Any) -> Callable[[], Any]:
    import torch

    head_dim = 200
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        absorbed_mla=True,
        query=torch.randn(SQ, B, HEADS, head_dim, generator=gen).to(torch.bfloat16),
        key=torch.randn(SQ, B, 1, head_dim, generator=gen).to(torch.bfloat16),
        value=None,
        up_v_weight=torch.randn(HEADS, 32, 128, generator=gen).to(torch.bfloat16),
        topk_indices=torch.randint(0, SQ, (B, SQ, TOPK), generator=gen),
        softmax_scale=head_dim**-0.5, mask=None, varlen_starts=None, varlen_ends=None, key_positions=None,
    )
    return lambda: dsa._run_sparse_attention(config=config, **inputs)


def describe(records: list[logging.LogRecord]) -> str:
    """One line per distinct (level, logger, message), with its count."""
    if not records:
        return " no log record at any level"
    counts = Counter((r.levelname, r.name.rsplit(".", 1)[-1], r.getMessage().split("; falling back")[0]) for r in records)
    return "".join(f"\n  {n}x {level} {name}: {message}" for (level, name, message), n in counts.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized megatron-lm tree (base or patched)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    dsa = importlib.import_module(f"{PKG}.dsa")
    dsa_kernels = importlib.import_module(f"{PKG}.dsa_kernels")
    for module in (dsa, dsa_kernels):
        if not Path(module.__file__).resolve().is_relative_to(tree):
            print(f"error: imported {module.__file__}, not the tree {tree}")
            return 1
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r})")

    def config(**extra: Any) -> Any:
        return MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=HEADS, kv_lora_rank=128, **extra)

    recorder = Recorder()
    root = logging.getLogger()
    root.addHandler(recorder)
    root.setLevel(logging.DEBUG)
    logging.getLogger("megatron").setLevel(logging.DEBUG)

    reference = sparse_attention_call(dsa, config(dsa_kernel_backend="none"))()
    recorder.take()
    cases = [
        ("fused indexer, float32 q/k", indexer_call, dsa_kernels, ("q.dtype=torch.float32",)),
        ("sparse attention, head dim 200", sparse_attention_call, dsa, ("fused sparse MLA declined", "head dim")),
    ]
    reported, fallback_ok = [], True
    for label, make, module, needles in cases:
        call = make(module, config(dsa_kernel_backend="tilelang"))
        results = [call() for _ in range(REPEATS)]
        records = recorder.take()
        warnings = [r for r in records if r.levelno >= logging.WARNING]
        naming = [r for r in warnings if all(n in r.getMessage() for n in needles)]
        print(f"{label}, default config, {REPEATS} calls:{describe(records)}")
        reported.append(len(naming) == 1 and len(warnings) == 1)
        if label.startswith("sparse"):
            same = all(torch.equal(out, reference) for out in results)
            print(f"  fallback result equals the dsa_kernel_backend='none' result: {same}")
            fallback_ok = fallback_ok and same
        else:
            fallback_ok = fallback_ok and all(out is None for out in results)

    try:
        config(dsa_kernel_backend="tilelang", dsa_strict_fused_paths=True)
        has_strict_field = True
    except TypeError as exc:
        has_strict_field = False
        print(f"strict config: MLATransformerConfig(dsa_strict_fused_paths=True) -> TypeError: {exc}")
    strict_raised = []
    if has_strict_field:
        for label, make, module, needles in cases:
            call = make(module, config(dsa_kernel_backend="tilelang", dsa_strict_fused_paths=True))
            try:
                call()
                print(f"{label}, strict config: returned without raising")
                strict_raised.append(False)
            except RuntimeError as exc:
                print(f"{label}, strict config: {type(exc).__name__}: {exc}")
                strict_raised.append(type(exc).__name__ == "FusedDSAPathDeclined" and all(n in str(exc) for n in needles))
    root.removeHandler(recorder)

    if not any(reported) and not has_strict_field:
        print("BUG_REPRODUCED: both fused paths declined and fell back to PyTorch without a warning naming the"
              " condition, and the config has no dsa_strict_fused_paths option to make a decline an error")
        return 1 if has_fix else 0
    if all(reported) and has_strict_field and all(strict_raised) and fallback_ok:
        print("FIX_VALIDATED: each decline logs one WARNING naming the path and the condition, the fallback"
              " result is unchanged, and dsa_strict_fused_paths=True raises FusedDSAPathDeclined")
        return 0 if has_fix else 1
    print(f"error: partial behaviour: reported once with the condition {reported}, strict field {has_strict_field},"
          f" strict raised {strict_raised}, fallback unchanged {fallback_ok}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
