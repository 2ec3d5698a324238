"""The launcher's command line (`python -m nam56r.training.launcher --help`), generated from declarations: the launcher's
own options here, the recipe's overrides from the recipe's settings (`nam56r.training.recipe_settings`); Megatron
flags of your own after `--`.

    python -m nam56r.training.launcher.train_args --markdown    # the option table the README holds
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from nam56r.training.launcher.kernel_cache import OnMismatch
from nam56r.training.recipe import RECIPES, Recipe
from nam56r.training.settings import add_options, option_table, overrides_from, setting

PROG = "python -m nam56r.training.launcher"
OPTIONS_BEGIN, OPTIONS_END = "<!-- launcher-options:begin -->", "<!-- launcher-options:end -->"


@dataclass(frozen=True)
class Command:
    recipe: str = setting("proxy-1gpu", cli="--recipe", choices=tuple(sorted(RECIPES)), help="named run shape")
    list: bool = setting(False, cli="--list", flag=True, help="list the recipes and exit")
    dry_run: bool = setting(False, cli="--dry-run", flag=True, help="print the checks, the preflight and the exact command; start nothing")
    verbose: bool = setting(False, cli="--verbose", flag=True,
                            help="show every upstream warning, including the known ones filtered by default")


@dataclass(frozen=True)
class Places:
    data: Path | None = setting(
        None, cli="--data", cli_default="the default C/C++ corpus, built on first use",
        help="a data directory with data.json (nam56r.training.data build/convert) or a train prefix (.bin/.idx)")
    valid_data: Path | None = setting(None, cli="--valid-data", help="validation prefix, when --data is a prefix")
    tokenizer: Path | None = setting(None, cli="--tokenizer", help="HuggingFace tokenizer directory, when --data is a prefix")
    save: Path | None = setting(None, cli="--save", cli_default="RUN_DIR/checkpoints", help="checkpoint directory")
    load: Path | None = setting(
        None, cli="--load",
        help="resume from this checkpoint directory; checked before the ranks start: a checkpoint saved at another "
             "expert-parallel size is refused where its optimizer state cannot load (nam56r.training.runs.resume_layout)")
    no_save: bool = setting(False, cli="--no-save", flag=True, help="write no checkpoint (throughput runs); refused with --save")
    run_dir: Path | None = setting(None, cli="--run-dir", cli_default="runs/<recipe>-<time>", help="logs, events, summary and plot")
    kernel_cache: Path | None = setting(
        None, cli="--kernel-cache", metavar="DIR",
        help="a portable compiled-kernel cache (`nox -s prewarm`): its Triton and TileLang kernels load instead of "
             "compiling, and new ones are added; an empty or new DIR is filled by this run. A DIR filled on another stack "
             "(GPU architecture, driver, CUDA, python, torch, triton, tilelang) is refused, naming the difference "
             "(nam56r.training.launcher.kernel_cache)")
    kernel_cache_mismatch: OnMismatch = setting(
        "refuse", cli="--kernel-cache-mismatch",
        help="a --kernel-cache of another stack: refuse the launch, or ignore the cache, saying so, and compile into the "
             "compilers' default caches")


@dataclass(frozen=True)
class Nodes:
    rdzv_endpoint: str | None = setting(None, cli="--rdzv-endpoint", help="HOST:PORT of node 0 (run the same command on every node)")
    node_rank: int = setting(0, cli="--node-rank", help="this node's rank, with --rdzv-endpoint")
    slurm_script: Path | None = setting(None, cli="--slurm-script", help="write an sbatch script for the run instead of launching")


def build_parser(description: str) -> argparse.ArgumentParser:
    """The launcher's parser; `description` heads `--help` (the launcher's docstring)."""
    parser = argparse.ArgumentParser(prog=PROG, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, Command)
    add_options(parser, Recipe, title="overrides of the recipe", overrides=True, presets=[make() for make in RECIPES.values()])
    add_options(parser, Places, title="data, checkpoints, outputs")
    add_options(parser, Nodes, title="several nodes")
    parser.add_argument("megatron_extra", nargs="*", help="extra Megatron flags after `--` (mock data and the null tokenizer are refused)")
    return parser


def parse_args(argv: list[str] | None, description: str) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's options, the Megatron flags after `--`)."""
    args = build_parser(description).parse_args(argv)
    return args, list(args.megatron_extra)


def recipe_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The recipe settings the command line gave, by key."""
    return overrides_from(args, Recipe)


def markdown_options() -> str:
    """The README's option table, between its markers."""
    return "\n".join([OPTIONS_BEGIN, *option_table(build_parser("")), OPTIONS_END])


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit(f"usage: python -m nam56r.training.launcher.train_args --markdown\n{__doc__}")
    print(markdown_options())
