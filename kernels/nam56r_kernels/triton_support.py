"""What every Triton kernel in this package shares: where it may run, and how fp32 tiles are multiplied."""

from __future__ import annotations

import os

import torch


def interpreted() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def require_cuda_or_interpreter(tensor: torch.Tensor, kernel: str, reference: str) -> None:
    """Raise unless ``tensor`` is on CUDA or Triton's CPU interpreter is on (TRITON_INTERPRET=1, the CPU tests).

    There is no silent fallback: a CPU caller must pick ``reference`` itself.
    """
    if tensor.device.type != "cuda" and not interpreted():
        raise RuntimeError(f"{kernel} needs CUDA tensors, got device {tensor.device}; use {reference} for CPU")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision: fp32 operands multiplied exactly ("ieee"), not rounded to TF32 (Triton's
    default for fp32); bf16/fp16 products are exact in fp32 either way."""
    return "ieee" if dtype == torch.float32 else "tf32"
