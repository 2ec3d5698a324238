"""`python -m nam56r.training.gpu_check`: refuses a host without a CUDA GPU (exit 2) and a kernel cache of another
stack (exit 2), runs the check and prints its report."""

from __future__ import annotations

import dataclasses
import os
import sys

from nam56r.training.gpu_check.options import EXIT_NO_GPU, EXIT_USAGE, PROG, options_from, parse_args
from nam56r.training.gpu_check.runner import run_check
from nam56r.training.gpu_check.summary import report
from nam56r.training.launcher.kernel_cache import KernelCacheError, host_key, open_cache


def cuda_gpu_problem() -> str | None:
    """Why this host cannot run the check, or None when torch sees a CUDA GPU."""
    try:
        import torch
    except ImportError as exc:
        return f"torch does not import here ({exc}): build the environment first (`nox -s build`)"
    if torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"no CUDA GPU visible to torch {torch.__version__} (built for CUDA {torch.version.cuda or 'none: a CPU-only build'};"
            f" CUDA_VISIBLE_DEVICES={'unset' if visible is None else repr(visible)}). Run it on a GPU node, after `nox -s build`.")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        opts = options_from(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if problem := cuda_gpu_problem():
        print(f"error: gpu-check needs a CUDA GPU: {problem}", file=sys.stderr)
        return EXIT_NO_GPU
    if args.kernel_cache is not None:
        try:
            use = open_cache(args.kernel_cache, host_key(opts.python), args.kernel_cache_mismatch)
        except KernelCacheError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        print(f"gpu-check: {use.message}", flush=True)
        os.environ.update(use.env)  # every part's processes inherit it
        opts = dataclasses.replace(opts, kernel_cache=use)
    print(f"gpu-check: summary {opts.out_dir / 'summary.json'}", flush=True)
    summary = run_check(opts, " ".join([PROG, *(sys.argv[1:] if argv is None else argv)]))
    print(report(summary))
    print(f"gpu-check: summary {opts.out_dir / 'summary.json'}")
    return summary["exit_code"]
