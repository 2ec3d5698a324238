"""Patch megatron-lm 0011: the bf16 optimizer's checkpoint maps each optimizer state id to its own
model parameter when the model keeps some parameters in fp32 among bf16 ones.

The model and optimizer are the ones a `tiny-1gpu` training run builds: nam56r-tiny (Mamba-3 layers
keep D, dt_bias, B/C biases and MIMO projections in fp32 under Float16Module, patch 0003), wrapped in
Float16Module and Megatron's DDP as `get_model` does, the optimizer from `get_megatron_optimizer` with
the configs `megatron.training` derives from the recipe's flags (bf16, Adam, no distributed optimizer).
The checkpoint goes through `megatron.training.checkpointing.generate_state_dict` and
`dist_checkpointing.save/load` (torch_dist) on a one-rank gloo group.

Every Megatron object is the real one; what assumes a GPU is answered for CPU at three seams:
- the optimizer sorts parameters by `param.type()` strings ('torch.cuda.BFloat16Tensor' ...) and
  makes a few scalars with `device='cuda'`: `CudaNamesOnCpu` reports a CPU tensor by the CUDA type
  name of its dtype and places `device='cuda'` factory calls on CPU;
- DDP's grad buffers and the checkpoint's failure flags are made on `torch.cuda.current_device()`,
  which returns the CPU device here;
- the checkpoint writer waits with `torch.cuda.synchronize()` after its host copies, a no-op here.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

optimizer_mod = pytest.importorskip("megatron.core.optimizer.optimizer")

OPTIMIZER_PATH = "megatron/core/optimizer/optimizer.py"
CUDA_TYPE_NAMES = {
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.float32: "torch.cuda.FloatTensor",
}


class CudaNamesOnCpu(TorchFunctionMode):
    """`tensor.type()` gives the CUDA type name of the tensor's dtype; `device='cuda'` factories make CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].dtype in CUDA_TYPE_NAMES:
            return CUDA_TYPE_NAMES[args[0].dtype]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def cpu_stands_in_for_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


@pytest.fixture(scope="module")
def run_args():
    """Megatron's parsed and validated args for the tiny-1gpu recipe, as the launcher passes them."""
    pytest.importorskip("nam56r.model.model")
    from nam56r.training.data.layout import DataDir, DataPaths
    from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate
    from nam56r.training.recipe import get_recipe

    recipe = get_recipe("tiny-1gpu")
    layout = DataDir(Path("/data"))
    data = DataPaths(layout.train_prefix, None, layout.tokenizer_dir)
    argv = megatron_flags(recipe, recipe.model_config(), data, RunPaths(Path("/runs/r"), Path("/runs/r/ckpt"), None), "local")
    with contextlib.redirect_stdout(io.StringIO()):
        args = megatron_validate(argv, recipe.world_size)
    assert args.bf16 and not args.use_distributed_optimizer and args.optimizer == "adam"
    return recipe, args


def build_chunk_and_optimizer(recipe, args, seed: int):
    """The training run's model chunk (Float16Module in DDP) and its ChainedOptimizer, on CPU."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

    from nam56r.model.model import build_model

    torch.manual_seed(seed)
    model = build_model(recipe.model_config(), "local", device="cpu").model
    model.config.bf16 = True  # what the training config derived from --bf16 says
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    optimizer_config, config_overrides = get_megatron_optimizer_config(args)
    with CudaNamesOnCpu():
        chunk = DistributedDataParallel(
            config=model.config, ddp_config=get_megatron_ddp_config(args), module=Float16Module(model.config, model)
        )
        optimizer = get_megatron_optimizer(
            optimizer_config, [chunk], config_overrides=config_overrides, use_gloo_process_groups=args.use_gloo_process_groups
        )
    return chunk, optimizer


def float16_optimizer(optimizer):
    (inner,) = optimizer.chained_optimizers
    assert type(inner).__name__ == "Float16OptimizerWithFloat16Params"
    return inner


def fp32_params_among_bf16(chunk, inner) -> list[str]:
    """Names of the model's fp32 parameters that come before a bf16 parameter's main copy in an optimizer group."""
    names = {id(p): n for n, p in chunk.named_parameters()}
    fp32 = {id(p) for group in inner.fp32_from_fp32_groups for p in group}
    main_copies = {id(p) for group in inner.fp32_from_float16_groups for p in group}
    found = []
    for group in inner.optimizer.param_groups:
        ids = [id(p) for p in group["params"]]
        last_main = max((i for i, pid in enumerate(ids) if pid in main_copies), default=-1)
        found += [names[pid] for pid in ids[:last_main] if pid in fp32]
    return found


def train_one_step(chunk, optimizer) -> None:
    """A distinct gradient per parameter in DDP's grad buffer (what backward leaves there), then a step."""
    generator = torch.Generator().manual_seed(1234)
    for _, param in chunk.named_parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=generator))
    with CudaNamesOnCpu():
        ok, grad_norm, _ = optimizer.step()
    assert ok and grad_norm > 0


def optimizer_state_by_name(chunk, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Per model parameter name: its fp32 main parameter and its Adam moments, as the optimizer holds them."""
    inner = float16_optimizer(optimizer)
    out = {}
    for name, param in chunk.named_parameters():
        main = getattr(param, "main_param", param)
        state = inner.optimizer.state[main]
        out[name] = {"main": main.detach().clone(), **{k: state[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")}}
    return out


def checkpoint_state_dict(args, chunk, optimizer, *, is_loading: bool):
    """What save_checkpoint / load_checkpoint hand to dist_checkpointing (they unwrap DDP and Float16Module)."""
    from megatron.core.utils import unwrap_model
    from megatron.training.checkpointing import _build_sharded_state_dict_metadata, generate_state_dict

    metadata = _build_sharded_state_dict_metadata(args)
    optim_kwargs = dict(metadata=metadata, is_loading=True) if is_loading else dict(metadata=metadata)
    with CudaNamesOnCpu():
        return generate_state_dict(
            args, [unwrap_model(chunk)], optimizer, None, None, iteration=1,
            optim_sd_kwargs=optim_kwargs, model_sd_kwargs=dict(metadata=metadata),
        )


def test_mixed_precision_checkpoint_round_trips_each_parameter_state(run_args, tmp_path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    recipe, args = run_args
    chunk, optimizer = build_chunk_and_optimizer(recipe, args, seed=0)
    kept_fp32 = fp32_params_among_bf16(chunk, float16_optimizer(optimizer))
    assert any(name.endswith("mamba3.D") for name in kept_fp32), kept_fp32  # the case the run hits
    train_one_step(chunk, optimizer)
    saved = optimizer_state_by_name(chunk, optimizer)

    state_dict = checkpoint_state_dict(args, chunk, optimizer, is_loading=False)
    dist_checkpointing.save(state_dict, str(tmp_path))

    fresh_chunk, fresh_optimizer = build_chunk_and_optimizer(recipe, args, seed=1)
    fresh_mains = {name: getattr(p, "main_param", p).detach().clone() for name, p in fresh_chunk.named_parameters()}
    loaded = dist_checkpointing.load(checkpoint_state_dict(args, fresh_chunk, fresh_optimizer, is_loading=True), str(tmp_path))
    unwrap_model(fresh_chunk).load_state_dict(loaded["model"])
    fresh_optimizer.load_state_dict(loaded["optimizer"])

    restored = optimizer_state_by_name(fresh_chunk, fresh_optimizer)
    assert restored.keys() == saved.keys()
    wrong = [
        f"{name}.{key}" for name in saved for key in saved[name] if not torch.equal(restored[name][key], saved[name][key])
    ]
    assert wrong == [], f"{len(wrong)} optimizer tensors restored to the wrong parameter, e.g. {wrong[:5]}"
    # Every main parameter changed on load: the checkpoint's values replaced the fresh model's.
    unchanged = [name for name in saved if torch.equal(saved[name]["main"], fresh_mains[name])]
    assert unchanged == [], unchanged


def test_pinned_release_maps_state_ids_past_an_fp32_param_to_the_wrong_parameter(run_args, pinned_release) -> None:
    """The bug: the pinned release's sharded_state_dict pairs state ids with parameters by position
    among the bf16 parameters only, so the first group after an fp32 parameter gets shapes that differ."""
    from megatron.core.utils import unwrap_model

    recipe, args = run_args
    chunk, optimizer = build_chunk_and_optimizer(recipe, args, seed=0)
    train_one_step(chunk, optimizer)
    base = pinned_release.definition(optimizer_mod, OPTIMIZER_PATH, "Float16OptimizerWithFloat16Params")
    with CudaNamesOnCpu(), pytest.raises(AssertionError, match="Optimizer shape .* does not match model shape"):
        base.sharded_state_dict(float16_optimizer(optimizer), unwrap_model(chunk).sharded_state_dict())
