"""The data a run reads (`--data`, or the default pinned corpus for the model's vocabulary), refused before any GPU
work when the model cannot train on it, and the default corpus built once when it is missing."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from nam56r.training.data.layout import DataPaths
from nam56r.training.launcher.errors import TrainError


@dataclass(frozen=True)
class DataChoice:
    paths: DataPaths
    ready: bool
    note: str


def choose_data(args: argparse.Namespace, vocab_size: int) -> DataChoice:
    """The data the run reads: --data (a directory with data.json, or a prefix with --tokenizer), else
    the default corpus for the model's vocab size (possibly not built yet)."""
    from nam56r.training.data.layout import DataDir, default_data_dir

    if args.data is None:
        directory = default_data_dir(vocab_size)
        if not (layout := DataDir(directory)).manifest.is_file():
            build = f"python -m nam56r.training.data build --vocab-size {vocab_size} --out {directory}"
            placeholder = DataPaths(layout.train_prefix, layout.valid_prefix, layout.tokenizer_dir)
            return DataChoice(placeholder, False, f"default C/C++ corpus not built yet; the launch builds it first ({build})")
        return DataChoice(built_data(directory, vocab_size), True, f"default corpus {directory}")
    if args.data.is_dir():
        if given := [flag for flag, value in (("--tokenizer", args.tokenizer), ("--valid-data", args.valid_data)) if value]:
            raise TrainError(
                f"--data {args.data} is a data directory, which names its own tokenizer and valid split in data.json: "
                f"drop {' and '.join(given)}, or pass a prefix (PREFIX.bin/.idx) as --data"
            )
        return DataChoice(built_data(args.data, vocab_size), True, str(DataDir(args.data).manifest))
    prefix = args.data
    if not prefix.exists() and not prefix.with_name(prefix.name + ".bin").exists():
        raise TrainError(
            f"--data {prefix} does not exist: give a data directory with data.json (`python -m nam56r.training.data build --out DIR`) "
            f"or a dataset prefix (PREFIX.bin and PREFIX.idx, with --tokenizer)"
        )
    for suffix in (".bin", ".idx"):
        if not prefix.with_name(prefix.name + suffix).is_file():
            raise TrainError(
                f"--data {prefix}: {prefix}{suffix} not found (give a prefix without .bin/.idx, or a directory with data.json)"
            )
    if args.tokenizer is None or not args.tokenizer.is_dir():
        raise TrainError(f"--data {prefix} is a bare prefix: pass --tokenizer DIR (a HuggingFace tokenizer directory)")
    return DataChoice(DataPaths(prefix, args.valid_data, args.tokenizer), True, f"prefix {prefix}")


def check_data_or_refuse(data: DataChoice, vocab_size: int) -> str:
    """Refuse, before any GPU work, data the model cannot train on (`nam56r.training.data.checks`); dry runs too.
    Returns what was checked, one line."""
    from nam56r.training.data.checks import DataCheckError, check_data

    try:
        return check_data(data.paths, vocab_size).summary()
    except DataCheckError as exc:
        raise TrainError(f"bad data: {exc}") from None


def built_data(directory: Path, vocab_size: int) -> DataPaths:
    """The prefixes and tokenizer of a directory written by `nam56r.training.data build`/`convert`, checked against the model's vocab."""
    from nam56r.training.data.manifest import read_data_manifest

    try:
        manifest = read_data_manifest(directory)
        manifest.check_vocab(vocab_size)
    except FileNotFoundError as exc:
        prefixes = sorted(p.with_suffix("") for p in Path(directory).glob("*.idx"))
        hint = f"; or pass one of its prefixes as --data, with --tokenizer: {', '.join(map(str, prefixes))}" if prefixes else ""
        raise TrainError(f"{exc}{hint}") from None
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    return DataPaths(manifest.train_prefix, manifest.valid_prefix, manifest.tokenizer_dir)


def ensure_data(data: DataChoice, vocab_size: int) -> None:
    """Build the default corpus when it is missing. The build writes exactly the paths already lowered
    into the flags (checked), so nothing is lowered, validated or printed a second time."""
    if data.ready:
        return
    from nam56r.training.data import pinned
    from nam56r.training.data.build import build, format_summary
    from nam56r.training.data.layout import DataDir, build_lock, default_data_dir

    directory = default_data_dir(vocab_size)
    with build_lock(directory):
        if DataDir(directory).manifest.is_file():
            print(f"the default C/C++ corpus for vocab {vocab_size} was built by another launch while this one waited")
        else:
            print(f"building the default C/C++ corpus for vocab {vocab_size} into {directory} (once)", flush=True)
            command = ["python", "-m", "nam56r.training.data", "build", "--vocab-size", str(vocab_size), "--out", str(directory)]
            try:
                corpus = pinned.default_corpus()
            except ValueError as exc:
                raise TrainError(f"the default corpus cannot be built: {exc}") from exc
            print(format_summary(directory, build(directory, vocab_size, corpus, command=command)))
    if (built := built_data(directory, vocab_size)) != data.paths:
        raise TrainError(f"the default corpus was built as {built}, not at the paths in the flags ({data.paths})")
    print(f"data checked: {check_data_or_refuse(data, vocab_size)}")
