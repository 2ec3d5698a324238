#!/usr/bin/env python3
"""Reproducer: with the distributed optimizer and a bf16 model that keeps some parameters in fp32,
Megatron-LM's torch_dist checkpoint fails three times on the PyTorch-optimizer path (no Apex, no
TransformerEngine): the save (wrong state index), the load template (no step before the first step)
and the load itself (an in-place copy into a view of an fp32 Parameter under grad mode).

    python repro.py --tree third_party/megatron-lm

Builds a 2-layer GPTModel from the local spec (qk_layernorm on, no biases) on CPU and marks, in
every layer, two parameters to stay fp32 under Float16Module (`keep_fp32`, and `keep_in_fp32` as
upstream main calls it): `mlp.linear_fc1.weight` (a weight-decayed matrix) and
`self_attention.q_layernorm.weight` (a norm weight). It wraps the model in Float16Module (bf16) and
DistributedDataParallel with the distributed optimizer, builds the optimizer with
`get_megatron_optimizer` (Adam, bf16, use_distributed_optimizer), writes a distinct gradient per
parameter into DDP's grad buffer, takes one step, builds the checkpoint with
`megatron.training.checkpointing.generate_state_dict` (dp_reshardable, the default sharding) and
saves it with `dist_checkpointing.save`. Then it builds a fresh model and optimizer from another seed,
loads the checkpoint as `load_checkpoint` does (the optimizer's state dict built with is_loading=True,
then `load_state_dict`), and compares, per parameter name, the fp32 main parameter shard and the Adam
moments with those saved. Which main shard belongs to which parameter is read from the optimizer's
own parallel lists (model_float16_groups / shard_fp32_from_float16_groups, model_fp32_groups /
shard_fp32_groups), not from the index the fix changes. A single-process gloo group (world size 1,
in-memory HashStore) provides the process groups.

The optimizer and checkpoint code assume CUDA in three places, answered for CPU here and nowhere else:
the optimizer sorts parameters by `param.type()` ('torch.cuda.BFloat16Tensor' ...) and makes scalars
with device='cuda' (a TorchFunctionMode reports CPU tensors by their dtype's CUDA type name and puts
device='cuda' factories on CPU); DDP's buffers and the checkpoint's flags use
`torch.cuda.current_device()` (the CPU device here); the checkpoint writer calls
`torch.cuda.synchronize()` after its host copies (a no-op here).

Prints, after the host stamp line:
  BUG_REPRODUCED  the save, the load template or the load raises (each names its stage), or any
                  optimizer tensor comes back on another parameter
  FIX_VALIDATED   the checkpoint saves and loads, and every parameter gets back its own main
                  parameter shard and Adam moments
Exit codes: 0 the sentinel matches the tree (all three fixes' commit subjects in
`git log upstream..HEAD`, or none of them), 1 otherwise.

What it does not show: a GPU run; more than one data-parallel rank (the index bug needs only a
group holding both fp32 and bf16 parameters); Apex or TransformerEngine optimizers, whose step
handling and state setters take other paths; the fully_reshardable and fs_model_space shardings.
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
FIX_SUBJECTS = (
    "DistributedOptimizer: index each model param by its position in the inner optimizer's group",
    "DistributedOptimizer.state_dict without Apex/TE: an optimizer with no state yet has step 0",
    "DistributedOptimizer.load_parameter_state_from_dp_reshardable: copy under torch.no_grad()",
)
# In every layer: the layers' parameters of one name share one checkpoint key, hence one dtype.
KEPT_FP32 = (".mlp.linear_fc1.weight", ".self_attention.q_layernorm.weight")


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


def fixes_in(tree: Path) -> list[str]:
    subjects = git(tree, "log", "--format=%s", "upstream..HEAD").splitlines()
    return [fix for fix in FIX_SUBJECTS if any(s.startswith(fix) for s in subjects)]


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
    """The fields generate_state_dict reads (a bf16 torch_dist run with the distributed optimizer)."""
    return argparse.Namespace(
        ckpt_format="torch_dist", use_distributed_optimizer=True, no_save_optim=False, no_save_rng=True,
        dist_ckpt_optim_fully_reshardable=False,
    )


def build(seed: int, mode_cls):
    """A bf16 GPTModel with two fp32-kept parameters per layer, in Float16Module and DDP, and its distributed optimizer."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed) if torch.cuda.is_available() else None
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, kv_channels=16,
        qk_layernorm=True, add_bias_linear=False, use_cpu_initialization=True, bf16=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True), vocab_size=128,
        max_sequence_length=16,
    )
    kept = {name: param for name, param in model.named_parameters() if name.endswith(KEPT_FP32)}
    for param in kept.values():
        param.keep_fp32 = True
        param.keep_in_fp32 = True
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
    cast = sorted(name for name, param in kept.items() if param.dtype != torch.float32)
    if len(kept) != 2 * config.num_layers or cast:
        raise SystemExit(f"error: fp32-kept parameters {sorted(kept)}, cast by this tree's Float16Module: {cast}")
    return chunk, optimizer


def state_by_name(chunk, optimizer) -> dict:
    """Per parameter name: its fp32 main shard and Adam moments, paired through the optimizer's parallel
    model/shard lists (not through model_param_group_index_map, which the fix rebuilds)."""
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
        out[name] = {"main": shard.detach().clone(), **{k: state[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}}
    return out


def checkpoint_state_dict(args, chunk, optimizer, mode_cls, *, is_loading: bool):
    from megatron.core.utils import unwrap_model
    from megatron.training.checkpointing import _build_sharded_state_dict_metadata, generate_state_dict

    metadata = _build_sharded_state_dict_metadata(args)
    optim_kwargs = dict(metadata=metadata, is_loading=True) if is_loading else dict(metadata=metadata)
    with mode_cls():
        return generate_state_dict(
            args, [unwrap_model(chunk)], optimizer, None, None, iteration=1, optim_sd_kwargs=optim_kwargs,
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
    fixes = fixes_in(tree)
    if 0 < len(fixes) < len(FIX_SUBJECTS):
        print(f"error: the tree has {len(fixes)} of the {len(FIX_SUBJECTS)} fixes: {fixes}")
        return 1
    has_fix = bool(fixes)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} the {len(FIX_SUBJECTS)} DistributedOptimizer fixes)")
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    def reproduced(stage: str, exc: BaseException) -> int:
        print(f"BUG_REPRODUCED: {stage} fails: {type(exc).__name__}: {exc}")
        return 1 if has_fix else 0

    mode_cls = cpu_for_cuda()
    init_single_process_group()
    run_args = training_args()
    with contextlib.redirect_stdout(io.StringIO()):
        chunk, optimizer = build(seed=0, mode_cls=mode_cls)
    (inner,) = optimizer.chained_optimizers
    print(f"optimizer: {type(optimizer).__name__}[{type(inner).__name__}], groups "
          f"{[(len(h), len(f)) for h, f in zip(inner.model_float16_groups, inner.model_fp32_groups, strict=True)]} (bf16, fp32 params)")
    generator = torch.Generator().manual_seed(1234)
    for _, param in chunk.named_parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=generator))
    with mode_cls():
        ok, grad_norm, _ = optimizer.step()
    print(f"step: ok={ok} grad_norm={grad_norm:.3f}")
    saved = state_by_name(chunk, optimizer)
    with tempfile.TemporaryDirectory(prefix="repro-21-") as ckpt:
        try:
            state_dict = checkpoint_state_dict(run_args, chunk, optimizer, mode_cls, is_loading=False)
        except AssertionError as exc:
            return reproduced("the save's optimizer state dict (sharded_param_state_dp_reshardable)", exc)
        dist_checkpointing.save(state_dict, ckpt)
        with contextlib.redirect_stdout(io.StringIO()):
            fresh_chunk, fresh_optimizer = build(seed=1, mode_cls=mode_cls)
        try:
            template = checkpoint_state_dict(run_args, fresh_chunk, fresh_optimizer, mode_cls, is_loading=True)
        except AssertionError as exc:
            return reproduced("the load template of a fresh optimizer (DistributedOptimizer.state_dict)", exc)
        loaded = dist_checkpointing.load(template, ckpt)
        unwrap_model(fresh_chunk).load_state_dict(loaded["model"])
        try:
            with mode_cls():
                fresh_optimizer.load_state_dict(loaded["optimizer"])
        except RuntimeError as exc:
            return reproduced("the load (load_parameter_state_from_dp_reshardable)", exc)
    restored = state_by_name(fresh_chunk, fresh_optimizer)
    wrong = [f"{n}.{k}" for n in saved for k in saved[n] if not torch.equal(restored[n][k], saved[n][k])]
    print(f"checkpoint: saved and loaded; {len(saved)} parameters x (main, exp_avg, exp_avg_sq) compared")
    if wrong:
        print(f"BUG_REPRODUCED: {len(wrong)} optimizer tensors came back on another parameter, e.g. {wrong[:3]}")
        return 1 if has_fix else 0
    print("FIX_VALIDATED: every parameter, the fp32-kept ones included, gets back its own main parameter shard and Adam moments")
    return 0 if has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
