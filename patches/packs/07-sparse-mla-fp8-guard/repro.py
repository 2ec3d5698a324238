#!/usr/bin/env python3
"""Reproducer: Megatron-LM's fused sparse MLA path takes a quantized (FP8) tensor wrapper for a bf16 tensor.

    python repro.py --tree third_party/megatron-lm

TransformerEngine is NOT used: a minimal torch.Tensor subclass stands in for TE's Float8Tensor (its
`.dtype` reports bfloat16 while the values live in an FP8 `_data` payload times `_scale_inv`; it has
`dequantize()`, and a `__torch_dispatch__` that, like TE's fallback, runs any other op on the
dequantized value). The TileLang SparseMLA kernel cannot run on a CPU host, so the tree's
`tilelang_dsa.SparseMLA` is replaced by a recorder of what the kernel would receive. The script calls
the TileLang adapter `dsa_tilelang_kernels.run_fused_absorbed_sparse_attention` with the stand-in as
the query (head dim 576, v_channels 512, 16 heads, top-k 64), three times with a default config and
once with `fp8_dot_product_attention=True`, capturing every log record; then once with plain bf16
inputs and FP8 attention requested.

Prints, after the host stamp line:
  BUG_REPRODUCED  the wrapper passes the dtype check and reaches the kernel launch without a word,
                  even when FP8 attention is requested (its FP8 storage silently dropped)
  FIX_VALIDATED   the wrapper is recognized: with FP8 attention requested the call raises
                  NotImplementedError before the kernel; otherwise the kernel receives the explicitly
                  dequantized plain bf16 tensor and one warning (over three calls) names the cost;
                  plain bf16 inputs pass untouched and silently
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise.

What it does not show: anything about the real TransformerEngine path (TE's QuantizedTensor and
Float8Tensor classes, their dequantize autograd, older TE where contiguous() returns the wrapper with
no storage); the TileLang kernel; the PyTorch fallback and the cuDNN backend, which the patch leaves
unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

UPSTREAM = "megatron-lm"
FIX_SUBJECT = "DSA sparse MLA: dequantize quantized tensor wrappers explicitly"
PKG = "megatron.core.transformer.experimental_attention_variant"
SQ, B, HEADS, DIM, V_CHANNELS, TOPK = 8, 2, 16, 576, 512, 64
CALLS = 3


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


def stand_in_float8_class() -> type:
    """A minimal stand-in for TE's Float8Tensor: reports bf16, stores FP8 `_data` and `_scale_inv`."""
    import torch
    from torch.utils._pytree import tree_map

    class StandInFloat8Tensor(torch.Tensor):
        @staticmethod
        def __new__(cls: type, value: torch.Tensor) -> StandInFloat8Tensor:
            self = torch.Tensor._make_wrapper_subclass(cls, value.shape, dtype=torch.bfloat16, device=value.device)
            scale = 448.0 / value.abs().max().clamp_min(1e-12).float()
            self._data = (value.float() * scale).to(torch.float8_e4m3fn)
            self._scale_inv = scale.reciprocal()
            return self

        def dequantize(self) -> torch.Tensor:
            return (self._data.float() * self._scale_inv).to(torch.bfloat16)

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            def unwrap(t: Any) -> Any:
                return t.dequantize() if isinstance(t, cls) else t

            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    return StandInFloat8Tensor


class RecordingSparseMLA:
    """Stands in for the TileLang SparseMLA autograd function: records its inputs, returns zeros."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def apply(self, query_bshd: Any, key_bshd: Any, indices: Any, softmax_scale: float, d_v: int = V_CHANNELS) -> tuple[Any, None]:
        import torch

        self.calls.append((query_bshd, key_bshd))
        b, s, h, _ = query_bshd.shape
        return torch.zeros(b, s, h, d_v, dtype=torch.bfloat16), None


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[str]:
        records, self.records = self.records, []
        return [f"{r.levelname} {r.name.rsplit('.', 1)[-1]}: {r.getMessage()}" for r in records]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized megatron-lm tree (base or patched)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    tilelang_dsa = importlib.import_module(f"{PKG}.ops.tilelang_dsa")
    adapter = importlib.import_module(f"{PKG}.dsa_tilelang_kernels")
    for module in (tilelang_dsa, adapter):
        if not Path(module.__file__).resolve().is_relative_to(tree):
            print(f"error: imported {module.__file__}, not the tree {tree}")
            return 1
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r})")
    print("NOTE: TransformerEngine is not used; a torch.Tensor subclass stands in for its Float8Tensor, and a recorder"
          " stands in for the TileLang SparseMLA kernel. The real TE path was not exercised.")

    def config(**fp8: bool) -> Any:
        return MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=HEADS, kv_lora_rank=V_CHANNELS, **fp8)

    stand_in = stand_in_float8_class()
    gen = torch.Generator().manual_seed(5)
    query = stand_in(torch.randn(SQ, B, HEADS, DIM, generator=gen))
    key = torch.randn(SQ, B, 1, DIM, generator=gen).to(torch.bfloat16)
    topk_indices = torch.randint(0, SQ, (B, SQ, TOPK), generator=gen)
    print(f"query: {type(query).__name__}, .dtype {query.dtype}, payload _data {query._data.dtype}; key: plain bf16;"
          f" head dim {DIM}, v_channels {V_CHANNELS}, {HEADS} heads, top-k {TOPK}")

    def run(q: Any, cfg: Any) -> Any:
        return adapter.run_fused_absorbed_sparse_attention(q, key, topk_indices, DIM**-0.5, V_CHANNELS, config=cfg)

    recorder = Recorder()
    root = logging.getLogger()
    root.addHandler(recorder)
    root.setLevel(logging.DEBUG)
    logging.getLogger("megatron").setLevel(logging.DEBUG)
    original_kernel = tilelang_dsa.SparseMLA
    try:
        kernel = tilelang_dsa.SparseMLA = RecordingSparseMLA()
        fp8_error = None
        try:
            run(query, config(fp8_dot_product_attention=True))
        except NotImplementedError as exc:
            fp8_error = str(exc)
        fp8_launches = len(kernel.calls)
        fp8_logs = recorder.take()
        print(f"fp8_dot_product_attention=True: kernel launched {fp8_launches}x;"
              f" {'NotImplementedError: ' + fp8_error if fp8_error else 'no error'}; log records: {fp8_logs or 'none'}")

        kernel = tilelang_dsa.SparseMLA = RecordingSparseMLA()
        outputs = [run(query, config()) for _ in range(CALLS)]
        default_logs = recorder.take()
        received = {type(q).__name__ for q, _ in kernel.calls}
        print(f"default config, {CALLS} calls: kernel launched {len(kernel.calls)}x, received query as {sorted(received)};"
              f" log records: {len(default_logs)}")
        for line in default_logs:
            print(f"  {line}")
        dequantized = query.dequantize().permute(1, 0, 2, 3)
        exact = bool(kernel.calls) and all(type(q) is torch.Tensor and q.dtype == torch.bfloat16 and torch.equal(q, dequantized)
                                           for q, _ in kernel.calls)
        shaped = all(out is not None and tuple(out.shape) == (SQ, B, HEADS, V_CHANNELS) for out in outputs)

        kernel = tilelang_dsa.SparseMLA = RecordingSparseMLA()
        plain = query.dequantize()
        run(plain, config(fp8_dot_product_attention=True))
        plain_logs = recorder.take()
        plain_ok = len(kernel.calls) == 1 and torch.equal(kernel.calls[0][0], plain.permute(1, 0, 2, 3)) and not plain_logs
        print(f"plain bf16 query, fp8_dot_product_attention=True: kernel launched {len(kernel.calls)}x,"
              f" log records: {plain_logs or 'none'}")
    finally:
        tilelang_dsa.SparseMLA = original_kernel
        root.removeHandler(recorder)

    if fp8_error is None and fp8_launches == 1 and not fp8_logs:
        print("BUG_REPRODUCED: the quantized stand-in passed the bf16 dtype check and reached the SparseMLA launch"
              " silently, even with FP8 attention requested (its FP8 storage dropped by the wrapper's fallback);"
              " TE stand-in only, the real TransformerEngine path was not exercised")
        return 1 if has_fix else 0
    cost_warned = (len(default_logs) == 1 and default_logs[0].startswith("WARNING")
                   and f"quantized {stand_in.__name__}" in default_logs[0] and "dequantize" in default_logs[0])
    refused = fp8_error is not None and fp8_launches == 0 and stand_in.__name__ in fp8_error
    if refused and cost_warned and exact and shaped and plain_ok:
        print("FIX_VALIDATED: the quantized stand-in is detected: refused (NotImplementedError) under FP8 attention,"
              " otherwise dequantized explicitly with one warning naming the cost; plain bf16 inputs untouched;"
              " TE stand-in only, the real TransformerEngine path was not exercised")
        return 0 if has_fix else 1
    print(f"error: partial behaviour: refused under FP8 {refused}, one cost warning {cost_warned}, kernel got the"
          f" dequantized tensor {exact}, output shape {shaped}, plain inputs untouched {plain_ok}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
