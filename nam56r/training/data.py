"""The default training data, built from files already on this machine, and Megatron's view of it.

    python -m nam56r.training.data build [--out DIR] [--vocab-size N] [--source DIR ...]   # no download
    python -m nam56r.training.data check PREFIX ...                                         # counts, EOD at every end
    python -m nam56r.training.data convert FILE ... --out PREFIX ...   # your jsonl/parquet (nam56r.training.data_convert)

`build` makes a C/C++ corpus from the headers the installed PyTorch wheel ships (about 9,400
files, 39 MB; one file is one document), trains a byte-level BPE tokenizer on its train split and
writes Megatron indexed datasets with Megatron's own builder:

    <out>/tokenizer/                         HuggingFace tokenizer (AutoTokenizer and Megatron's
                                             HuggingFaceTokenizer load it; EOD is <|endoftext|>)
    <out>/train_text_document.{bin,idx}      every document followed by EOD
    <out>/valid_text_document.{bin,idx}
    <out>/data.json                          counts, skipped files, checksums, the command

The split is decided per document by a sha256 of its path relative to its source root, so it does
not move when documents are added, removed or capped (save the one document moved to valid when
none falls there), and the same relative path under two roots lands in the same split. The launcher
reads the result with `read_data_manifest(dir)`; `DataManifest.check_vocab` compares it with a model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from nam56r import CHECKOUT_ROOT
from nam56r.model.config import ModelConfig

ROOT = CHECKOUT_ROOT
DEFAULT_DATA_DIR = Path("data")  # relative to the repository root; git-ignored
EOD_TOKEN = "<|endoftext|>"
MANIFEST = "data.json"
TOKENIZER_DIR = "tokenizer"
SPLIT_PREFIXES = {"train": "train_text_document", "valid": "valid_text_document"}
SOURCE_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".inl", ".cuh", ".c", ".cc", ".cpp", ".cxx", ".cu")
MIN_VOCAB_SIZE = 257  # the 256 byte-level symbols and EOD
BUILD_COMMAND = "python -m nam56r.training.data build"
CONVERT_COMMAND = "python -m nam56r.training.data convert"
ENCODE_CHUNK = 1024  # documents per encode_batch call (the Rust tokenizer spreads each call over all cores)
MAX_ID_CHUNK = 1 << 26  # token ids per read when scanning a .bin for its largest id: bounded memory on any corpus


def torch_include_dir() -> Path:
    """The C++ headers shipped inside the installed PyTorch wheel: the default corpus."""
    import torch

    return Path(torch.__file__).resolve().parent / "include"


def default_data_dir(vocab_size: int, root: Path = ROOT) -> Path:
    """The default corpus for a vocabulary size: `<root>/data/cpp-headers-v<N>`. Where
    `python -m nam56r.training.data build` writes and where `nam56r.training.train` reads when no --data is given."""
    return root / DEFAULT_DATA_DIR / f"cpp-headers-v{vocab_size}"


@dataclass(frozen=True)
class CorpusConfig:
    sources: tuple[Path, ...]  # directories searched recursively for SOURCE_SUFFIXES files
    valid_fraction: float = 0.02
    max_docs: int | None = None  # the first N readable documents in sorted order (tests)

    def validate(self) -> CorpusConfig:
        if not 0.0 < self.valid_fraction < 1.0:
            raise ValueError(f"valid_fraction {self.valid_fraction} must be strictly between 0 and 1 (e.g. 0.02)")
        if self.max_docs is not None and self.max_docs < 2:
            raise ValueError(f"max_docs {self.max_docs} must be at least 2 (one train and one valid document)")
        for source in self.sources:
            if not source.is_dir():
                raise ValueError(f"source {source} is not a directory: pass an existing directory to --source")
        return self


@dataclass(frozen=True)
class Document:
    key: str  # path relative to its source root (posix): names the document and decides its split
    text: str


@dataclass(frozen=True)
class Corpus:
    train: tuple[Document, ...]
    valid: tuple[Document, ...]
    skipped: tuple[tuple[str, str], ...]  # (path, reason) of files left out


@dataclass(frozen=True)
class DataManifest:
    """What the launcher needs from a built data directory (absolute paths)."""

    directory: Path
    train_prefix: Path  # Megatron prefixes: add .bin / .idx
    valid_prefix: Path
    tokenizer_dir: Path
    vocab_size: int  # the tokenizer's real size (may be below the size asked for: see data.json)
    eod_id: int

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise if the model's embedding cannot hold every token id of this data."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the data in {self.directory} uses a {self.vocab_size}-token vocabulary but the model's vocab_size is "
                f"{model_vocab_size}: rebuild it with `{BUILD_COMMAND} --out {self.directory} --vocab-size {model_vocab_size} --force`"
            )


class Progress:
    """One stderr line at most every `every_s` seconds, and one at the end."""

    def __init__(self, label: str, total: int, every_s: float = 2.0) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.done, self.start, self.last = 0, time.monotonic(), 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            pct = 100.0 * self.done / max(self.total, 1)
            print(f"  {self.label}: {self.done}/{self.total} ({pct:.0f}%, {now - self.start:.1f}s)", file=sys.stderr, flush=True)


def split_score(key: str | bytes) -> float:
    """A stable number in [0, 1) for `key` (str: its UTF-8); documents scoring below the valid fraction go to valid."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2.0**64


def assign_valid(keys: Sequence[str], valid_fraction: float) -> list[bool]:
    """Per key, whether it is a valid document; at least one valid and one train when there are two keys."""
    if len(keys) < 2:
        raise ValueError(f"{len(keys)} document(s) cannot be split into train and valid: add sources or raise --max-docs")
    scores = [split_score(k) for k in keys]
    valid = [s < valid_fraction for s in scores]
    if not any(valid):
        valid[min(range(len(keys)), key=scores.__getitem__)] = True
    if all(valid):
        valid[max(range(len(keys)), key=scores.__getitem__)] = False
    return valid


def collect_corpus(config: CorpusConfig) -> Corpus:
    """Read the source files in sorted order; skip files that are empty or not UTF-8, and say why."""
    config.validate()
    docs: list[Document] = []
    skipped: list[tuple[str, str]] = []
    for root in config.sources:
        if config.max_docs is not None and len(docs) >= config.max_docs:
            break
        for path in sorted((p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()), key=lambda p: p.as_posix()):
            if config.max_docs is not None and len(docs) >= config.max_docs:
                break
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                skipped.append((str(path), f"not UTF-8 (byte {exc.start})"))
                continue
            if not text:
                skipped.append((str(path), "empty"))
                continue
            docs.append(Document(path.relative_to(root).as_posix(), text))
    if not docs:
        reasons = dict(Counter(r.split(" (")[0] for _, r in skipped))
        found = f"{len(skipped)} files with those suffixes, all skipped: {reasons}" if skipped else "no such files"
        raise ValueError(
            f"no usable source files under {', '.join(map(str, config.sources))} ({found}): pass --source DIR holding "
            f"non-empty UTF-8 files ending in {' '.join(SOURCE_SUFFIXES)}"
        )
    valid = assign_valid([d.key for d in docs], config.valid_fraction)
    return Corpus(
        train=tuple(d for d, v in zip(docs, valid, strict=True) if not v),
        valid=tuple(d for d, v in zip(docs, valid, strict=True) if v),
        skipped=tuple(skipped),
    )


def train_tokenizer(texts: Sequence[str], vocab_size: int, out_dir: Path) -> tuple[Any, int]:
    """Train byte-level BPE with EOD as its only special token; save it under `out_dir` as a
    HuggingFace tokenizer. Returns the `tokenizers.Tokenizer` and the size BPE reached, which is
    below `vocab_size` when the corpus runs out of merges (it is never padded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} is below {MIN_VOCAB_SIZE} (256 byte symbols + EOD): pass a larger --vocab-size")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # no normalizer: lossless
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOD_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOD_TOKEN, clean_up_tokenization_spaces=False)
    wrapped.save_pretrained(str(out_dir))
    return tokenizer, tokenizer.get_vocab_size()


def megatron_tokenizer_args(tokenizer_dir: Path) -> SimpleNamespace:
    """The attributes Megatron 0.19's `build_tokenizer(args)` reads for a HuggingFaceTokenizer."""
    return SimpleNamespace(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tokenizer_dir), metadata_path=None, chat_template=None,
        vocab_file=None, merge_file=None, special_tokens=None, tokenizer_hf_no_use_fast=False, trust_remote_code=False,
        tokenizer_hf_no_include_special_tokens=False, pad_vocab_size=False,
    )


def load_megatron_tokenizer(tokenizer_dir: Path) -> Any:
    """Megatron's own tokenizer over `tokenizer_dir`, built the way `pretrain` builds it."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    return build_tokenizer(megatron_tokenizer_args(tokenizer_dir))


def token_dtype(vocab_size: int) -> type[np.number]:
    """The smallest dtype Megatron picks for token ids of this vocabulary (`DType.optimal_dtype`)."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def write_indexed_dataset(prefix: Path, documents: Iterable[Sequence[int] | np.ndarray], dtype: type[np.number]) -> tuple[int, int]:
    """Write `prefix`.bin/.idx with Megatron's builder, one sequence per document. Returns (documents, tokens)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    n_docs = n_tokens = 0
    for doc in documents:
        builder.add_document(np.asarray(doc, dtype=dtype), [len(doc)])
        n_docs, n_tokens = n_docs + 1, n_tokens + len(doc)
    builder.finalize(f"{prefix}.idx")
    return n_docs, n_tokens


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _encoded(tokenizer: Any, docs: Sequence[Document], eod_id: int, label: str) -> Iterable[np.ndarray]:
    progress = Progress(f"tokenizing {label}", len(docs))
    for start in range(0, len(docs), ENCODE_CHUNK):
        chunk = docs[start : start + ENCODE_CHUNK]
        for enc in tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False):
            yield np.append(np.asarray(enc.ids, dtype=np.int64), eod_id)
        progress.advance(len(chunk))


def build(out: Path, vocab_size: int, corpus: CorpusConfig, force: bool = False, command: Sequence[str] | None = None) -> dict:
    """Build the corpus, tokenizer and indexed datasets into `out`; return the data.json contents."""
    import tokenizers

    started = time.monotonic()
    corpus = corpus.validate()
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} is below {MIN_VOCAB_SIZE} (256 byte symbols + EOD): pass a larger --vocab-size")
    out = out.resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: pass a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"output directory {out} is not empty: pass --force to overwrite the files a build writes, or another --out")
    print(f"reading sources: {', '.join(map(str, corpus.sources))}", file=sys.stderr)
    data = collect_corpus(corpus)  # before `out` is touched: sources with no usable file leave an earlier build whole
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # written last: a directory without it is an unfinished build
    train_mb = sum(len(d.text.encode("utf-8")) for d in data.train) / 1e6
    print(f"training BPE (vocab {vocab_size}) on {len(data.train)} train documents ({train_mb:.1f} MB)...", file=sys.stderr)
    t0 = time.monotonic()
    tokenizer, reached = train_tokenizer([d.text for d in data.train], vocab_size, out / TOKENIZER_DIR)
    eod_id = tokenizer.token_to_id(EOD_TOKEN)
    print(f"  trained in {time.monotonic() - t0:.1f}s: {reached} tokens, EOD id {eod_id}", file=sys.stderr)
    if reached < vocab_size:
        print(f"warning: BPE reached {reached} tokens, not the {vocab_size} asked for (the corpus has no more merges)", file=sys.stderr)

    megatron = load_megatron_tokenizer(out / TOKENIZER_DIR)
    if (megatron.eod, megatron.vocab_size) != (eod_id, reached):
        raise RuntimeError(
            f"Megatron reads {out / TOKENIZER_DIR} as eod {megatron.eod}, vocab {megatron.vocab_size}; we wrote {eod_id}, {reached}"
        )

    # Text that spells "<|endoftext|>" is encoded as text: EOD appears only where we append it.
    tokenizer.encode_special_tokens = True
    dtype = token_dtype(reached)
    counts: dict[str, dict[str, int]] = {"documents": {}, "tokens": {}}
    checksums = {}
    for split, docs in (("train", data.train), ("valid", data.valid)):
        prefix = out / SPLIT_PREFIXES[split]
        n_docs, n_tokens = write_indexed_dataset(prefix, _encoded(tokenizer, docs, eod_id, split), dtype)
        counts["documents"][split], counts["tokens"][split] = n_docs, n_tokens
        for suffix in (".bin", ".idx"):
            checksums[prefix.name + suffix] = sha256_file(Path(f"{prefix}{suffix}"))

    manifest = {
        "format": 1,
        "sources": [str(s.resolve()) for s in corpus.sources],
        "suffixes": list(SOURCE_SUFFIXES),
        "max_docs": corpus.max_docs,
        "valid_fraction": corpus.valid_fraction,
        "split_rule": "valid if sha256(relative path)[:8] / 2**64 < valid_fraction (at least one valid document)",
        **counts,
        "valid_documents": [d.key for d in data.valid],
        "skipped": [{"path": p, "reason": r} for p, r in data.skipped],
        "skipped_by_reason": dict(Counter(r.split(" (")[0] for _, r in data.skipped)),
        "tokenizer_dir": TOKENIZER_DIR,
        "prefixes": dict(SPLIT_PREFIXES),
        "vocab_size": {"requested": vocab_size, "reached": reached},
        "eod_token": EOD_TOKEN,
        "eod_id": eod_id,
        "dtype": np.dtype(dtype).name,
        "sha256": checksums,
        "command": shlex.join(command) if command else None,
        "tokenizers_version": tokenizers.__version__,
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def format_summary(out: Path, manifest: dict) -> str:
    sizes = {name: Path(out, name).stat().st_size for name in manifest["sha256"]}
    lines = [f"built {out} in {manifest['seconds']}s"]
    for split in ("train", "valid"):
        prefix = manifest["prefixes"][split]
        mb = (sizes[prefix + ".bin"] + sizes[prefix + ".idx"]) / 1e6
        counts = f"{manifest['documents'][split]} documents, {manifest['tokens'][split]} tokens"
        lines.append(f"  {split}: {counts} -> {out / prefix}.bin/.idx ({mb:.1f} MB)")
    vocab = manifest["vocab_size"]
    reached = "" if vocab["reached"] == vocab["requested"] else f" (asked for {vocab['requested']}: the corpus ran out of merges)"
    tokenizer = out / manifest["tokenizer_dir"]
    lines.append(f"  tokenizer: {tokenizer}, {vocab['reached']} tokens{reached}, EOD {manifest['eod_id']}, {manifest['dtype']} ids")
    if manifest["skipped"]:
        lines.append(f"  skipped {len(manifest['skipped'])} files: {manifest['skipped_by_reason']} (listed in data.json)")
    return "\n".join(lines)


def read_data_manifest(directory: Path) -> DataManifest:
    """The built data in `directory`; raises FileNotFoundError naming the command that builds it."""
    directory = Path(directory).resolve()
    path = directory / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"no training data in {directory} ({MANIFEST} is missing): build it with `{BUILD_COMMAND} --out {directory}`"
        )
    raw = json.loads(path.read_text())
    manifest = DataManifest(
        directory=directory,
        train_prefix=directory / raw["prefixes"]["train"],
        valid_prefix=directory / raw["prefixes"]["valid"],
        tokenizer_dir=directory / raw["tokenizer_dir"],
        vocab_size=raw["vocab_size"]["reached"],
        eod_id=raw["eod_id"],
    )
    missing = [str(p) for p in (*_files(manifest.train_prefix), *_files(manifest.valid_prefix), manifest.tokenizer_dir) if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"{path} names files that are gone ({', '.join(missing)}): rebuild with `{BUILD_COMMAND} --out {directory} --force`"
        )
    return manifest


def _files(prefix: Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


@dataclass(frozen=True)
class PrefixReport:
    prefix: Path
    documents: int
    tokens: int
    max_id: int
    not_ending_in_eod: tuple[int, ...]  # document indices (the first 10)
    bad_count: int


def max_token_id(bin_path: Path, tokens: np.ndarray, every_s: float = 2.0) -> int:
    """The largest id in `tokens` (a memory map of `bin_path`), read in bounded chunks; a scan that
    takes longer than `every_s` says how far it got on stderr."""
    started = last = time.monotonic()
    best = -1
    for start in range(0, len(tokens), MAX_ID_CHUNK):
        best = max(best, int(tokens[start : start + MAX_ID_CHUNK].max()))
        if (now := time.monotonic()) - last >= every_s:
            last = now
            done = min(start + MAX_ID_CHUNK, len(tokens))
            print(f"  checking token ids in {bin_path}: {done:,}/{len(tokens):,} ({100 * done / len(tokens):.0f}%, "
                  f"{now - started:.1f}s)", file=sys.stderr, flush=True)
    return best


def check_prefix(prefix: Path, eod_id: int) -> PrefixReport:
    """Open `prefix` with Megatron's IndexedDataset and check that every document ends in `eod_id`."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    index = dataset.index
    count = int(index.sequence_lengths.sum(dtype=np.int64))
    tokens = np.memmap(f"{prefix}.bin", dtype=index.dtype, mode="r", shape=(count,)) if count else np.zeros(0, index.dtype)
    lengths = index.sequence_lengths.astype(np.int64)
    seq_ends = index.sequence_pointers // index.dtype_size + lengths - 1  # last token of each sequence
    doc_bounds = np.asarray(dataset.document_indices, dtype=np.int64)  # document d is sequences [b[d], b[d+1])
    ok = np.zeros(len(doc_bounds) - 1, dtype=bool)
    with_tokens = np.flatnonzero(doc_bounds[1:] > doc_bounds[:-1])
    last_seq = doc_bounds[1:][with_tokens] - 1
    with_tokens, last_seq = with_tokens[lengths[last_seq] > 0], last_seq[lengths[last_seq] > 0]
    ok[with_tokens] = tokens[seq_ends[last_seq]] == eod_id
    bad = np.flatnonzero(~ok)
    return PrefixReport(
        prefix=prefix, documents=len(ok), tokens=int(lengths.sum()), max_id=max_token_id(Path(f"{prefix}.bin"), tokens),
        not_ending_in_eod=tuple(int(i) for i in bad[:10]), bad_count=len(bad),
    )


def eod_id_near(prefix: Path) -> int | None:
    """The EOD id recorded for `prefix`: by the converter in `<prefix>.json`, or by the build in data.json beside it."""
    if (own := Path(f"{prefix}.json")).is_file():
        return json.loads(own.read_text()).get("eod_id")
    if (built := prefix.parent / MANIFEST).is_file():
        raw = json.loads(built.read_text())
        if prefix.name in raw.get("prefixes", {}).values():
            return raw.get("eod_id")
    return None


def _check_main(args: argparse.Namespace) -> int:
    failed = 0
    for prefix in args.prefixes:
        prefix = Path(str(prefix).removesuffix(".bin").removesuffix(".idx"))
        if missing := [str(p) for p in _files(prefix) if not p.is_file()]:
            raise SystemExit(f"no dataset at {prefix}: {', '.join(missing)} missing (pass the prefix, without .bin/.idx)")
        eod = args.eod_id if args.eod_id is not None else eod_id_near(prefix)
        if eod is None:
            raise SystemExit(f"no EOD id recorded beside {prefix} (no {prefix.parent / MANIFEST} or {prefix}.json): pass --eod-id N")
        report = check_prefix(prefix, eod)
        status = "ok"
        if report.bad_count:
            status = f"FAIL: {report.bad_count} documents do not end in EOD {eod}, e.g. documents {list(report.not_ending_in_eod)}"
        print(f"{prefix}: {report.documents} documents, {report.tokens} tokens, max id {report.max_id}, EOD {eod}: {status}")
        failed += report.bad_count > 0
    return 1 if failed else 0


def _build_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    sources = tuple(args.source) if args.source else (torch_include_dir(),)
    args.out = args.out or default_data_dir(args.vocab_size)
    corpus = CorpusConfig(sources=sources, valid_fraction=args.valid_fraction, max_docs=args.max_docs)
    try:
        manifest = build(args.out, args.vocab_size, corpus, force=args.force, command=["python", "-m", "nam56r.training.data", *argv])
    except (FileExistsError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    print(format_summary(args.out.resolve(), manifest))
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
                   help=f"output directory (default: <repo>/{DEFAULT_DATA_DIR}/cpp-headers-v<VOCAB>, git-ignored: the launcher reads it)")
    b.add_argument("--vocab-size", type=int, default=ModelConfig.vocab_size, metavar="N",
                   help="BPE vocabulary size; pass the model preset's vocab_size (nam56r: 131072, nam56r-tiny: 512). A small "
                   "corpus may reach fewer tokens: the size reached is reported and recorded, never padded (default: %(default)s)")
    b.add_argument("--source", type=Path, action="append", metavar="DIR",
                   help=f"directory of C/C++ files ({' '.join(SOURCE_SUFFIXES)}), repeatable; replaces the default "
                   "(the headers of the installed PyTorch wheel)")
    b.add_argument("--max-docs", type=int, metavar="N", help="use only the first N readable documents in sorted order (quick tests)")
    b.add_argument("--valid-fraction", type=float, default=0.02, metavar="F",
                   help="share of documents in the valid split, by path hash (default: %(default)s)")
    b.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing only the files a build writes")
    c = commands.add_parser("check", help="open indexed datasets with Megatron, print counts, fail if a document does not end in EOD")
    c.add_argument("prefixes", nargs="+", type=Path, metavar="PREFIX", help="dataset prefix (without .bin/.idx)")
    c.add_argument("--eod-id", type=int, metavar="N", help="EOD id (default: read from data.json beside the prefix or <PREFIX>.json)")
    commands.add_parser("convert", add_help=False, help="convert your jsonl/parquet (text or token ids); see `convert --help`")
    if argv[:1] == ["convert"]:
        from nam56r.training.data_convert import main as convert_main

        return convert_main(argv[1:])
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Megatron's import-time notices about missing TE/Apex
        return _build_main(args, argv) if args.command == "build" else _check_main(args)


if __name__ == "__main__":
    sys.exit(main())
