"""The default training data (the pinned corpus), and Megatron's view of it.

    python -m nam56r.training.data build [--out DIR] [--vocab-size N] [--cache DIR] [--offline]   # the pinned corpus
    python -m nam56r.training.data build --source DIR ... | --torch-headers                       # files on this machine
    python -m nam56r.training.data check PREFIX ...                                         # counts, EOD at every end
    python -m nam56r.training.data convert FILE ... --out PREFIX ...   # your jsonl/parquet (nam56r.training.data.convert)
    python -m nam56r.training.data baselines DIR                       # unigram and bigram cross-entropy of the valid split

`build` makes a C/C++ corpus from the releases third_party/upstreams.toml pins under [[corpus]] (by version and
sha256: the same documents on every machine; nam56r.training.data.pinned), with exact and near copies removed
before the split (nam56r.training.data.dedup); one file is one document. It trains a byte-level BPE tokenizer on
its train split and writes Megatron indexed datasets with Megatron's own builder:

    <out>/tokenizer/                         HuggingFace tokenizer (AutoTokenizer and Megatron's
                                             HuggingFaceTokenizer load it; EOD is <|endoftext|>)
    <out>/train_text_document.{bin,idx}      every document followed by EOD
    <out>/valid_text_document.{bin,idx}
    <out>/data.json                          counts, skipped files, checksums, the command

The split is decided per document by a sha256 of its path relative to its source root, so it does
not move when documents are added, removed or capped (save the one document moved to valid when
none falls there), and the same relative path under two roots lands in the same split. The launcher
reads the result with `read_data_manifest(dir)` (`nam56r.training.data.manifest`); `DataManifest.check_vocab`
compares it with a model.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from nam56r.model.config import ModelConfig
from nam56r.training.data import baselines
from nam56r.training.data.baselines import DEFAULT_BIGRAM_WEIGHT
from nam56r.training.data.build import SOURCE_SUFFIXES, CorpusConfig, build, format_summary, torch_include_dir
from nam56r.training.data.format import check_prefix
from nam56r.training.data.layout import DEFAULT_DATA_DIR, DataDir, build_lock, default_data_dir
from nam56r.training.data.manifest import dataset_files, eod_id_near


def _check_main(args: argparse.Namespace) -> int:
    failed = 0
    for prefix in args.prefixes:
        prefix = Path(str(prefix).removesuffix(".bin").removesuffix(".idx"))
        if missing := [str(p) for p in dataset_files(prefix) if not p.is_file()]:
            raise SystemExit(f"no dataset at {prefix}: {', '.join(missing)} missing (pass the prefix, without .bin/.idx)")
        eod = args.eod_id if args.eod_id is not None else eod_id_near(prefix)
        if eod is None:
            raise SystemExit(f"no EOD id recorded beside {prefix} (no {DataDir(prefix.parent).manifest} or {prefix}.json): pass --eod-id N")
        report = check_prefix(prefix, eod)
        status = "ok"
        if report.bad_count:
            status = f"FAIL: {report.bad_count} documents do not end in EOD {eod}, e.g. documents {list(report.not_ending_in_eod)}"
        print(f"{prefix}: {report.documents} documents, {report.tokens} tokens, max id {report.max_id}, EOD {eod}: {status}")
        failed += report.bad_count > 0
    return 1 if failed else 0


def _build_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.source or args.torch_headers:
        corpus = CorpusConfig(sources=tuple(args.source) if args.source else (torch_include_dir(),),
                              valid_fraction=args.valid_fraction, max_docs=args.max_docs)
    else:
        from nam56r.training.data.pinned import default_corpus

        try:
            pinned = default_corpus(args.cache, True if args.offline else None)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from None
        corpus = replace(pinned, valid_fraction=args.valid_fraction, max_docs=args.max_docs)
    args.out = args.out or default_data_dir(args.vocab_size)
    try:
        with build_lock(args.out):  # a launch building the same default directory finishes first
            manifest = build(args.out, args.vocab_size, corpus, force=args.force, command=["python", "-m", "nam56r.training.data", *argv])
    except (FileExistsError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_summary(args.out.resolve(), manifest))
    return 0


def _baselines_main(args: argparse.Namespace) -> int:
    try:
        found = baselines.compute(args.directory, args.bigram_weight)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(baselines.describe(found))
    print(f"written to {baselines.write(args.directory, found)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m nam56r.training.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser(
        "build", help="build the default C/C++ corpus, tokenizer and indexed datasets (no download)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("--out", type=Path, metavar="DIR",
                   help=f"output directory (default: <repo>/{DEFAULT_DATA_DIR}/pinned-v<VOCAB>, git-ignored: the launcher reads it)")
    b.add_argument("--vocab-size", type=int, default=ModelConfig.vocab_size, metavar="N",
                   help="BPE vocabulary size; pass the model preset's vocab_size (nam56r: 131072, nam56r-tiny: 512). A small "
                   "corpus may reach fewer tokens: the size reached is reported and recorded, never padded (default: %(default)s)")
    b.add_argument("--source", type=Path, action="append", metavar="DIR",
                   help=f"directory of C/C++ files ({' '.join(SOURCE_SUFFIXES)}), repeatable; replaces the default "
                   "(the pinned releases)")
    b.add_argument("--torch-headers", action="store_true",
                   help="the headers of the installed PyTorch wheel instead of the pinned releases (differs between torch builds)")
    b.add_argument("--cache", type=Path, action="append", metavar="DIR",
                   help="an offline cache (`nox -s patches -- cache fill DIR`) or folder holding the pinned releases; repeatable"
                   " (default: the cache `nox -s build` used, then the patch tool's artifact cache, downloading through pip"
                   " what they lack unless that build ran --offline)")
    b.add_argument("--offline", action="store_true", help="never download: a pinned release missing from the caches is an error")
    b.add_argument("--max-docs", type=int, metavar="N", help="use only the first N readable documents in sorted order (quick tests)")
    b.add_argument("--valid-fraction", type=float, default=0.02, metavar="F",
                   help="share of documents in the valid split, by path hash (default: %(default)s)")
    b.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing only the files a build writes")
    c = commands.add_parser("check", help="open indexed datasets with Megatron, print counts, fail if a document does not end in EOD")
    c.add_argument("prefixes", nargs="+", type=Path, metavar="PREFIX", help="dataset prefix (without .bin/.idx)")
    c.add_argument("--eod-id", type=int, metavar="N", help="EOD id (default: read from data.json beside the prefix or <PREFIX>.json)")
    bl = commands.add_parser("baselines", help="the valid split's cross-entropy under unigram and interpolated-bigram count "
                             "models of the train split, in nats/token; written to DIR/baselines.json (nam56r.training.data.baselines)")
    bl.add_argument("directory", type=Path, metavar="DIR", help="a built data directory (build or convert)")
    bl.add_argument("--bigram-weight", type=float, default=DEFAULT_BIGRAM_WEIGHT, metavar="LAMBDA",
                    help="the bigram's share of the interpolation, in [0, 1) (default: %(default)s)")
    commands.add_parser("convert", add_help=False, help="convert your jsonl/parquet (text or token ids); see `convert --help`")
    if argv[:1] == ["convert"]:
        from nam56r.training.data.convert import main as convert_main

        return convert_main(argv[1:])
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's import-time notices about missing TE/Apex
        if args.command == "baselines":
            return _baselines_main(args)
        return _build_main(args, argv) if args.command == "build" else _check_main(args)

