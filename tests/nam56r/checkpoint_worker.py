"""A one-rank tiny-1gpu training run on CPU that saves and loads checkpoints with Megatron's own
`save_checkpoint` / `load_checkpoint`, for the checkpoint fault tests (run as a subprocess, so a
test can SIGKILL it in the middle of a save and load what it left in a fresh process).

    python checkpoint_worker.py save --save DIR --iterations 1 2 [--kill-at-open GLOB | --kill-at-write GLOB]
                                     [--log-opens FILE] [--explain-save-failures]
    python checkpoint_worker.py load DIR [DIR ...]

Every Megatron object is the real one: the tiny-1gpu recipe's flags parsed and validated by
Megatron's parser and set as its global args (`set_global_variables`), nam56r-tiny in Float16Module
and DDP as `get_model` builds it, the optimizer and scheduler from `get_megatron_optimizer` /
`get_optimizer_param_scheduler`, a one-rank gloo group. What assumes a GPU is answered for CPU at
the seams tests/megatron/test_0011_* describes, plus the RNG: `torch.cuda.get/set_rng_state` and
the model-parallel RNG tracker hold CPU generator states.

`save` takes one optimizer step per iteration (a distinct gradient per iteration) and saves it.
For the last iteration's save only, `--kill-at-open GLOB` SIGKILLs this process just before it
opens for writing a file whose path under DIR matches GLOB, and `--kill-at-write GLOB` just after
the open, at the first `write` call on it (both print `KILL_POINT path` to stderr first).
`--log-opens FILE` appends every path under DIR opened for writing, in order, to FILE.
`--explain-save-failures` wraps the saves in `nam56r.training.runs.faults.explain_save_failures`,
as `nam56r.training.launcher.pretrain` wraps Megatron's `pretrain`.

Output lines (stdout), one JSON object after the tag:
  SAVED {"iteration": N, "checksum": C, "moments": M}       after each completed save
  LOADED {"dir": D, "iteration": N, "checksum": C, "moments": M}
  LOAD_FAILED {"dir": D, "error": "..."}       load_checkpoint raised or exited
The checksum sums every model parameter and every fp32 main parameter in float64; moments sums
Adam's exp_avg and exp_avg_sq over every parameter. `--megatron-flag FLAG` (before the command,
repeatable) adds a Megatron flag to the recipe's, e.g. `--megatron-flag=--use-distributed-optimizer`.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import fnmatch
import io
import json
import os
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

CUDA_TYPE_NAMES = {
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.float32: "torch.cuda.FloatTensor",
}
OPENERS = (builtins.open, io.open, os.open)


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


def cpu_stands_in_for_cuda() -> None:
    cuda_rng_state = torch.get_rng_state()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda device="cuda": cuda_rng_state.clone()
    torch.cuda.set_rng_state = lambda state, device="cuda": None


def _opens_for_writing(args: tuple) -> str | None:
    """The path of an audited `open` event that writes, else None."""
    path, mode, flags = args
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
    return os.fsdecode(path) if writes else None


def _matches(root: str, path: str, pattern: str) -> bool:
    full = os.path.realpath(path)
    return full.startswith(root + os.sep) and fnmatch.fnmatch(os.path.relpath(full, root), pattern)


def _die(path: str) -> None:
    print(f"KILL_POINT {os.path.realpath(path)}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill_at_open(save_dir: Path, pattern: str) -> None:
    """SIGKILL this process when it is about to open for writing a path under `save_dir` matching
    `pattern` (the audit hook runs before the open: the file is not created)."""
    root = os.path.realpath(save_dir)

    def hook(event: str, args: tuple) -> None:
        if event == "open" and (path := _opens_for_writing(args)) is not None and _matches(root, path, pattern):
            _die(path)

    sys.addaudithook(hook)


def arm_kill_at_write(save_dir: Path, pattern: str) -> None:
    """SIGKILL this process, in any thread, when Python code calls `write` on an open file whose path
    under `save_dir` matches `pattern`: the file is open (created, or truncated) and nothing is written."""
    root = os.path.realpath(save_dir)

    def profile(frame, event, arg):
        if event != "c_call" or getattr(arg, "__name__", "") != "write":
            return
        name = getattr(getattr(arg, "__self__", None), "name", None)
        if isinstance(name, str) and _matches(root, name, pattern):
            _die(name)

    if hasattr(threading, "setprofile_all_threads"):  # Python 3.12+: threads already running too
        threading.setprofile_all_threads(profile)
    else:
        threading.setprofile(profile)
    sys.setprofile(profile)


def log_opens_for_writing(save_dir: Path, log: Path) -> None:
    """Append to `log`, in order, every path under `save_dir` this process opens for writing."""
    root = os.path.realpath(save_dir)
    out = open(log, "a", buffering=1)  # noqa: SIM115 - open for the life of the process

    def hook(event: str, args: tuple) -> None:
        if event == "open" and (path := _opens_for_writing(args)) is not None:
            full = os.path.realpath(path)
            if full.startswith(root + os.sep):
                out.write(os.path.relpath(full, root) + "\n")

    sys.addaudithook(hook)


class TinyRun:
    """The tiny-1gpu run's model chunk, optimizer and scheduler with Megatron's global args set."""

    def __init__(self, save: Path, load: Path | None, extra_flags: tuple[str, ...] = ()) -> None:
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME, get_cuda_rng_tracker
        from megatron.core.transformer.module import Float16Module
        from megatron.training.global_vars import set_global_variables
        from megatron.training.training import (
            get_megatron_ddp_config,
            get_megatron_optimizer_config,
            get_optimizer_param_scheduler,
        )

        from nam56r.model.model import build_model, single_process_groups
        from nam56r.training.data.layout import DataDir, DataPaths
        from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate
        from nam56r.training.recipe import get_recipe

        recipe = get_recipe("tiny-1gpu")
        layout = DataDir(Path("/data"))
        data = DataPaths(layout.train_prefix, None, layout.tokenizer_dir)
        run_paths = RunPaths(save.parent / "run", save, load)
        argv = [*megatron_flags(recipe, recipe.model_config(), data, run_paths, "local"), *extra_flags]
        with contextlib.redirect_stdout(io.StringIO()):
            self.args = megatron_validate(argv, recipe.world_size)
        self.args.tensorboard_dir = None  # no event files next to the checkpoints
        set_global_variables(self.args, build_tokenizer=False)
        single_process_groups("gloo")
        get_cuda_rng_tracker().set_states(
            {_MODEL_PARALLEL_RNG_TRACKER_NAME: torch.Generator().manual_seed(self.args.seed).get_state()}
        )
        torch.manual_seed(0)
        model = build_model(recipe.model_config(), "local", device="cpu").model
        model.config.bf16 = True  # what the training config derived from --bf16 says
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        optimizer_config, overrides = get_megatron_optimizer_config(self.args)
        with CudaNamesOnCpu():
            self.chunk = DistributedDataParallel(
                config=model.config, ddp_config=get_megatron_ddp_config(self.args), module=Float16Module(model.config, model)
            )
            self.optimizer = get_megatron_optimizer(
                optimizer_config, [self.chunk], config_overrides=overrides, use_gloo_process_groups=self.args.use_gloo_process_groups
            )
            self.scheduler = get_optimizer_param_scheduler(self.optimizer)

    def step(self, iteration: int) -> None:
        generator = torch.Generator().manual_seed(1000 + iteration)
        for _, param in self.chunk.named_parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=generator))
        with CudaNamesOnCpu():
            ok, _, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"optimizer step {iteration} was skipped")
        self.scheduler.step(increment=self.args.global_batch_size)

    def save(self, iteration: int) -> None:
        from megatron.training.checkpointing import save_checkpoint

        with CudaNamesOnCpu():
            save_checkpoint(iteration, [self.chunk], self.optimizer, self.scheduler, 0)

    def load(self, directory: Path) -> int:
        from megatron.training.checkpointing import load_checkpoint

        self.args.load = str(directory)
        with CudaNamesOnCpu():
            iteration, _ = load_checkpoint([self.chunk], self.optimizer, self.scheduler)
        return iteration

    def checksum(self) -> float:
        total = sum(p.detach().double().sum().item() for p in self.chunk.parameters())
        return total + sum(getattr(p, "main_param", p).detach().double().sum().item() for p in self.chunk.parameters())

    def moments(self) -> float:
        """The sum of Adam's two moments over every parameter the inner optimizers hold."""
        inner = [chained.optimizer for chained in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]
        return sum(state[k].double().sum().item() for opt in inner for state in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))


def emit(tag: str, **fields: object) -> None:
    print(f"{tag} {json.dumps(fields)}", flush=True)


def cmd_save(opts: argparse.Namespace) -> int:
    run = TinyRun(opts.save, None, tuple(opts.megatron_flags))
    if opts.log_opens:
        log_opens_for_writing(opts.save, opts.log_opens)
    explain = contextlib.nullcontext()
    if opts.explain_save_failures:
        from nam56r.training.runs.faults import explain_save_failures

        explain = explain_save_failures(str(opts.save))
    with explain:
        for i, iteration in enumerate(opts.iterations):
            run.step(iteration)
            if i == len(opts.iterations) - 1:
                if opts.kill_at_open:
                    arm_kill_at_open(opts.save, opts.kill_at_open)
                if opts.kill_at_write:
                    arm_kill_at_write(opts.save, opts.kill_at_write)
            run.save(iteration)
            emit("SAVED", iteration=iteration, checksum=run.checksum(), moments=run.moments())
    return 0


def cmd_load(opts: argparse.Namespace) -> int:
    run = TinyRun(opts.dirs[0], opts.dirs[0], tuple(opts.megatron_flags))
    for directory in opts.dirs:
        try:
            iteration = run.load(directory)
        except BaseException as exc:  # load_checkpoint ends with sys.exit() on an unreadable tracker
            emit("LOAD_FAILED", dir=str(directory), error=f"{type(exc).__name__}: {exc}", where=traceback.format_exc(limit=-4))
            continue
        emit("LOADED", dir=str(directory), iteration=iteration, checksum=run.checksum(), moments=run.moments())
    return 0


def main() -> int:
    warnings.filterwarnings("ignore")
    cpu_stands_in_for_cuda()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.add_argument("--megatron-flag", dest="megatron_flags", action="append", default=[], metavar="FLAG",
                        help="one more Megatron flag after the recipe's (e.g. --use-distributed-optimizer); repeatable")
    save = sub.add_parser("save")
    save.add_argument("--save", type=Path, required=True)
    save.add_argument("--iterations", type=int, nargs="+", required=True)
    kill = save.add_mutually_exclusive_group()
    kill.add_argument("--kill-at-open", metavar="GLOB")
    kill.add_argument("--kill-at-write", metavar="GLOB")
    save.add_argument("--log-opens", type=Path, metavar="FILE")
    save.add_argument("--explain-save-failures", action="store_true")
    load = sub.add_parser("load")
    load.add_argument("dirs", type=Path, nargs="+")
    opts = parser.parse_args()
    return cmd_save(opts) if opts.command == "save" else cmd_load(opts)


if __name__ == "__main__":
    sys.exit(main())
