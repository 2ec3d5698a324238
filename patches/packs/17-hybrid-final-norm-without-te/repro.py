#!/usr/bin/env python3
"""Reproducer: Megatron-LM's HybridStack builds its final norm as TENorm whatever the spec says,
so a hybrid model cannot be built without TransformerEngine.

    python repro.py --tree third_party/megatron-lm

Builds a one-layer HybridStack (pattern "-", a dense MLP layer) from a spec made only of Megatron's
local modules (WrappedTorchNorm, ColumnParallelLinear, RowParallelLinear), with post_process=True so
the stack has a final norm, then runs a forward on CPU. A single-process gloo group (world size 1,
in-memory HashStore) and `parallel_state.initialize_model_parallel(1, 1)` provide the process groups.
Run it in an environment without transformer_engine (the script says NOT_REPRODUCED if TE is
installed, since then TENorm builds).

Prints, after the host stamp line:
  BUG_REPRODUCED  building the stack raises TransformerEngine's ImportError from the final norm
  FIX_VALIDATED   the stack builds with the spec's final norm (WrappedTorchNorm -> torch RMSNorm), a
                  spec that names no final norm still gets TENorm (the default is unchanged), and a
                  forward of a [4, 2, 16] input returns finite values of the same shape
  NOT_REPRODUCED  transformer_engine is importable here, so TENorm builds and nothing fails
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise.

What it does not show: TE builds (unchanged by the patch), a GPU forward, the MTP block's own
norms (they already come from the MTP spec), checkpoint key names (the attribute stays `final_norm`).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import subprocess
import sys
from pathlib import Path

UPSTREAM = "megatron-lm"
FIX_SUBJECT = "HybridStack: build the final norm from the spec"


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


def init_single_process_group() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)


def local_mlp_stack_spec(hybrid_block, with_final_norm: bool):
    from functools import partial

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    fields = dict(
        mlp_layer=ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=WrappedTorchNorm,
                mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
                mlp_bda=get_bias_dropout_add,
            ),
        )
    )
    if with_final_norm:
        fields["final_norm"] = WrappedTorchNorm
    return ModuleSpec(module=hybrid_block.HybridStack, submodules=hybrid_block.HybridStackSubmodules(**fields))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized megatron-lm tree (base or patched)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    hybrid_block = importlib.import_module("megatron.core.models.hybrid.hybrid_block")
    if not Path(hybrid_block.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {hybrid_block.__file__}, not the tree {tree}")
        return 1
    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r})")
    have_te = importlib.util.find_spec("transformer_engine") is not None
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_single_process_group()
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, normalization="RMSNorm",
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    supports_field = "final_norm" in getattr(hybrid_block.HybridStackSubmodules, "__dataclass_fields__", {})
    spec = local_mlp_stack_spec(hybrid_block, with_final_norm=supports_field)
    print(f"spec: HybridStack, layer_type_list ['-'], local modules only; final_norm field in HybridStackSubmodules: {supports_field}")
    try:
        stack = build_module(spec, config, pre_process=True, layer_type_list=["-"], post_process=True, pg_collection=pgs)
    except ImportError as exc:
        if have_te:
            print(f"error: ImportError although transformer_engine is importable: {exc}")
            return 1
        print(f"BUG_REPRODUCED: HybridStack without TransformerEngine: ImportError from the final norm: {str(exc).splitlines()[0]}")
        return 1 if has_fix else 0
    if have_te and not supports_field:
        print("NOT_REPRODUCED: transformer_engine is installed here, so the hard-coded TENorm builds; run without TE")
        return 1
    problems = []
    norm_type = type(stack.final_norm).__name__
    print(f"built: final_norm is {norm_type}")
    if not isinstance(stack.final_norm, torch.nn.RMSNorm):
        problems.append(f"the final norm is {norm_type}, not the spec's RMSNorm")
    x = torch.randn(4, 2, 16)
    out = stack(x, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    print(f"forward: input {tuple(x.shape)} -> output {tuple(out.shape)} {out.dtype}")
    if out.shape != x.shape or not torch.isfinite(out).all():
        problems.append("the forward output has the wrong shape or non-finite values")
    default_norm = hybrid_block.HybridStackSubmodules().final_norm
    print(f"default final_norm of HybridStackSubmodules(): {getattr(default_norm, '__name__', default_norm)}")
    if getattr(default_norm, "__name__", "") != "TENorm":
        problems.append("the default final norm is no longer TENorm")
    if problems:
        print("error: " + "; ".join(problems))
        return 1
    print("FIX_VALIDATED: HybridStack builds its final norm from the spec (local RMSNorm here, TENorm by default) and runs on CPU")
    return 0 if has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
