"""`python -m nam56r_bench` (`nox -s bench -- ARGS`): run benchmark suites, write JSON + PNG per suite."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from nam56r.training.arg_types import positive_int
from nam56r_bench.harness import ROOT, BenchError, Context, stamp, write_suite
from nam56r_bench.kernel_suite import CASE_GROUPS
from nam56r_bench.plots import render
from nam56r_bench.suites import SUITES
from nam56r_bench.training_suites import LINEAR_CE_PATHS, RECIPES, RECOMPUTE_SETTINGS, SUITE_TRAIN_OPTIONS

DEFAULT_OUT = ROOT / "docs" / "bench"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nam56r_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Without suite names every suite runs that this machine can: on a machine without a CUDA GPU the\n"
            "GPU suites are listed as not run (naming one explicitly there is an error). Results go to\n"
            f"OUT/<suite>.json and OUT/<suite>.png (default OUT: {DEFAULT_OUT.relative_to(ROOT)}), stamped with\n"
            "the GPU, driver, versions, commit and upstream pins."
        ),
    )
    parser.add_argument("suites", nargs="*", metavar="SUITE", help=f"suites to run: {', '.join(SUITES)} (default: all that can run here)")
    parser.add_argument("--list", action="store_true", help="list the suites and what each needs, then exit")
    parser.add_argument("--replot", type=Path, metavar="FILE.json",
                        help="redraw FILE.png from a suite's FILE.json (e.g. docs/bench/kernels.json), then exit")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and smaller sweeps: a smoke run, not a result")
    parser.add_argument("--model", action="append", choices=sorted(RECIPES), dest="models", default=[],
                        help="a model the training suites (train-step, microbatch) run; repeat for several "
                             "(default: the one-GPU models, the proxy alone with --quick)")
    parser.add_argument("--mbs", action="append", type=positive_int, dest="micro_batches", default=[],
                        help="a micro-batch size the train-step suite runs each model at (global batch = micro-batch x the "
                             "model's GPUs: one micro-batch per rank and step); repeat for several (default: each recipe's own)")
    parser.add_argument("--recompute", action="append", type=_recompute_setting, default=[], metavar="SETTING",
                        help="a launcher --recompute setting (none, all, or families joined by commas: mamba,moe,attention) "
                             "the train-step and microbatch suites run, on the default CE path; repeat for several, or "
                             f"`each` for {', '.join(RECOMPUTE_SETTINGS)} (default: the recipes' own, no recompute)")
    parser.add_argument("--linear-ce", action="append", choices=LINEAR_CE_PATHS, dest="linear_ce", default=[],
                        help="a launcher --linear-ce path (the LM head's and MTP heads' loss) the train-step and microbatch suites "
                             "run; repeat for several (default: microbatch compares every one, train-step runs the recipe's)")
    parser.add_argument("--train-args", action="append", type=_train_args, dest="train_args", default=[], metavar="'OPTIONS'",
                        help="launcher options (nam56r.training.launcher's, one quoted string; Megatron flags after a `--` in it)"
                             " for one train-step run of each model and size; repeat for before and after in one run, '' for"
                             " none: e.g. --train-args '' --train-args '--overlap-dp-comm on -- --grad-reduce-in-bf16'"
                             " (default: one run with none)")
    parser.add_argument("--prewarm-mbs", type=_prewarm_sizes, default="1-16", metavar="SIZES",
                        help="micro-batch sizes the microbatch suite compiles each model's Mamba-3 MIMO TileLang kernels for, in "
                             "parallel, before its search (nam56r.training.launcher.kernel_prewarm: the kernels are compiled per "
                             "micro-batch size, about 2.5 minutes each inside a training process); e.g. 1-24 (default "
                             "1-16). train-step prewarms the sizes named with --mbs. none: no prewarm in either suite")
    parser.add_argument("--kernel-cases", action="append", choices=tuple(CASE_GROUPS), dest="kernel_cases", default=[],
                        metavar="GROUP", help=f"the kernels suite's case groups to run, repeatable: {', '.join(CASE_GROUPS)} "
                        "(default: all). Ratios are taken within a case, so one group's rows stand on their own")
    parser.add_argument("--cache", type=Path, help="the artifact cache the tooling suite fills and builds from "
                        "(default: the patch lane's, ~/.cache/nam56r-patchlane/artifacts)")
    return parser


def _recompute_setting(text: str) -> str:
    from nam56r.training.recipe import Recompute

    if text == "each":
        return text
    try:
        return str(Recompute.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _train_args(text: str) -> str:
    """Launcher options as one normalized shell-quoted string; refused when they do not split or name a flag the
    suite sets itself."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if owned := sorted(set(words) & SUITE_TRAIN_OPTIONS):
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(owned)} is the suite's own option (--mbs, --recompute, "
                                         "--linear-ce, --model)")
    return shlex.join(words)


def _prewarm_sizes(text: str) -> tuple[int, ...]:
    from nam56r.training.launcher.kernel_prewarm import sizes_argument

    return () if text == "none" else sizes_argument(text)


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    gpu = _has_gpu()
    if args.replot:
        try:
            result = json.loads(args.replot.read_text())
            render(result, args.replot.with_suffix(".png"))
        except (OSError, ValueError, KeyError) as exc:
            print(f"cannot replot {args.replot}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        print(f"{args.replot.with_suffix('.png')}")
        return 0
    if args.list:
        for suite in SUITES.values():
            needs = "GPU" if suite.needs_gpu else "CPU"
            state = "" if gpu or not suite.needs_gpu else "  (needs a GPU: not runnable here)"
            print(f"{suite.name:<12} [{needs}] {suite.summary}{state}")
        return 0
    unknown = [name for name in args.suites if name not in SUITES]
    if unknown:
        print(f"unknown suite(s): {', '.join(unknown)}; known: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    chosen = [SUITES[name] for name in args.suites] if args.suites else list(SUITES.values())
    if not gpu:
        named_gpu = [s.name for s in chosen if s.needs_gpu] if args.suites else []
        if named_gpu:
            print(f"suite(s) {', '.join(named_gpu)} need a CUDA GPU (an H100/H200) and none is visible here", file=sys.stderr)
            return 2
        for suite in chosen:
            if suite.needs_gpu:
                print(f"{suite.name}: not run, needs a CUDA GPU (an H100/H200) and none is visible here")
        chosen = [s for s in chosen if not s.needs_gpu]
    host = stamp()
    ctx = Context(out_dir=args.out, quick=args.quick, models=tuple(dict.fromkeys(args.models)), cache=args.cache,
                  micro_batches=tuple(dict.fromkeys(args.micro_batches)), recompute=tuple(dict.fromkeys(args.recompute)),
                  linear_ce=tuple(dict.fromkeys(args.linear_ce)), prewarm_mbs=args.prewarm_mbs,
                  train_args=tuple(dict.fromkeys(args.train_args)), kernel_cases=tuple(dict.fromkeys(args.kernel_cases)))
    failed = []
    for suite in chosen:
        print(f"== {suite.name}: {suite.summary}", flush=True)
        start = time.perf_counter()
        try:
            rows = suite.run(ctx)
        except BenchError as exc:
            print(f"{suite.name}: FAILED: {exc}", file=sys.stderr)
            failed.append(suite.name)
            continue
        path = write_suite(suite, rows, ctx, host, time.perf_counter() - start)
        for row in rows:
            parts = [f"{row.time_ms:.3f} ms" if row.time_ms is not None else None,
                     f"{row.peak_extra_bytes / 2**30:.2f} GiB" if row.peak_extra_bytes is not None else None,
                     f"err {row.max_error:.1e}" if row.max_error is not None else None, row.extra.get("error")]
            print(f"  {row.case:<28} {row.variant:<44} " + "  ".join(p for p in parts if p))
        print(f"  -> {path} and {path.with_suffix('.png')}")
    return 1 if failed else 0
