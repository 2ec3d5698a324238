#!/usr/bin/env python3
"""Reproducer: Megatron-LM's `save_checkpoint` writes `latest_checkpointed_iteration.txt` in place
(`open(tracker, 'w')` truncates it first), so a job killed between that open and the write leaves an
empty tracker, and every later load stops at "Invalid metadata file" although the previous checkpoint
is complete on disk.

    python repro.py --tree third_party/megatron-lm

A child process sets Megatron's global args with its own parser (a 2-layer bf16 GPTModel, torch_dist,
no RNG state), builds the model in Float16Module and DDP with the optimizer from
`get_megatron_optimizer`, and saves iteration 1 with the real `save_checkpoint`. Before saving
iteration 2 it installs a profiler that SIGKILLs the process at the first `write` call on a file
whose name starts with the tracker's path: the moment after the tracker (or a temporary file beside
it) is opened and before anything is written. The parent then reads the tracker with Megatron's own
`read_metadata`, as `load_checkpoint` does, and checks that iteration 1's checkpoint is on disk.
Megatron's checkpoint writer starts multiprocessing helpers, so the child runs in a session of its
own and the whole group is killed afterwards.

The optimizer and checkpoint code assume CUDA in a few places, answered for CPU here and nowhere
else: the optimizer sorts parameters by `param.type()` and makes scalars with device='cuda' (a
TorchFunctionMode reports CPU tensors by their dtype's CUDA type name and puts device='cuda'
factories on CPU); DDP's buffers use `torch.cuda.current_device()` (the CPU device here); the
checkpoint writer calls `torch.cuda.synchronize()` (a no-op here); `save_checkpoint` collects the
CUDA RNG state even with --no-save-rng (the CPU generator's state here).

Prints, after the host stamp line:
  BUG_REPRODUCED  after the kill the tracker is empty and read_metadata exits ("Invalid metadata file")
  FIX_VALIDATED   after the kill the tracker still names iteration 1, read_metadata returns it, and
                  iteration 1's checkpoint is on disk
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise.

What it does not show: a GPU run; more than one rank (the tracker is written by rank 0 after the
barrier that ends a save); object stores behind the multi-storage client (msc:// paths), where the
fix writes as before; a power loss (the fix fsyncs the file and its directory, which a kill does not
exercise); a full `load_checkpoint` of the model and optimizer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

UPSTREAM = "megatron-lm"
FIX_SUBJECT = "save_checkpoint: write latest_checkpointed_iteration.txt through a temporary file and os.replace"
TRACKER = "latest_checkpointed_iteration.txt"
KEPT_FP32 = ()  # no parameter kept in fp32: this reproducer is about the tracker only


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


def build(seed: int, mode_cls):
    """A bf16 GPTModel in Float16Module and DDP, and its optimizer."""
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
    return chunk, optimizer



def set_megatron_args(save: Path) -> None:
    """Megatron's global args from its own parser, for a run like the model `build` makes."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "10", "--lr", "1e-3", "--bf16", "--save", str(save), "--ckpt-format", "torch_dist",
            "--save-interval", "1", "--no-save-rng", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer"]
    sys.argv = ["repro", *argv]
    with contextlib.redirect_stdout(io.StringIO()):
        args = validate_args(parse_args())
    set_global_variables(args, build_tokenizer=False)


def kill_at_tracker_write(save: Path) -> None:
    """SIGKILL this process, in any thread, at the first `write` on a file named like the tracker."""
    prefix = str(save / TRACKER)

    def profile(frame, event, arg):
        if event != "c_call" or getattr(arg, "__name__", "") != "write":
            return
        name = getattr(getattr(arg, "__self__", None), "name", None)
        if isinstance(name, str) and os.path.abspath(name).startswith(prefix):
            print(f"KILL_POINT {name}", file=sys.__stdout__, flush=True)  # save_checkpoint runs with stdout redirected
            os.kill(os.getpid(), signal.SIGKILL)

    threading.setprofile(profile)
    sys.setprofile(profile)


def child(tree: Path, save: Path) -> int:
    sys.path.insert(0, str(tree))
    warnings.filterwarnings("ignore")
    import torch

    mode_cls = cpu_for_cuda()
    if not torch.cuda.is_available():  # save_checkpoint collects the CUDA RNG state even with --no-save-rng
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    init_single_process_group()
    set_megatron_args(save)
    from megatron.training.checkpointing import save_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        chunk, optimizer = build(seed=0, mode_cls=mode_cls)
    generator = torch.Generator().manual_seed(1234)
    for iteration in (1, 2):
        for _, param in chunk.named_parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=generator))
        with mode_cls():
            optimizer.step()
        if iteration == 2:
            kill_at_tracker_write(save)
        with mode_cls(), contextlib.redirect_stdout(io.StringIO()):
            save_checkpoint(iteration, [chunk], optimizer, None, 0)
        print(f"SAVED {iteration}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized megatron-lm tree (base or patched)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # the save directory, in the child process
    args = parser.parse_args()
    tree = args.tree.resolve()
    if args.child:
        return child(tree, args.child)
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r}...)")
    with tempfile.TemporaryDirectory(prefix="repro-20-") as tmp:
        save = Path(tmp) / "checkpoints"
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen([sys.executable, __file__, "--tree", str(tree), "--child", str(save)], stdout=out,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                proc.wait(timeout=600)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.seek(0)
            log = out.read()
        # Paths are printed relative to the checkpoint directory (a temporary one), as CHECKPOINTS/...
        saved = [line.replace(str(save), "CHECKPOINTS") for line in log.splitlines() if line.startswith(("SAVED", "KILL_POINT"))]
        print(f"child: exit {proc.returncode}; {saved}")
        if proc.returncode != -signal.SIGKILL or saved[:1] != ["SAVED 1"] or not any(s.startswith("KILL_POINT") for s in saved):
            print(f"error: the child was not killed at the tracker write of its second save:\n{log[-3000:]}")
            return 1
        tracker = save / TRACKER
        content = tracker.read_text() if tracker.is_file() else None
        print(f"after the kill: {TRACKER} holds {json.dumps(content)}; files {sorted(p.name for p in save.iterdir())}")
        from megatron.training.checkpointing import read_metadata

        try:
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                iteration, release = read_metadata(str(tracker))
        except SystemExit:
            message = printed.getvalue().strip().replace(str(save), "CHECKPOINTS")
            print(f"BUG_REPRODUCED: the tracker is {json.dumps(content)} and read_metadata exits: {message}")
            return 1 if has_fix else 0
        if iteration != 1 or release or not (save / "iter_0000001" / "metadata.json").is_file():
            print(f"BUG_REPRODUCED: read_metadata gives iteration {iteration} (release {release}), not the complete iteration 1")
            return 1 if has_fix else 0
    print("FIX_VALIDATED: the tracker still names iteration 1, whose checkpoint is complete; a resume loads it")
    return 0 if has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
