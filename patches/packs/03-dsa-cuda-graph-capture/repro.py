#!/usr/bin/env python3
"""Regression guard: a Megatron-LM DSA attention layer's forward can be captured in a CUDA graph.

    python repro.py --tree third_party/megatron-lm [--seq 256] [--batch 2] [--hidden 512] [--heads 4] [--topk 64]
                    [--dsa-kernel-backend none|tilelang|cudnn]

Upstream PR #5099 removed the host-syncing `torch.equal` / `.any()` branches from the DSA path
before core_v0.19.0 (a host sync inside `torch.cuda.graph` aborts the capture). This guard checks
that the pinned release (and our patched tree) still has no such sync on the path it runs.

It builds one DSA attention layer from the tree (`get_dsa_module_spec_for_backend` with Megatron's
LOCAL backend: `AbsorbedMLASelfAttention` around `DSAttention` and its `DSAIndexer`, no
TransformerEngine; MLATransformerConfig with experimental_attention_variant="dsa", hidden 512,
4 heads, q_lora_rank 256, kv_lora_rank 512, qk_pos_emb_head_dim 64, qk_head_dim 128, v_head_dim 128,
indexer 4 heads x 64, top-k 64, qk layernorm, default yarn RoPE, dsa_kernel_backend "none" = the
PyTorch indexer and sparse attention, dsa_strict_fused_paths left off), on CUDA in bf16, under
torch.distributed (nccl, world 1) with `parallel_state.initialize_model_parallel()` (TP = PP = CP = 1).
The layer runs in eval mode under no_grad on a causal [seq, batch, hidden] input:
  1. eager reference outputs for two different inputs x0 and x1;
  2. an informational scan of the eager forward (TorchDispatchMode) for aten ops that synchronize
     the host on CUDA (`.item()`/`bool()`, `torch.equal`, `nonzero`, boolean indexing, host<->device
     copies, ...): a diagnosis if the capture fails, not a sentinel;
  3. three warm-up calls on a side stream, then capture of the forward on x0 in a torch.cuda.CUDAGraph;
  4. replay on x0, then x1 copied into the static input buffer; each replay output is compared
     with the eager output for that input (bitwise equality expected; tolerance rel L2 < 1e-2).
The local backend has no `linear()` (TELinear's role in the DSA spec): the guard serves it with
ColumnParallelLinear, gather_output=False (AbsorbedMLA accepts that for its down projections), and
the indexer's `parallel_mode="duplicated"` projections with a ColumnParallelLinear subclass that
drops that argument. At TP = 1 both compute the same GEMM as TELinear.

Prints, after the host stamp line:
  FIX_VALIDATED    the capture succeeds and both replays match eager (the old host syncs are absent)
  BUG_REPRODUCED   the capture raises a stream-capture error (cudaErrorStreamCaptureUnsupported,
                   "operation not permitted when stream is capturing", ...): the exception is printed
  MISMATCH         the capture succeeds but a replay differs from eager beyond the tolerance
  OTHER_FAILURE    anything else raised while building, running or capturing the layer
Proves: this layer's inference forward (dense causal mask, no CP/SP/packed THD, PyTorch DSA path)
is capturable and replays correctly on new input. Does not prove: backward or training mode (the
indexer loss), context or sequence parallelism, packed THD inputs, the TileLang/cuDNN fused DSA
backends, Megatron's own CUDA-graph machinery (cuda_graph_impl), or anything about speed. The
tree's comments about syncs removed for this reason (dsa_layout.extract_query_positions_from_position_ids,
the `varlen_is_plain_causal` flag of dsa_masking.build_dsattention_forward_mask, dsa_cudnn_kernels)
sit on context-parallel and fused-backend paths that the default run does not reach;
`--dsa-kernel-backend tilelang|cudnn` (not the recorded run; needs that backend installed) points
the same capture at a fused backend.
A hidden `--device cpu` (development only) builds the same layer on CPU over gloo, runs the eager
forward with the sync scan, prints NEEDS_GPU and exits 3: it says nothing about the capture.
Exit codes (a regression guard: FIX_VALIDATED is expected on every tree): 0 FIX_VALIDATED, 1 otherwise,
3 no CUDA GPU on this host (nothing measured).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_NO_GPU = 3
TOLERANCE = 1e-2
SPEC_MODULE = "megatron.core.models.gpt.experimental_attention_variant_module_specs"
# aten ops that make the host wait for the device on CUDA (and so abort a stream capture).
SYNCING_OPS = {"aten._local_scalar_dense", "aten.equal", "aten.nonzero", "aten.masked_select", "aten._unique2",
               "aten.unique_consecutive", "aten.unique_dim", "aten.repeat_interleave"}
CAPTURE_MARKERS = ("captur", "cudaerrorstreamcapture")


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
            f" upstream=megatron-lm base={git(tree, 'rev-parse', 'upstream')[:12]} tree={git(tree, 'rev-parse', 'HEAD')[:12]}")


def init_distributed(backend: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:  # a free local port for the world-1 rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()


def build_layer(args: argparse.Namespace, device: str) -> Any:
    """The DSA attention layer (AbsorbedMLASelfAttention + DSAttention) from the tree's DSA spec, LOCAL backend."""
    import torch
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    spec_module = importlib.import_module(SPEC_MODULE)

    class LocalDSASpecProvider(LocalSpecProvider):
        """LocalSpecProvider plus the `linear()` the DSA spec asks for (TELinear's role, at TP = 1)."""

        def linear(self) -> type:
            return ColumnParallelLinear

    class DuplicatedLinear(ColumnParallelLinear):
        """The indexer's `parallel_mode="duplicated"` projections: at TP = 1 a plain column-parallel GEMM."""

        def __init__(self, input_size: int, output_size: int, *, parallel_mode: str | None = None, **kwargs: Any) -> None:
            assert parallel_mode in (None, "duplicated"), parallel_mode
            super().__init__(input_size, output_size, gather_output=False, **kwargs)

    # fast_hadamard_transform (the indexer's Hadamard rotation) is optional; use it when installed.
    rotate = importlib.util.find_spec("fast_hadamard_transform") is not None
    config = MLATransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, q_lora_rank=256, kv_lora_rank=512,
        qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True, add_bias_linear=False,
        experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=64,
        dsa_indexer_topk=args.topk, dsa_indexer_rotate_activation=rotate, dsa_kernel_backend=args.dsa_kernel_backend,
        bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=device == "cpu")
    spec = spec_module.get_dsa_module_spec_for_backend(config=config, backend=LocalDSASpecProvider())
    indexer = spec.submodules.core_attention.submodules.indexer.submodules
    for name in ("linear_wq_b", "linear_wk", "linear_weights_proj"):
        setattr(indexer, name, DuplicatedLinear)
    layer = build_module(spec, config=config, layer_number=1)
    print(f"layer: {type(layer).__name__} / {type(layer.core_attention).__name__}: hidden {args.hidden}, {args.heads} heads,"
          f" q_lora 256, kv_lora 512, qk 128+64, v 128; indexer 4 heads x 64, top-k {args.topk}, Hadamard rotation"
          f" {'on' if rotate else 'off (fast_hadamard_transform not installed)'}; dsa_kernel_backend={config.dsa_kernel_backend};"
          f" {sum(p.numel() for p in layer.parameters())} parameters; bf16 on {device}")
    return layer.to(device=device, dtype=torch.bfloat16).eval()


def scan_syncing_ops(fn: Callable[[], Any]) -> Counter[str]:
    """Run fn and count the aten ops in it that synchronize the host on CUDA."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Scan(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: Counter[str] = Counter()

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            name = str(func.overloadpacket)
            indices = args[1] if name == "aten.index" and len(args) > 1 else []
            bool_index = any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices)
            # repeat_interleave syncs only with tensor repeats and no output_size.
            unsized_repeat = (name == "aten.repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
                              and kwargs.get("output_size") is None)
            # A copy between host and device memory (e.g. torch.tensor(list, device="cuda")) syncs too.
            places = (*args[:2], kwargs.get("device"))
            devices = {(t if isinstance(t, torch.device) else t.device).type for t in places
                       if isinstance(t, torch.Tensor | torch.device)}
            cross_copy = name in ("aten._to_copy", "aten.copy_") and {"cpu", "cuda"} <= devices
            if (name in SYNCING_OPS and name != "aten.repeat_interleave") or bool_index or unsized_repeat or cross_copy:
                self.seen[name + (" (bool mask)" if bool_index else " (host<->device)" if cross_copy else "")] += 1
            return func(*args, **kwargs)

    with Scan() as scan:
        fn()
    return scan.seen


def rel_err(a: Any, b: Any) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def capture_error(exc: BaseException) -> BaseException | None:
    """The first exception in exc's chain that is a stream-capture error, if any."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in seen:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    for e in reversed(seen):  # the original error first
        if any(m in str(e).lower() for m in CAPTURE_MARKERS):
            return e
    return None


def first_lines(exc: BaseException, n: int = 6) -> str:
    return " | ".join(f"{type(exc).__name__}: {exc}".strip().splitlines()[:n])


def cpu_dry_run(args: argparse.Namespace) -> int:
    """Development only: build the layer on CPU (gloo) and run the eager forward with the sync scan."""
    import torch

    # RotaryEmbedding/YarnRotaryEmbedding put inv_freq on torch.cuda.current_device(); on a CPU-only build
    # that raises, so the dry run points it at the CPU. Nothing else is patched.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    init_distributed("gloo")
    layer = build_layer(args, "cpu")
    x = torch.randn(args.seq, args.batch, args.hidden, dtype=torch.bfloat16)
    with torch.no_grad():
        seen = scan_syncing_ops(lambda: layer(x, attention_mask=None))
        out, bias = layer(x, attention_mask=None)
    print(f"dry run (cpu): eager forward output {tuple(out.shape)} {out.dtype}, finite {torch.isfinite(out).all().item()},"
          f" bias {bias}; host-syncing aten ops: {dict(seen) or 'none'}")
    print("NEEDS_GPU: the CUDA-graph capture needs a CUDA GPU (the CPU dry run above proves nothing about it)")
    return EXIT_NO_GPU


def capture_guard(args: argparse.Namespace) -> int:
    """Eager references, the capture, and the replays on CUDA."""
    import torch

    try:
        init_distributed("nccl")
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(0)  # Megatron's GPU weight init draws from its RNG tracker
        torch.manual_seed(0)
        layer = build_layer(args, "cuda")
        gen = torch.Generator(device="cuda").manual_seed(1)
        shape = (args.seq, args.batch, args.hidden)
        x0 = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        x1 = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)

        def forward(x: Any) -> Any:
            out, _ = layer(x, attention_mask=None)
            return out

        with torch.no_grad():
            eager0, eager1 = forward(x0).clone(), forward(x1).clone()
            seen = scan_syncing_ops(lambda: forward(x0))
        torch.cuda.synchronize()
    except Exception as exc:
        print(f"OTHER_FAILURE: building or running the layer eagerly raised {first_lines(exc)}")
        return 1
    print(f"input [{args.seq}, {args.batch}, {args.hidden}] bf16, causal, eval, no_grad; eager forward ok;"
          f" host-syncing aten ops in the eager forward: {dict(seen) or 'none'}")

    static_x = x0.clone()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
                for _ in range(3):
                    forward(static_x)
            torch.cuda.current_stream().wait_stream(side)
            # thread_local, as Megatron's own CUDA-graph code: other threads (the NCCL watchdog) may run;
            # a sync on this thread's capturing stream still aborts the capture.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = forward(static_x)
        torch.cuda.synchronize()
    except Exception as exc:
        cause = capture_error(exc)
        if cause is not None:
            print(f"BUG_REPRODUCED: capturing the DSA forward in a CUDA graph raised {first_lines(cause)}")
            if cause is not exc:
                print(f"(then: {first_lines(exc, 2)})")
            return 1
        print(f"OTHER_FAILURE: the capture raised a non-capture error: {first_lines(exc)}")
        return 1
    print("capture: ok (3 warm-up calls on a side stream, then one forward captured on the static input)")

    results = []
    for label, x, eager in (("x0 (the captured input)", x0, eager0), ("x1 (new input)", x1, eager1)):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        replay = static_out.clone()
        bitwise = torch.equal(replay, eager)
        err = rel_err(replay, eager)
        max_abs = (replay.float() - eager.float()).abs().max().item()
        finite = bool(torch.isfinite(replay).all().item())
        results.append((bitwise, err, finite))
        print(f"replay on {label}: {'bitwise equal to' if bitwise else 'differs from'} eager;"
              f" rel L2 {err:.3e}, max abs {max_abs:.3e}, finite {finite}")
    if all(finite and err < TOLERANCE for _, err, finite in results):
        how = "bitwise equal" if all(bitwise for bitwise, _, _ in results) else f"within rel L2 {TOLERANCE}"
        print("FIX_VALIDATED: the DSA layer's forward captures in a CUDA graph and its replay on new input matches"
              f" eager ({how}); no host-syncing branch on this path")
        return 0
    print(f"MISMATCH: the graph captured but a replay differs from eager (tolerance rel L2 {TOLERANCE})")
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, required=True, help="a megatron-lm tree (patched or at `upstream`)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--dsa-kernel-backend", choices=["none", "tilelang", "cudnn"], default="none",
                        help="DSA fused-kernel backend (default none: the PyTorch path, the recorded run)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)  # cpu: dev dry run
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree))
    print(host_stamp(tree), flush=True)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("NEEDS_GPU: this guard captures a CUDA graph; no CUDA GPU on this host")
        return EXIT_NO_GPU
    spec_module = importlib.import_module(SPEC_MODULE)
    if not Path(spec_module.__file__).resolve().is_relative_to(tree):
        print(f"error: imported {spec_module.__file__}, not the tree {tree}")
        return 1
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import torch.distributed as dist

    try:
        return cpu_dry_run(args) if args.device == "cpu" else capture_guard(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
