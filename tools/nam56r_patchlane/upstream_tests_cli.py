"""`apply_patches.py upstream-tests`: its arguments, read into UpstreamTestsOptions."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .cli_options import AddCommand, default_python
from .errors import PatchlaneError
from .lock import Lock
from .upstream_tests import UpstreamTestsOptions, run_upstream_tests

DESCRIPTION = """\
Run an upstream's own tests (from its pinned release tag, stored by `cache fill`) against the release and against the
patched series, side by side, and report per test and per patch: a test that passes on the release and fails with the
series is a regression; tests that fail on both sides are listed with their cause class and not counted as ours; a
test a patch updates runs as updated. Regressions the series causes on purpose are explained in
patches/<upstream>/upstream-tests.toml ([[explained]] test, why). Each regression is bisected to its first patch.
Writes DIR/<upstream>/report.json with both sides' pytest logs, and one manifest record per patch (what
"upstream-tests:patches/<upstream>/<patch>"), which `packs preflight` reads. Exit 0 when no regression is
unexplained, 1 otherwise."""


def cmd_upstream_tests(args, lock: Lock) -> int:
    if args.base_includes and len(args.upstream or ()) != 1:
        raise PatchlaneError("--base-includes names patches of one series: give exactly one -u NAME with it")
    selection = "all" if args.all else "paths" if args.tests else "declared"
    options = UpstreamTestsOptions(
        root=args.root, cache_dir=args.cache, python=default_python(args),
        out_dir=args.out or args.root / "build" / "upstream-tests", selection=selection, paths=tuple(args.tests or ()),
        gpu=args.gpu, timeout_s=args.timeout_s, bisect=not args.no_bisect, record=not args.no_record, keep=args.keep,
        base_includes=tuple(args.base_includes or ()), jobs=args.jobs,
        command=shlex.join(["python", "tools/apply_patches.py", *sys.argv[1:]]),
    )
    return run_upstream_tests(lock, args.upstream or None, options)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def add_upstream_tests_parser(add: AddCommand) -> None:
    p = add("upstream-tests", cmd_upstream_tests, "run an upstream's own tests on the release and on the patched series")
    p.description = DESCRIPTION
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("-u", "--upstream", action="append",
                   help="upstream name (repeatable; default: every upstream with a series and pinned tests)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every test under the lock's test roots, not only those the patches declare")
    which.add_argument("--tests", nargs="+", metavar="PATH", help="these upstream test files or directories (or pytest ids)")
    p.add_argument("--gpu", action="store_true",
                   help="run on this host's CUDA GPU (refused without one); default: CUDA hidden, the CPU verdicts")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="limit for each side's pytest (default: 3600)")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="pytest-xdist workers per side (each with a rendezvous port of its own); suites that compile"
                        " kernels per test, such as mamba's TileLang tests, need several to finish in minutes (default: 1)")
    p.add_argument("--out", type=Path, help="report directory (default: build/upstream-tests)")
    p.add_argument("--no-bisect", action="store_true", help="do not walk the series to find each regression's first patch")
    p.add_argument("--no-record", action="store_true", help="do not append the per-patch records to patches/manifest.toml")
    p.add_argument("--base-includes", action="append", metavar="PATCH",
                   help="apply this series patch to the release side too: a compatibility patch without which the release"
                        " cannot run its tests on this interpreter (e.g. megatron-lm's py311 patch on Python 3.11); repeatable")
    p.add_argument("--keep", action="store_true", help="keep the two trees (to write a patch's test update against them)")
