#!/usr/bin/env python3
"""Reproducer: Megatron-LM's fused sparse MLA path takes a quantized (FP8) tensor wrapper for a bf16 tensor.

    python repro.py --tree third_party/megatron-lm

TransformerEngine is NOT used: a minimal torch.Tensor subclass stands in for TE's Float8Tensor (its
`.dtype` reports bfloat16 while the values live in an FP8 `_data` payload times `_scale_inv`; it has
`dequantize()`, and a `__torch_dispatch__` that, like TE's fallback, runs any other op on the
dequantized value). The TileLang SparseMLA kernel cannot run on a CPU host, so the tree's
`tilelang_dsa.SparseMLA` is replaced by a recorder of what the kernel would receive. The script calls
the sparse MLA path with the stand-in as the query (head dim 576, v_channels 512, 16 heads, top-k 64),
once with FP8 attention requested and three times without, capturing every log record; then once with
plain bf16 inputs and FP8 attention requested.

How the FP8 request reaches the path depends on what the tree's signatures accept (inspect.signature),
so the same script runs on the released tree and on trees carrying other patches:
  - the TileLang adapter `dsa_tilelang_kernels.run_fused_absorbed_sparse_attention` takes `config`:
    it is called with an MLATransformerConfig (`fp8_dot_product_attention=True` or default);
  - otherwise `ops.tilelang_dsa.fused_sparse_mla_absorbed` takes `fp8_attention`: it is called
    directly with that flag;
  - otherwise (the released core_v0.19.0): the adapter is called as released, without config; nothing
    on this path can receive the FP8 request, so the "requested" call is the same as the default one.

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
import inspect
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


def accepts(func: Any, name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def sparse_mla_entry(adapter: Any, tilelang_dsa: Any, make_config: Any) -> tuple[str, Any, bool]:
    """Pick how this tree's sparse MLA path can be told that FP8 attention is requested.

    Returns a description, ``call(query, key, topk_indices, fp8_requested)``, and whether the path
    can receive the FP8 request at all.
    """
    args = (DIM**-0.5, V_CHANNELS)
    if accepts(adapter.run_fused_absorbed_sparse_attention, "config"):
        def via_config(q: Any, k: Any, idx: Any, fp8: bool) -> Any:
            cfg = make_config(fp8_dot_product_attention=True) if fp8 else make_config()
            return adapter.run_fused_absorbed_sparse_attention(q, k, idx, *args, config=cfg)

        return ("dsa_tilelang_kernels.run_fused_absorbed_sparse_attention(..., config=MLATransformerConfig(...));"
                " FP8 attention requested as config.fp8_dot_product_attention=True"), via_config, True
    if accepts(tilelang_dsa.fused_sparse_mla_absorbed, "fp8_attention"):
        def via_flag(q: Any, k: Any, idx: Any, fp8: bool) -> Any:
            return tilelang_dsa.fused_sparse_mla_absorbed(q, k, idx, *args, fp8_attention=fp8)

        return ("ops.tilelang_dsa.fused_sparse_mla_absorbed(..., fp8_attention=...) (the adapter takes no config);"
                " FP8 attention requested as fp8_attention=True"), via_flag, True

    def as_released(q: Any, k: Any, idx: Any, fp8: bool) -> Any:
        return adapter.run_fused_absorbed_sparse_attention(q, k, idx, *args)

    return ("dsa_tilelang_kernels.run_fused_absorbed_sparse_attention(...) as released: neither it (no config) nor"
            " fused_sparse_mla_absorbed (no fp8_attention) can receive an FP8 attention request, so the"
            " 'requested' calls below are the same as the default ones"), as_released, False


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

    entry, call, fp8_reachable = sparse_mla_entry(adapter, tilelang_dsa, config)
    print(f"entry: {entry}")

    stand_in = stand_in_float8_class()
    gen = torch.Generator().manual_seed(5)
    query = stand_in(torch.randn(SQ, B, HEADS, DIM, generator=gen))
    key = torch.randn(SQ, B, 1, DIM, generator=gen).to(torch.bfloat16)
    topk_indices = torch.randint(0, SQ, (B, SQ, TOPK), generator=gen)
    print(f"query: {type(query).__name__}, .dtype {query.dtype}, payload _data {query._data.dtype}; key: plain bf16;"
          f" head dim {DIM}, v_channels {V_CHANNELS}, {HEADS} heads, top-k {TOPK}")

    def run(q: Any, fp8_requested: bool) -> Any:
        return call(q, key, topk_indices, fp8_requested)

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
            run(query, True)
        except NotImplementedError as exc:
            fp8_error = str(exc)
        fp8_launches = len(kernel.calls)
        fp8_logs = recorder.take()
        print(f"FP8 attention requested: kernel launched {fp8_launches}x;"
              f" {'NotImplementedError: ' + fp8_error if fp8_error else 'no error'}; log records: {fp8_logs or 'none'}")

        kernel = tilelang_dsa.SparseMLA = RecordingSparseMLA()
        outputs = [run(query, False) for _ in range(CALLS)]
        default_logs = recorder.take()
        received = {type(q).__name__ for q, _ in kernel.calls}
        print(f"FP8 attention not requested, {CALLS} calls: kernel launched {len(kernel.calls)}x, received query as {sorted(received)};"
              f" log records: {len(default_logs)}")
        for line in default_logs:
            print(f"  {line}")
        dequantized = query.dequantize().permute(1, 0, 2, 3)
        exact = bool(kernel.calls) and all(type(q) is torch.Tensor and q.dtype == torch.bfloat16 and torch.equal(q, dequantized)
                                           for q, _ in kernel.calls)
        shaped = all(out is not None and tuple(out.shape) == (SQ, B, HEADS, V_CHANNELS) for out in outputs)

        kernel = tilelang_dsa.SparseMLA = RecordingSparseMLA()
        plain = query.dequantize()
        run(plain, True)
        plain_logs = recorder.take()
        plain_ok = len(kernel.calls) == 1 and torch.equal(kernel.calls[0][0], plain.permute(1, 0, 2, 3)) and not plain_logs
        print(f"plain bf16 query, FP8 attention requested: kernel launched {len(kernel.calls)}x,"
              f" log records: {plain_logs or 'none'}")
    finally:
        tilelang_dsa.SparseMLA = original_kernel
        root.removeHandler(recorder)

    if fp8_error is None and fp8_launches == 1 and not fp8_logs:
        fp8_note = ("even with FP8 attention requested" if fp8_reachable
                    else "and no FP8 attention request can reach this path on this tree")
        print("BUG_REPRODUCED: the quantized stand-in passed the bf16 dtype check and reached the SparseMLA launch"
              f" silently, {fp8_note} (its FP8 storage dropped by the wrapper's fallback);"
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
