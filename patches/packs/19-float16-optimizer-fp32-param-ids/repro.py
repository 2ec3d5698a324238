#!/usr/bin/env python3
"""Reproducer: with a bf16 model that keeps some parameters in fp32, Megatron-LM's
Float16OptimizerWithFloat16Params.sharded_state_dict maps optimizer state ids to the wrong model
parameters, so the first torch_dist checkpoint save fails (or saves state under other parameters' keys).

    python repro.py --tree third_party/megatron-lm

Builds a 2-layer GPTModel from the local spec (qk_layernorm on, no biases) on CPU and marks, in
every layer, two parameters to stay fp32 under Float16Module (`keep_fp32`, and `keep_in_fp32` as
upstream main calls it): `mlp.linear_fc1.weight` (a weight-decayed matrix) and
`self_attention.q_layernorm.weight` (a norm weight). It wraps the model in Float16Module (bf16) and
DistributedDataParallel, builds the optimizer with `get_megatron_optimizer` (Adam, bf16, no
distributed optimizer), writes a distinct gradient per parameter into DDP's grad buffer, takes one
step, builds the checkpoint with `megatron.training.checkpointing.generate_state_dict` and saves it
with `dist_checkpointing.save` (torch_dist). Then it builds a fresh model and optimizer from another
seed, loads the checkpoint as `load_checkpoint` does, and compares, per parameter name, the fp32 main
parameter and the Adam moments with those saved. A single-process gloo group (world size 1, in-memory
HashStore) provides the process groups.

The optimizer and checkpoint code assume CUDA in three places, answered for CPU here and nowhere else:
the optimizer sorts parameters by `param.type()` ('torch.cuda.BFloat16Tensor' ...) and makes scalars
with device='cuda' (a TorchFunctionMode reports CPU tensors by their dtype's CUDA type name and puts
device='cuda' factories on CPU); DDP's buffers and the checkpoint's flags use
`torch.cuda.current_device()` (the CPU device here); the checkpoint writer calls
`torch.cuda.synchronize()` after its host copies (a no-op here).

Prints, after the host stamp line:
  BUG_REPRODUCED  the save raises "Optimizer shape (...) does not match model shape (...)" in
                  make_sharded_optimizer_tensor, or any optimizer tensor comes back on another parameter
  FIX_VALIDATED   the checkpoint saves and loads, and every parameter gets back its own main parameter
                  and Adam moments
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise.

What it does not show: a GPU run; the distributed optimizer (its own sharded_state_dict); fp16 with a
loss scaler; GTP (`_backfill_gtp_sharded_param_map`, whose ids the fix leaves in float16-group order,
as upstream main does).
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
FIX_SUBJECT = "Float16OptimizerWithFloat16Params.sharded_state_dict: map optimizer state ids"
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


def tree_has_fix(tree: Path) -> bool:
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
    """The fields generate_state_dict reads (a bf16 torch_dist run without the distributed optimizer)."""
    return argparse.Namespace(
        ckpt_format="torch_dist", use_distributed_optimizer=False, no_save_optim=False, no_save_rng=True,
        dist_ckpt_optim_fully_reshardable=False,
    )


def build(seed: int, mode_cls):
    """A bf16 GPTModel with two fp32-kept parameters, in Float16Module and DDP, and its optimizer."""
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
            config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=Float16Module(config, model),
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, bf16=True, clip_grad=1.0), [chunk]
        )
    cast = sorted(name for name, param in kept.items() if param.dtype != torch.float32)
    if len(kept) != 2 * config.num_layers or cast:
        raise SystemExit(f"error: fp32-kept parameters {sorted(kept)}, cast by this tree's Float16Module: {cast}")
    return chunk, optimizer


def state_by_name(chunk, optimizer) -> dict:
    (inner,) = optimizer.chained_optimizers
    out = {}
    for name, param in chunk.named_parameters():
        main = getattr(param, "main_param", param)
        state = inner.optimizer.state[main]
        out[name] = {"main": main.detach().clone(), **{k: state[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}}
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

    optimizer_mod = importlib.import_module("megatron.core.optimizer.optimizer")
    if not Path(optimizer_mod.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {optimizer_mod.__file__}, not the tree {tree}")
        return 1
    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r}...)")
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    mode_cls = cpu_for_cuda()
    init_single_process_group()
    run_args = training_args()
    with contextlib.redirect_stdout(io.StringIO()):
        chunk, optimizer = build(seed=0, mode_cls=mode_cls)
    (inner,) = optimizer.chained_optimizers
    print(f"optimizer: {type(optimizer).__name__}[{type(inner).__name__}], groups "
          f"{[(len(g), len(f)) for g, f in zip(inner.float16_groups, inner.fp32_from_fp32_groups, strict=True)]} (bf16, fp32 params)")
    generator = torch.Generator().manual_seed(1234)
    for _, param in chunk.named_parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=generator))
    with mode_cls():
        ok, grad_norm, _ = optimizer.step()
    print(f"step: ok={ok} grad_norm={grad_norm:.3f}")
    saved = state_by_name(chunk, optimizer)
    with tempfile.TemporaryDirectory(prefix="repro-19-") as ckpt:
        try:
            state_dict = checkpoint_state_dict(run_args, chunk, optimizer, mode_cls, is_loading=False)
        except AssertionError as exc:
            print(f"BUG_REPRODUCED: the checkpoint's optimizer state dict fails: AssertionError: {exc}")
            return 1 if has_fix else 0
        dist_checkpointing.save(state_dict, ckpt)
        with contextlib.redirect_stdout(io.StringIO()):
            fresh_chunk, fresh_optimizer = build(seed=1, mode_cls=mode_cls)
        loaded = dist_checkpointing.load(
            checkpoint_state_dict(run_args, fresh_chunk, fresh_optimizer, mode_cls, is_loading=True), ckpt
        )
        unwrap_model(fresh_chunk).load_state_dict(loaded["model"])
        fresh_optimizer.load_state_dict(loaded["optimizer"])
    restored = state_by_name(fresh_chunk, fresh_optimizer)
    wrong = [f"{n}.{k}" for n in saved for k in saved[n] if not torch.equal(restored[n][k], saved[n][k])]
    print(f"checkpoint: saved and loaded; {len(saved)} parameters x (main, exp_avg, exp_avg_sq) compared")
    if wrong:
        print(f"BUG_REPRODUCED: {len(wrong)} optimizer tensors came back on another parameter, e.g. {wrong[:3]}")
        return 1 if has_fix else 0
    print("FIX_VALIDATED: every parameter, the fp32-kept ones included, gets back its own main parameter and Adam moments")
    return 0 if has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
