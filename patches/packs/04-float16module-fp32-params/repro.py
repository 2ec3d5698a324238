#!/usr/bin/env python3
"""Reproducer: Megatron-LM's Float16Module casts parameters that a kernel requires in fp32 to bf16.

    python repro.py --tree third_party/megatron-lm

Builds a small mixer module shaped like a Mamba-3 layer: a Linear projection, a buffer, and two
parameters (D and dt_bias) marked `param.keep_fp32 = True`, holding values that bf16 cannot represent
exactly. The mixer's forward stands in for a kernel that requires fp32 parameters: it raises when D or
dt_bias is not float32, as Mamba-3's TileLang MIMO kernels do ("Q_BIAS dtype expected float32").
The script wraps the mixer in the tree's Float16Module (TransformerConfig(bf16=True)) and runs one
forward through the wrapper. A single-process gloo group (world size 1, in-memory HashStore) and
`parallel_state.initialize_model_parallel(1, 1)` provide the pipeline group that the forward asks for.

Prints, after the host stamp line:
  BUG_REPRODUCED  the marked parameters were cast to bf16 (their fp32 values lost) and the forward's
                  fp32 requirement fails
  FIX_VALIDATED   the marked parameters stay float32 with their exact values and as the same Parameter
                  objects, every other parameter and buffer becomes bf16, the forward runs, and a
                  marked parameter that is not float32 is refused with TypeError
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise.

What it does not show: the fp16 path (the same code path with torch.nn.Module.half); the optimizers'
handling of the kept parameters (the patch changes no optimizer code; the standard and distributed
optimizers take fp32 model parameters as their own main parameters through their
`torch.cuda.FloatTensor` branches, which need CUDA parameters and are not exercised on a CPU host);
a real Mamba-3 layer or TileLang kernel (a stand-in check replaces the kernel).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

UPSTREAM = "megatron-lm"
FIX_SUBJECT = "Float16Module: leave parameters marked keep_fp32 in fp32"
D_VALUE = 1.0 + 2.0**-12  # between two bf16 neighbours: a bf16 round trip changes it


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


def make_mixer() -> Any:
    """A Mamba-3-like mixer whose D and dt_bias are marked keep_fp32; its forward requires them in fp32."""
    import torch

    class Mixer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.in_proj = torch.nn.Linear(8, 4, bias=False)
            self.D = torch.nn.Parameter(torch.full((4,), D_VALUE))
            self.D.keep_fp32 = True
            self.dt_bias = torch.nn.Parameter(torch.linspace(-3.0, 3.0, 4) + 2.0**-15)
            self.dt_bias.keep_fp32 = True
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for name in ("D", "dt_bias"):  # the kernel's own check, as in Mamba-3's TileLang kernels
                if getattr(self, name).dtype != torch.float32:
                    raise TypeError(f"{name} dtype expected float32, got {getattr(self, name).dtype}")
            h = self.in_proj(x).float()
            return (h * self.D + torch.nn.functional.softplus(self.dt_bias)) * self.scale.float()

    return Mixer()


def init_single_process_group() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def teardown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized megatron-lm tree (base or patched)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    module_mod = importlib.import_module("megatron.core.transformer.module")
    if not Path(module_mod.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {module_mod.__file__}, not the tree {tree}")
        return 1
    from megatron.core.transformer.transformer_config import TransformerConfig

    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r})")
    init_single_process_group()
    try:
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True)
        mixer = make_mixer()
        d_param, dt_param = mixer.D, mixer.dt_bias
        d_before, dt_before = d_param.detach().clone(), dt_param.detach().clone()
        print("mixer: in_proj Linear(8, 4) and buffer `scale` (unmarked); D and dt_bias fp32, marked keep_fp32 = True;"
              f" D = {D_VALUE!r} (not representable in bf16)")
        wrapped = module_mod.Float16Module(config, mixer)
        inner = wrapped.module
        print(f"after Float16Module(bf16=True): in_proj.weight {inner.in_proj.weight.dtype}, scale {inner.scale.dtype},"
              f" D {inner.D.dtype}, dt_bias {inner.dt_bias.dtype}")
        kept = inner.D.dtype == torch.float32 and inner.dt_bias.dtype == torch.float32
        try:
            out = wrapped(torch.randn(2, 8))
            forward_error = None
            print(f"forward through Float16Module: output {tuple(out.shape)} {out.dtype}")
        except TypeError as exc:
            forward_error = str(exc)
            print(f"forward through Float16Module: TypeError: {forward_error}")
        if not kept:
            lost = inner.D.detach().float()[0].item()
            print(f"BUG_REPRODUCED: Float16Module cast the keep_fp32 parameters to bf16 (D {D_VALUE!r} -> {lost!r})"
                  f" and the fp32-only kernel check fails: {forward_error}")
            return 1 if has_fix else 0

        problems = []
        if inner.in_proj.weight.dtype != torch.bfloat16 or inner.scale.dtype != torch.bfloat16:
            problems.append("the unmarked parameter and buffer were not cast to bf16")
        if not (torch.equal(inner.D.detach(), d_before) and torch.equal(inner.dt_bias.detach(), dt_before)):
            problems.append("the kept parameters' values changed (a round trip through bf16)")
        if inner.D is not d_param or inner.dt_bias is not dt_param:
            problems.append("the kept parameters are not the same Parameter objects")
        if forward_error is not None:
            problems.append(f"the forward failed: {forward_error}")
        bad = make_mixer()
        bad.D.data = bad.D.data.to(torch.bfloat16)
        try:
            module_mod.Float16Module(config, bad)
            problems.append("a keep_fp32 parameter created in bf16 was accepted")
        except TypeError as exc:
            print(f"a keep_fp32 parameter created in bf16: TypeError: {exc}")
        if problems:
            print("error: keep_fp32 is partly honoured: " + "; ".join(problems))
            return 1
        print("FIX_VALIDATED: keep_fp32 parameters stay float32 with their exact values (same Parameter objects),"
              " the rest is cast to bf16, and the fp32-only forward runs")
        return 0 if has_fix else 1
    finally:
        teardown()


if __name__ == "__main__":
    sys.exit(main())
