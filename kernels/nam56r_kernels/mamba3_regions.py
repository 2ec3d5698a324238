"""Mamba-3's data-dependent-A elementwise region, eager and under regional ``torch.compile``.

Why: the original team compiled Mamba-3's elementwise regions with regional ``torch.compile`` and reported
5.93x on the data-dependent A computation and about 6% end to end. Before NAM56R turns that on (the recipe
switch ``compile_mamba_elementwise`` is refused until then), ``nox -s bench`` measures this region eager
against compiled at NAM56R's shape; this module is the one definition both sides of that measurement use.

``adt_dt_reference`` is exactly what mamba_ssm 2.3.2.post1's ``Mamba3.forward`` computes between its input
projection split and the kernel call (a CPU test checks it against ``Mamba3.forward`` itself):

- ``dd_A``, ``dd_dt``: [B, L, H] (the projection's dtype), ``dt_bias``: [H] fp32, ``a_floor``: float > 0.
- Returns ``(DT, ADT)``, fp32 [B, H, L]: ``DT = softplus(dd_dt + dt_bias)``,
  ``ADT = min(-softplus(dd_A), -a_floor) * DT``, transposed to the kernels' layout (views, not copies).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["adt_dt_compiled", "adt_dt_reference"]


def adt_dt_reference(dd_A: torch.Tensor, dd_dt: torch.Tensor, dt_bias: torch.Tensor, a_floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(DT, ADT) fp32 [B, H, L] from the projection's dd_A, dd_dt [B, L, H] (see the module docstring)."""
    if dd_A.shape != dd_dt.shape or dd_A.ndim != 3:
        raise ValueError(f"dd_A and dd_dt must both be [B, L, H], got {tuple(dd_A.shape)} and {tuple(dd_dt.shape)}")
    if dt_bias.shape != (dd_A.shape[-1],):
        raise ValueError(f"dt_bias must be [H={dd_A.shape[-1]}], got {tuple(dt_bias.shape)}")
    a = torch.clamp(-F.softplus(dd_A.to(torch.float32)), max=-a_floor)
    dt = F.softplus(dd_dt.float() + dt_bias.float())
    return dt.transpose(1, 2), (a * dt).transpose(1, 2)


@functools.cache
def adt_dt_compiled() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``adt_dt_reference`` under ``torch.compile`` (one region, full graph, dynamic shapes off), built once."""
    return torch.compile(adt_dt_reference, fullgraph=True, dynamic=False)
