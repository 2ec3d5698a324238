#!/usr/bin/env python3
"""Reproducer: on the PyTorch-optimizer path (no Apex, no TransformerEngine), a distributed-optimizer
checkpoint saved with --dist-ckpt-optim-fully-reshardable cannot be loaded: DistributedOptimizer's
_set_main_param_and_optimizer_states raises KeyError: 'step'.

    python repro.py --tree third_party/megatron-lm

torch.optim.Adam keeps a per-parameter "step" tensor in its state. load_parameter_state_from_fully_reshardable
leaves "step" out of the tensors it hands over (its comment: "Handle torch Adam 'step' state separately";
load_state_dict sets it from the param groups), but _set_main_param_and_optimizer_states then indexes the
handed-over tensors with every tensor key of the parameter's state, "step" included. Only the fully_reshardable
sharding takes this path; it is the one that resumes at another expert- or data-parallel layout.

Builds a bf16 2-layer GPTModel from the local spec on CPU, wraps it in Float16Module and DistributedDataParallel
with the distributed optimizer, builds the optimizer with `get_megatron_optimizer` (Adam, bf16), writes a
distinct gradient per parameter into DDP's grad buffer, takes two steps, builds the checkpoint with
`megatron.training.checkpointing.generate_state_dict` with args.dist_ckpt_optim_fully_reshardable=True and
saves it with `dist_checkpointing.save`. Then it builds a fresh model and optimizer from another seed, loads
the checkpoint as `load_checkpoint` does (the optimizer's state dict built with is_loading=True, then
`load_state_dict`), and compares, per parameter name, the fp32 main parameter shard, the Adam moments and the
step with those saved. A single-process gloo group (world size 1, in-memory HashStore) provides the process
groups.

The optimizer and checkpoint code assume CUDA in four places, answered for CPU here and nowhere else: the
optimizer sorts parameters by `param.type()` ('torch.cuda.BFloat16Tensor' ...), makes scalars with
device='cuda' and moves the gathered state with `.cuda()` (a TorchFunctionMode reports CPU tensors by their
dtype's CUDA type name, puts device='cuda' factories on CPU and leaves `.cuda()` tensors where they are);
DDP's buffers and the checkpoint's flags use `torch.cuda.current_device()` (the CPU device here); the checkpoint
writer calls `torch.cuda.synchronize()` after its host copies (a no-op here).

Prints, after the host stamp line:
  BUG_REPRODUCED  the load raises KeyError: 'step', or a restored main parameter, moment or step differs from
                  the saved one
  FIX_VALIDATED   the checkpoint saves and loads, and every parameter gets back its main parameter shard,
                  Adam moments and step
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or not),
1 otherwise (a save or load template that fails prints `error:` and no sentinel).

What it does not show: a GPU run; more than one rank, or a resume at another parallel layout (the load fails
before any resharding matters); Apex or TransformerEngine optimizers, whose step lives in the param groups.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import platform
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

UPSTREAM = "megatron-lm"
FIX_SUBJECT = "DistributedOptimizer._set_main_param_and_optimizer_states: skip torch Adam's per-param step"
STEPS = 2


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


def has_fix(tree: Path) -> bool:
    return any(s.startswith(FIX_SUBJECT) for s in git(tree, "log", "--format=%s", "upstream..HEAD").splitlines())


def cpu_for_cuda():
    """The three CPU answers described in the module docstring; returns the TorchFunctionMode class."""
    import torch
    from torch.overrides import TorchFunctionMode

    names = {torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.float16: "torch.cuda.HalfTensor", torch.float32: "torch.cuda.FloatTensor"}

    class CudaNamesOnCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].dtype in names:
                return names[args[0].dtype]
            if func is torch.Tensor.cuda:
                return args[0]
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    return CudaNamesOnCpu


def init_single_process_group() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def training_args() -> argparse.Namespace:
    """The fields generate_state_dict reads: a bf16 torch_dist run, distributed optimizer, fully reshardable state."""
    return argparse.Namespace(
        ckpt_format="torch_dist", use_distributed_optimizer=True, no_save_optim=False, no_save_rng=True,
        dist_ckpt_optim_fully_reshardable=True, distrib_optim_fully_reshardable_mem_efficient=False,
    )


def build(seed: int, mode_cls):
    """A bf16 GPTModel in Float16Module and DDP, and its distributed optimizer."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, kv_channels=16,
        add_bias_linear=False, use_cpu_initialization=True, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=16)
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    with mode_cls():
        chunk = DistributedDataParallel(
            config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
            module=Float16Module(config, model),
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, bf16=True, clip_grad=1.0, use_distributed_optimizer=True), [chunk]
        )
    return chunk, optimizer


def state_by_name(chunk, optimizer) -> dict:
    """Per parameter name: its fp32 main shard, Adam moments and step, paired through the optimizer's parallel
    model/shard lists."""
    (inner,) = optimizer.chained_optimizers
    shard_of = {}
    pairs = ((inner.model_float16_groups, inner.shard_fp32_from_float16_groups), (inner.model_fp32_groups, inner.shard_fp32_groups))
    for models, shards in pairs:
        for model_group, shard_group in zip(models, shards, strict=True):
            shard_of.update({id(m): s for m, s in zip(model_group, shard_group, strict=True)})
    out = {}
    for name, param in chunk.named_parameters():
        shard = shard_of[id(param)]
        state = inner.optimizer.state[shard]
        out[name] = {"main": shard.detach().clone(), **{k: state[k].detach().clone() for k in ("exp_avg", "exp_avg_sq", "step")}}
    return out


def checkpoint_state_dict(args, chunk, optimizer, mode_cls, *, is_loading: bool):
    from megatron.core.utils import unwrap_model
    from megatron.training.checkpointing import _build_sharded_state_dict_metadata, generate_state_dict

    metadata = _build_sharded_state_dict_metadata(args)
    optim_kwargs = dict(metadata=metadata, is_loading=True) if is_loading else dict(metadata=metadata)
    with mode_cls():
        return generate_state_dict(
            args, [unwrap_model(chunk)], optimizer, None, None, iteration=STEPS, optim_sd_kwargs=optim_kwargs,
            model_sd_kwargs=dict(metadata=metadata),
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized megatron-lm tree (base or patched)")
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    warnings.filterwarnings("ignore")  # Apex/TE fallbacks and torch.distributed.checkpoint notices
    logging.getLogger("megatron").setLevel(logging.WARNING)

    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if not Path(distrib.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {distrib.__file__}, not the tree {tree}")
        return 1
    if distrib.HAVE_APEX_OR_TE:
        print("error: Apex or TransformerEngine is installed; this reproducer shows the PyTorch-optimizer path (run it without them)")
        return 1
    fixed = has_fix(tree)
    print(f"tree: {tree} ({'has' if fixed else 'lacks'} the fix: {FIX_SUBJECT})")
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    def reproduced(what: str) -> int:
        print(f"BUG_REPRODUCED: {what}")
        return 1 if fixed else 0

    mode_cls = cpu_for_cuda()
    init_single_process_group()
    run_args = training_args()
    with contextlib.redirect_stdout(io.StringIO()):
        chunk, optimizer = build(seed=0, mode_cls=mode_cls)
    (inner,) = optimizer.chained_optimizers
    print(f"optimizer: {type(optimizer).__name__}[{type(inner).__name__}] over {type(inner.optimizer).__module__}."
          f"{type(inner.optimizer).__name__}")
    generator = torch.Generator().manual_seed(1234)
    for _ in range(STEPS):
        for _, param in chunk.named_parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=generator))
        with mode_cls():
            ok, grad_norm, _ = optimizer.step()
    print(f"steps: {STEPS}, last ok={ok} grad_norm={grad_norm:.3f}")
    saved = state_by_name(chunk, optimizer)
    with tempfile.TemporaryDirectory(prefix="repro-24-") as ckpt:
        state_dict = checkpoint_state_dict(run_args, chunk, optimizer, mode_cls, is_loading=False)
        dist_checkpointing.save(state_dict, ckpt)
        with contextlib.redirect_stdout(io.StringIO()):
            fresh_chunk, fresh_optimizer = build(seed=1, mode_cls=mode_cls)
        template = checkpoint_state_dict(run_args, fresh_chunk, fresh_optimizer, mode_cls, is_loading=True)
        loaded = dist_checkpointing.load(template, ckpt)
        unwrap_model(fresh_chunk).load_state_dict(loaded["model"])
        sharding = loaded["optimizer"]["param_state_sharding_type"]
        try:
            with mode_cls():
                fresh_optimizer.load_state_dict(loaded["optimizer"])
        except KeyError as exc:
            if exc.args != ("step",):
                raise
            return reproduced(f"the load ({sharding}) fails in DistributedOptimizer.load_state_dict: KeyError: {exc}")
    restored = state_by_name(fresh_chunk, fresh_optimizer)
    wrong = [f"{n}.{k}" for n in saved for k in saved[n] if not torch.equal(restored[n][k].float(), saved[n][k].float())]
    print(f"checkpoint: {sharding}, saved and loaded; {len(saved)} parameters x (main, exp_avg, exp_avg_sq, step) compared")
    if wrong:
        return reproduced(f"{len(wrong)} optimizer tensors differ after the load, e.g. {wrong[:3]}")
    print(f"FIX_VALIDATED: every parameter gets back its main parameter shard, Adam moments and step ({STEPS})")
    return 0 if fixed else 1


if __name__ == "__main__":
    sys.exit(main())
