#!/usr/bin/env python3
"""Reproducer: Megatron-LM's `save_checkpoint` writes `latest_checkpointed_iteration.txt` in place
(`open(tracker, 'w')` truncates it first), so a job killed between that open and the write leaves an
empty tracker, and every later `load_checkpoint` stops at "Invalid metadata file" although the
previous checkpoint is complete on disk.

    python repro.py --tree third_party/megatron-lm

Two child processes, each with Megatron's global args set by its own parser (a 2-layer bf16 GPTModel,
torch_dist, no RNG state) and the model built in Float16Module and DDP with the optimizer from
`get_megatron_optimizer`, on a one-rank gloo group:

- `save` takes an optimizer step and saves iteration 1 with the real `save_checkpoint`, then takes
  another step and saves iteration 2. Before that second save it installs a profiler that SIGKILLs
  the process at the first `write` call on a file whose name starts with the tracker's path: the
  moment after the tracker (or a temporary file beside it) is opened and before anything is written.
- `load` builds a fresh model and optimizer from another seed and calls the real `load_checkpoint`,
  as a resumed job does.

The parent compares the loaded parameters (every model parameter and its fp32 main copy) with those
iteration 1 saved. Megatron's checkpoint writer starts multiprocessing helpers, so each child runs in
a session of its own and the whole group is killed afterwards.

The optimizer and checkpoint code assume CUDA in a few places, answered for CPU here and nowhere
else: the optimizer sorts parameters by `param.type()` and makes scalars with device='cuda' (a
TorchFunctionMode reports CPU tensors by their dtype's CUDA type name and puts device='cuda'
factories on CPU); DDP's buffers use `torch.cuda.current_device()` (the CPU device here); the
checkpoint writer calls `torch.cuda.synchronize()` (a no-op here); `save_checkpoint` collects the
CUDA RNG state even with --no-save-rng (the CPU generator's state here).

Prints, after the host stamp line:
  BUG_REPRODUCED  after the kill the tracker is empty and load_checkpoint exits ("Invalid metadata file")
  FIX_VALIDATED   after the kill the tracker still names iteration 1, and load_checkpoint loads it:
                  every parameter equals what iteration 1 saved
Exit codes: 0 the sentinel matches the tree (the fix's commit subject in `git log upstream..HEAD` or
not), 1 otherwise (or when the kill or the load did not happen as described).

What it does not show: a GPU run; more than one rank (the tracker is written by rank 0 after the
barrier that ends a save); `--async-save`, whose finalize step writes the tracker through the same
code; object stores behind the multi-storage client (msc:// paths), where the fix writes as before;
a full disk (no write is attempted after the kill); a power loss (the fix fsyncs the file and its
directory, which a kill does not exercise).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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
CHILD_TIMEOUT_S = 300


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


# ----------------------------------------------------------------------------------------------------
# The child processes
# ----------------------------------------------------------------------------------------------------


def emit(tag: str, **fields: object) -> None:
    print(f"{tag} {json.dumps(fields)}", file=sys.__stdout__, flush=True)  # Megatron's prints go to a StringIO


def cpu_for_cuda():
    """The CPU answers described in the module docstring; returns the TorchFunctionMode class."""
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
    if not torch.cuda.is_available():
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    return CudaNamesOnCpu


def init_single_process_group() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def set_megatron_args(directory: Path) -> None:
    """Megatron's global args from its own parser, for the model `build` makes, saving to and loading from `directory`."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "10", "--lr", "1e-3", "--bf16", "--save", str(directory), "--load", str(directory),
            "--ckpt-format", "torch_dist", "--save-interval", "1", "--no-save-rng", "--no-load-rng",
            "--vocab-size", "128", "--tokenizer-type", "NullTokenizer"]
    sys.argv = ["repro", *argv]
    with contextlib.redirect_stdout(io.StringIO()):
        args = validate_args(parse_args())
    set_global_variables(args, build_tokenizer=False)


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
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, kv_channels=16,
        qk_layernorm=True, add_bias_linear=False, use_cpu_initialization=True, bf16=True,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    with contextlib.redirect_stdout(io.StringIO()):
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


def checksum(chunk) -> str:
    """A digest of every model parameter and its fp32 main copy, by name."""
    digest = hashlib.sha256()
    for name, param in chunk.named_parameters():
        digest.update(name.encode())
        for tensor in (param, getattr(param, "main_param", param)):
            digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def kill_at_tracker_write(directory: Path) -> None:
    """SIGKILL this process, in any thread started from now on, at the first `write` on a file named like the tracker."""
    prefix = str(directory / TRACKER)

    def profile(frame, event, arg):
        if event != "c_call" or getattr(arg, "__name__", "") != "write":
            return
        name = getattr(getattr(arg, "__self__", None), "name", None)
        if isinstance(name, str) and os.path.abspath(name).startswith(prefix):
            emit("KILL_POINT", path=os.path.abspath(name))
            os.kill(os.getpid(), signal.SIGKILL)

    threading.setprofile(profile)
    sys.setprofile(profile)


def prepare_child(tree: Path, directory: Path):
    """Import Megatron from `tree`, set its args and process group; returns the TorchFunctionMode class."""
    sys.path.insert(0, str(tree))
    warnings.filterwarnings("ignore")  # Apex/TE fallbacks and torch.distributed.checkpoint notices
    import megatron.training.checkpointing as checkpointing

    if not Path(checkpointing.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"error: imported {checkpointing.__file__}, not from the tree {tree}: check sys.path and PYTHONPATH")
    mode_cls = cpu_for_cuda()
    init_single_process_group()
    set_megatron_args(directory)
    return mode_cls


def child_save(tree: Path, directory: Path) -> int:
    mode_cls = prepare_child(tree, directory)
    import torch
    from megatron.training.checkpointing import save_checkpoint

    chunk, optimizer = build(seed=0, mode_cls=mode_cls)
    generator = torch.Generator().manual_seed(1234)
    for iteration in (1, 2):
        for _, param in chunk.named_parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=generator))
        with mode_cls():
            ok, _, _ = optimizer.step()
        if not ok:
            raise SystemExit(f"error: the optimizer skipped step {iteration}")
        if iteration == 2:
            kill_at_tracker_write(directory)
        with mode_cls(), contextlib.redirect_stdout(io.StringIO()):
            save_checkpoint(iteration, [chunk], optimizer, None, 0)
        emit("SAVED", iteration=iteration, checksum=checksum(chunk))
    return 0


def child_load(tree: Path, directory: Path) -> int:
    mode_cls = prepare_child(tree, directory)
    from megatron.training.checkpointing import load_checkpoint

    chunk, optimizer = build(seed=1, mode_cls=mode_cls)
    fresh = checksum(chunk)
    printed = io.StringIO()
    try:
        with mode_cls(), contextlib.redirect_stdout(printed):
            iteration, _ = load_checkpoint([chunk], optimizer, None)
    except BaseException as exc:  # noqa: B036 - read_metadata ends with sys.exit() on an unreadable tracker
        errors = [line.strip() for line in printed.getvalue().splitlines() if "ERROR" in line]
        emit("LOAD_FAILED", error=f"{type(exc).__name__}({getattr(exc, 'code', exc)!r})", printed=errors[-1:])
        return 0
    emit("LOADED", iteration=iteration, checksum=checksum(chunk), fresh=fresh)
    return 0


# ----------------------------------------------------------------------------------------------------
# The parent
# ----------------------------------------------------------------------------------------------------


def run_child(tree: Path, command: str, directory: Path) -> tuple[int, list[tuple[str, dict]], str]:
    """Run a child in a session of its own, kill whatever it leaves; returns its exit code, tagged lines and output."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--tree", str(tree), "--child", command, str(directory)],
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"error: the {command} child ran past {CHILD_TIMEOUT_S} s")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        log = out.read()
    tagged = []
    for line in log.splitlines():
        tag, _, rest = line.partition(" ")
        if tag in ("SAVED", "KILL_POINT", "LOADED", "LOAD_FAILED"):
            tagged.append((tag, json.loads(rest)))
    return proc.returncode, tagged, log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a materialized megatron-lm tree (base or patched)")
    parser.add_argument("--child", nargs=2, metavar=("COMMAND", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = args.tree.resolve()
    if args.child:
        command, directory = args.child
        return {"save": child_save, "load": child_load}[command](tree, Path(directory))
    print(host_stamp(tree), flush=True)
    has_fix = tree_has_fix(tree)
    print(f"tree: {tree} ({'has' if has_fix else 'lacks'} commit {FIX_SUBJECT!r}...)")
    with tempfile.TemporaryDirectory(prefix="repro-20-") as tmp:
        save = Path(tmp) / "checkpoints"
        relative = lambda text: str(text).replace(str(save), "CHECKPOINTS")  # no scratch path in the output

        code, tagged, log = run_child(tree, "save", save)
        saved = {fields["iteration"]: fields["checksum"] for tag, fields in tagged if tag == "SAVED"}
        kills = [relative(fields["path"]) for tag, fields in tagged if tag == "KILL_POINT"]
        print(f"save child: exit {code}; saved iterations {sorted(saved)}; killed at the write of {kills}")
        if code != -signal.SIGKILL or sorted(saved) != [1] or len(kills) != 1 or not (save / "iter_0000002").is_dir():
            print(f"error: the save child was not killed at the tracker write of its second save:\n{relative(log[-3000:])}")
            return 1
        tracker = save / TRACKER
        content = tracker.read_text() if tracker.is_file() else None
        print(f"after the kill: {TRACKER} holds {json.dumps(content)}; files {sorted(p.name for p in save.iterdir())}")

        code, tagged, log = run_child(tree, "load", save)
        results = [(tag, fields) for tag, fields in tagged if tag in ("LOADED", "LOAD_FAILED")]
        if code != 0 or len(results) != 1:
            print(f"error: the load child exited {code} without a result:\n{relative(log[-3000:])}")
            return 1
        (tag, fields), = results
    if tag == "LOAD_FAILED":
        message = relative("; ".join(fields["printed"]) or "(no error printed)")
        print(f"BUG_REPRODUCED: the tracker is {json.dumps(content)} and load_checkpoint exits with {fields['error']}: {message}")
        return 1 if has_fix else 0
    print(f"load child: iteration {fields['iteration']}, checksum {fields['checksum']} (iteration 1 saved {saved[1]};"
          f" the fresh model had {fields['fresh']})")
    if fields["iteration"] != 1 or fields["checksum"] != saved[1]:
        print("error: load_checkpoint did not restore iteration 1 as saved")
        return 1
    print("FIX_VALIDATED: the tracker still names iteration 1, and load_checkpoint restores every parameter iteration 1 saved")
    return 0 if has_fix else 1


if __name__ == "__main__":
    sys.exit(main())
