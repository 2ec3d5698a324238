"""The check's options: its command line, read into an `Options` whose train-part launcher options are refused here,
as the launcher would refuse them, before any GPU work."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from nam56r import CHECKOUT_ROOT
from nam56r.training.launcher.kernel_cache import ON_MISMATCH, CacheUse
from nam56r.training.recipe import Recipe, RecipeError
from nam56r.training.runs.resume_check import ResumeCheck

ROOT = CHECKOUT_ROOT
PROG = "python -m nam56r.training.gpu_check"
EXIT_FAILED, EXIT_NO_GPU, EXIT_USAGE = 1, 2, 2
PARTS = ("tests", "packs", "train", "upstream")
# The train part runs this test's check (train, save, resume, compare) at 20 steps; the test runs 40.
COVERED_BY_TRAIN = "tests/nam56r/test_gpu_train.py::test_tiny_run_loss_falls_and_resume_repeats_the_curve"


@dataclass(frozen=True)
class Options:
    out_dir: Path
    root: Path = ROOT
    python: str = sys.executable
    skip: frozenset[str] = frozenset()  # part names
    test_paths: tuple[str, ...] = ("tests",)
    packs_needs: str = "gpu"
    record: bool = True  # append the packs' and the train runs' records to <root>/patches/manifest.toml
    check: ResumeCheck = field(default_factory=ResumeCheck)
    data: Path | None = None  # default: a small corpus built into OUT/train/data
    megatron_flags: tuple[str, ...] = ()
    echo: bool = True
    concurrent: bool = True  # the parts run at the same time on one GPU
    pack_jobs: int = 3  # packs run side by side within the packs part
    kernel_cache: CacheUse | None = None  # every part's processes compile into and load from it
    upstream_tests_cache: Path | None = None  # the offline cache holding upstream's own tests; None: the part is skipped


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=sys.modules[__package__].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, help="where the summary and the logs go (default runs/gpu-check-<time>)")
    for name in PARTS:
        parser.add_argument(f"--skip-{name}", action="store_true", help=f"do not run the {name} part")
    parser.add_argument("--tests", nargs="+", default=["tests"], metavar="PATH", help="what pytest -m gpu collects (default: tests)")
    parser.add_argument("--recipe", default="tiny-1gpu", help="the train part's recipe (default: tiny-1gpu)")
    parser.add_argument("--steps", type=int, default=20, help="the train part's steps (default: 20)")
    parser.add_argument("--resume-at", type=int, default=10, help="the checkpoint step the second run resumes from (default: 10)")
    parser.add_argument("--train-args", default="", metavar="'OPTIONS'",
                        help="launcher options for every train-part run, one quoted string, e.g. "
                             "'--gpus-per-node 4 --mbs 4 --ep 4 --moe-dispatch megatron --reshardable-ckpt on' (default: none)")
    parser.add_argument("--resume-args", action="append", metavar="'OPTIONS'",
                        help="one resumed run from the same checkpoint per use, with these launcher options beside "
                             "--train-args; e.g. --resume-args '' --resume-args '--ep 2' resumes at the saving run's EP "
                             "and at EP=2 (default: one resumed run, '')")
    parser.add_argument("--data", type=Path, help="the train part's data directory (default: a small corpus built into OUT/train/data)")
    parser.add_argument("--no-record", action="store_true", help="append nothing to patches/manifest.toml")
    parser.add_argument("--pack-jobs", type=int, default=3, metavar="N", help="packs run side by side in the packs part (default: 3)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the parts one after another (default: at the same time, sharing the GPU; about 50 GiB at peak)")
    parser.add_argument("--kernel-cache", type=Path, metavar="DIR",
                        help="a portable compiled-kernel cache (`nox -s prewarm`) every part loads kernels from and compiles new "
                             "ones into; an empty or new DIR is filled by this check; one of another stack is refused, naming "
                             "the difference")
    parser.add_argument("--kernel-cache-mismatch", choices=ON_MISMATCH, default="refuse",
                        help="a --kernel-cache of another stack: refuse (default, exit 2) or ignore it, saying so")
    parser.add_argument("--upstream-tests-cache", type=Path, metavar="DIR",
                        help="an offline cache holding the upstreams' own tests (`nox -s patches -- cache fill DIR`): the"
                             " upstream part runs them on the release and on the series, on this GPU (default: the part is"
                             " skipped, saying so)")
    parser.add_argument("megatron_flags", nargs="*", help="extra Megatron flags for both training runs, after `--`")
    return parser.parse_args(argv)


def launcher_recipe(check: ResumeCheck, options: tuple[str, ...] = ()) -> Recipe:
    """The recipe the launcher makes of the check's recipe, its `train_args` and `options` (refused as the launcher
    refuses them)."""
    from nam56r.training.launcher.train import recipe_from
    from nam56r.training.launcher.train_args import parse_args as parse_launcher_args

    args, _ = parse_launcher_args(["--recipe", check.recipe, *check.train_args, *options], "")
    return recipe_from(args, kernels=False)


def resume_check_from(args: argparse.Namespace) -> ResumeCheck:
    """The train part's check; its launcher options are refused here, as the launcher would refuse them, before any
    GPU work."""
    check = ResumeCheck(recipe=args.recipe, steps=args.steps, resume_at=args.resume_at,
                        train_args=tuple(_split(args.train_args, "--train-args")),
                        resumes=tuple(tuple(_split(text, "--resume-args")) for text in (args.resume_args or [""])))
    for options in check.resumes:
        try:
            launcher_recipe(check, options)
        except (KeyError, RecipeError) as exc:
            raise ValueError(f"the train part's launcher options {[*check.train_args, *options]}: {exc}") from exc
        except SystemExit as exc:  # argparse has printed why
            raise ValueError(f"the train part's launcher options {[*check.train_args, *options]} are not the launcher's") from exc
    return check


def _split(text: str, option: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{option} {text!r}: {exc}") from exc


def options_from(args: argparse.Namespace) -> Options:
    out_dir = args.out_dir or ROOT / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    return Options(out_dir=out_dir.resolve(), skip=frozenset(n for n in PARTS if getattr(args, f"skip_{n}")),
                   test_paths=tuple(args.tests), record=not args.no_record,
                   check=resume_check_from(args),
                   data=args.data.resolve() if args.data else None, megatron_flags=tuple(args.megatron_flags),
                   concurrent=not args.sequential, pack_jobs=args.pack_jobs,
                   upstream_tests_cache=args.upstream_tests_cache.resolve() if args.upstream_tests_cache else None)
