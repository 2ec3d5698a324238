"""Fill and inspect a portable compiled-kernel cache (`nam56r.training.launcher.kernel_cache`).

    nox -s prewarm -- --out DIR [--recipe R ...] [--mbs N] [--data DIR]
    python -m nam56r.training.launcher.kernel_cache_cli prewarm --out DIR --recipe tiny-1gpu --recipe proxy-1gpu --mbs 8
    python -m nam56r.training.launcher.kernel_cache_cli show DIR

`prewarm` trains each recipe for two steps on this GPU node with `--kernel-cache DIR`: step 1 in the DSA dense
warm-up and step 2 sparse, so both phases' kernels compile into DIR (Triton, TileLang, Inductor). Its manifest
names the key (GPU architecture, driver, CUDA, python, torch, triton, tilelang) and each recipe and shape filled.
Carry DIR to the other nodes (`tar`; split it where a transfer limits sizes) and pass it to the launcher
(`nox -s train -- --kernel-cache DIR ...`) or the acceptance check (`nox -s gpu-check -- --kernel-cache DIR`):
their first step then loads the kernels instead of compiling them. A run of gpu-check given an empty DIR fills it
with every kernel the check compiles.
Exit codes: 0 done; 1 a prewarm run failed; 2 bad usage, or a cache whose key does not match this host.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nam56r.training.arg_types import positive_int
from nam56r.training.launcher.kernel_cache import (
    MANIFEST,
    KernelCacheError,
    fill_label,
    host_key,
    open_cache,
    read_manifest,
    record_fill,
    weight_line,
)

DEFAULT_RECIPES = ("tiny-1gpu", "proxy-1gpu")
PREWARM_STEPS = 2  # one dense warm-up step, one sparse step


def prewarm_command(recipe: str, out: Path, run_dir: Path, *, mbs: int | None, data: Path | None) -> tuple[list[str], str]:
    """The launcher command that compiles `recipe`'s kernels into `out`, and the fill it records."""
    from nam56r.training.recipe import get_recipe

    shape = get_recipe(recipe, kernels=False, micro_batch=mbs)
    batch = ["--mbs", str(mbs), "--gbs", str(mbs * shape.data_parallel)] if mbs is not None else []
    command = [sys.executable, "-m", "nam56r.training.launcher", "--recipe", recipe, *batch, "--steps", str(PREWARM_STEPS),
               "--warmup", "1", "--dense-warmup-steps", "1", "--no-save", "--run-dir", str(run_dir), "--kernel-cache", str(out),
               *(["--data", str(data)] if data else [])]
    return command, fill_label(recipe, shape.batch.micro_batch, shape.model_config().seq_length)


def prewarm(args: argparse.Namespace) -> int:
    out = args.out.resolve()
    try:
        use = open_cache(out, host_key(), "refuse")
    except KernelCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[prewarm] {use.message}", flush=True)
    recipes = tuple(dict.fromkeys(args.recipe or DEFAULT_RECIPES))
    with tempfile.TemporaryDirectory(prefix="nam56r-prewarm-") as tmp:
        for index, recipe in enumerate(recipes, 1):
            command, label = prewarm_command(recipe, out, Path(tmp) / recipe, mbs=args.mbs, data=args.data)
            print(f"[prewarm] ({index}/{len(recipes)}) {label}: {' '.join(command)}", flush=True)
            start = time.perf_counter()
            code = subprocess.run(command).returncode
            if code != 0:
                print(f"error: the {recipe} prewarm run exited {code} (its output is above); {out} keeps what it compiled",
                      file=sys.stderr)
                return 1
            manifest = record_fill(out, label)
            print(f"[prewarm] ({index}/{len(recipes)}) {label}: {time.perf_counter() - start:.0f} s; cache now "
                  f"{weight_line(manifest)}", flush=True)
    print(f"[prewarm] done: {out} ({weight_line(manifest)}); pass it as --kernel-cache {out}")
    return 0


def show(args: argparse.Namespace) -> int:
    try:
        manifest = read_manifest(args.directory)
    except KernelCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if manifest is None:
        print(f"error: {args.directory} has no {MANIFEST}: not a kernel cache", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest.to_json(), indent=2))
        return 0
    print(f"{args.directory}: {weight_line(manifest)}")
    print(f"  key: {manifest.key.describe()}, tilelang lib {manifest.key.tilelang_lib}")
    print(f"  created {manifest.created_utc}; filled by: {', '.join(manifest.filled_by) or 'nothing yet'}")
    for tool, contents in manifest.contents.items():
        print(f"  {tool}: {contents.kernels} kernels, {contents.bytes / 2**20:.1f} MiB")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nam56r.training.launcher.kernel_cache_cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fill = commands.add_parser("prewarm", help="compile recipes' kernels into a cache directory on this GPU node")
    fill.add_argument("--out", type=Path, required=True, help="the kernel cache directory (new, empty, or one of this host's key)")
    fill.add_argument("--recipe", action="append", metavar="NAME",
                      help=f"a recipe to compile for; repeat for several (default: {', '.join(DEFAULT_RECIPES)})")
    fill.add_argument("--mbs", type=positive_int, help="micro-batch size per GPU for every recipe (default: each recipe's)")
    fill.add_argument("--data", type=Path, help="training data for the runs, as the launcher's --data (default: the launcher's)")
    fill.set_defaults(run=prewarm)
    look = commands.add_parser("show", help="what a kernel cache holds, its key and what weighs")
    look.add_argument("directory", type=Path)
    look.add_argument("--json", action="store_true", help="print the manifest as JSON")
    look.set_defaults(run=show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "prewarm":
        from nam56r.training.recipe import RECIPES

        unknown = [r for r in args.recipe or () if r not in RECIPES]
        if unknown:
            print(f"error: unknown recipe(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}", file=sys.stderr)
            return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
