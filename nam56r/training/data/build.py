"""The default corpus build behind `python -m nam56r.training.data build` (what it writes, and how documents
are split: the docstring of `nam56r.training.data`, which is the command's --help): collect the source
files, train the byte-level BPE tokenizer on the train split, write each split with Megatron's builder
into the paths `DataDir(out)` names, and data.json last, so a directory without it is an unfinished build."""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from nam56r_patchlane.artifacts import sha256_file

from nam56r.training.data.format import load_megatron_tokenizer, split_score, token_dtype, write_indexed_dataset
from nam56r.training.data.layout import DataDir

EOD_TOKEN = "<|endoftext|>"
SOURCE_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".inl", ".cuh", ".c", ".cc", ".cpp", ".cxx", ".cu")
MIN_VOCAB_SIZE = 257  # the 256 byte-level symbols and EOD
ENCODE_CHUNK = 1024  # documents per encode_batch call (the Rust tokenizer spreads each call over all cores)
SPLIT_RULE = "valid if sha256(relative path)[:8] / 2**64 < valid_fraction (at least one valid document)"


def torch_include_dir() -> Path:
    """The C++ headers shipped inside the installed PyTorch wheel: the default corpus."""
    import torch

    return Path(torch.__file__).resolve().parent / "include"


@dataclass(frozen=True)
class CorpusConfig:
    sources: tuple[Path, ...]  # directories searched recursively for SOURCE_SUFFIXES files
    valid_fraction: float = 0.02
    max_docs: int | None = None  # the first N readable documents in sorted order (tests)
    dedup: bool = False  # drop exact and near copies before the split (dedup.py)

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
    dedup: dict | None = None  # what deduplication kept and dropped (DedupReport.as_json); None: not deduplicated


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
    report = None
    if config.dedup:
        from nam56r.training.data.dedup import deduplicate

        print(f"deduplicating {len(docs)} documents (exact, then MinHash near copies)...", file=sys.stderr)
        docs, found = deduplicate(docs)
        report = found.as_json()
        print(f"  kept {report['kept']}, dropped {report['dropped_exact']} exact and {report['dropped_near']} near copies",
              file=sys.stderr)
    valid = assign_valid([d.key for d in docs], config.valid_fraction)
    return Corpus(
        train=tuple(d for d, v in zip(docs, valid, strict=True) if not v),
        valid=tuple(d for d, v in zip(docs, valid, strict=True) if v),
        skipped=tuple(skipped),
        dedup=report,
    )


def corpus_checksum(data: Corpus) -> str:
    """sha256 of every document (split, key, text) in key order: the same corpus gives the same checksum anywhere."""
    digest = hashlib.sha256()
    for split, docs in (("train", data.train), ("valid", data.valid)):
        for doc in sorted(docs, key=lambda d: d.key):
            digest.update(f"{split}\0{doc.key}\0".encode())
            digest.update(hashlib.sha256(doc.text.encode()).digest())
    return digest.hexdigest()


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


def _encoded(tokenizer: Any, docs: Sequence[Document], eod_id: int, label: str) -> Iterable[np.ndarray]:
    progress = Progress(f"tokenizing {label}", len(docs))
    for start in range(0, len(docs), ENCODE_CHUNK):
        chunk = docs[start : start + ENCODE_CHUNK]
        for enc in tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False):
            yield np.append(np.asarray(enc.ids, dtype=np.int64), eod_id)
        progress.advance(len(chunk))


def build(out: Path, vocab_size: int, corpus: CorpusConfig, force: bool = False, command: Sequence[str] | None = None) -> dict:
    """Build the corpus, tokenizer and indexed datasets into `out` (the paths `DataDir(out)` names); return
    the data.json contents."""
    import tokenizers

    started = time.monotonic()
    corpus = corpus.validate()
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size} is below {MIN_VOCAB_SIZE} (256 byte symbols + EOD): pass a larger --vocab-size")
    layout = DataDir(_writable_out(out, force))
    print(f"reading sources: {', '.join(map(str, corpus.sources))}", file=sys.stderr)
    data = collect_corpus(corpus)  # before `out` is touched: sources with no usable file leave an earlier build whole
    layout.path.mkdir(parents=True, exist_ok=True)
    layout.manifest.unlink(missing_ok=True)  # written last: a directory without it is an unfinished build
    tokenizer, reached, eod_id = _train_checked_tokenizer(data.train, vocab_size, layout.tokenizer_dir)
    # Text that spells "<|endoftext|>" is encoded as text: EOD appears only where the build appends it.
    tokenizer.encode_special_tokens = True
    dtype = token_dtype(reached)
    counts, checksums = _write_splits(layout, data, tokenizer, eod_id, dtype)
    manifest = {
        "format": 1,
        "sources": [str(s.resolve()) for s in corpus.sources],
        "suffixes": list(SOURCE_SUFFIXES),
        "max_docs": corpus.max_docs,
        "valid_fraction": corpus.valid_fraction,
        "split_rule": SPLIT_RULE,
        **counts,
        "valid_documents": [d.key for d in data.valid],
        "skipped": [{"path": p, "reason": r} for p, r in data.skipped],
        "skipped_by_reason": dict(Counter(r.split(" (")[0] for _, r in data.skipped)),
        "tokenizer_dir": layout.tokenizer_dir.name,
        "prefixes": {split: layout.prefix(split).name for split in DataDir.SPLITS},
        "vocab_size": {"requested": vocab_size, "reached": reached},
        "eod_token": EOD_TOKEN,
        "eod_id": eod_id,
        "dtype": np.dtype(dtype).name,
        "sha256": checksums,
        "corpus_sha256": corpus_checksum(data),
        "dedup": data.dedup,
        "command": shlex.join(command) if command else None,
        "tokenizers_version": tokenizers.__version__,
        "seconds": round(time.monotonic() - started, 1),
    }
    layout.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _writable_out(out: Path, force: bool) -> Path:
    """`out`, resolved, once it is known to be a directory a build may write (absent, empty, or --force)."""
    out = out.resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file: pass a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"output directory {out} is not empty: pass --force to overwrite the files a build writes, or another --out")
    return out


def _train_checked_tokenizer(train: Sequence[Document], vocab_size: int, tokenizer_dir: Path) -> tuple[Any, int, int]:
    """BPE trained on the train documents and saved to `tokenizer_dir`, read back the way Megatron reads it:
    (the tokenizer, the vocabulary size it reached, its EOD id)."""
    train_mb = sum(len(d.text.encode("utf-8")) for d in train) / 1e6
    print(f"training BPE (vocab {vocab_size}) on {len(train)} train documents ({train_mb:.1f} MB)...", file=sys.stderr)
    t0 = time.monotonic()
    tokenizer, reached = train_tokenizer([d.text for d in train], vocab_size, tokenizer_dir)
    eod_id = tokenizer.token_to_id(EOD_TOKEN)
    print(f"  trained in {time.monotonic() - t0:.1f}s: {reached} tokens, EOD id {eod_id}", file=sys.stderr)
    if reached < vocab_size:
        print(f"warning: BPE reached {reached} tokens, not the {vocab_size} asked for (the corpus has no more merges)", file=sys.stderr)
    megatron = load_megatron_tokenizer(tokenizer_dir)
    if (megatron.eod, megatron.vocab_size) != (eod_id, reached):
        raise RuntimeError(
            f"Megatron reads {tokenizer_dir} as eod {megatron.eod}, vocab {megatron.vocab_size}; the build wrote {eod_id}, {reached}"
        )
    return tokenizer, reached, eod_id


def _write_splits(layout: DataDir, data: Corpus, tokenizer: Any, eod_id: int, dtype: type[np.number]) -> tuple[dict, dict[str, str]]:
    """Each split tokenized into its indexed dataset: ({"documents": {split: n}, "tokens": {split: n}}, file -> sha256)."""
    counts: dict[str, dict[str, int]] = {"documents": {}, "tokens": {}}
    checksums = {}
    for split, docs in (("train", data.train), ("valid", data.valid)):
        prefix = layout.prefix(split)
        n_docs, n_tokens = write_indexed_dataset(prefix, _encoded(tokenizer, docs, eod_id, split), dtype)
        counts["documents"][split], counts["tokens"][split] = n_docs, n_tokens
        for suffix in (".bin", ".idx"):
            checksums[prefix.name + suffix] = sha256_file(Path(f"{prefix}{suffix}"))
    return counts, checksums


def format_summary(out: Path, manifest: dict) -> str:
    """What a build wrote into `out`, from its data.json contents `manifest`: per split its counts and size,
    the tokenizer, the files left out."""
    sizes = {name: Path(out, name).stat().st_size for name in manifest["sha256"]}
    lines = [f"built {out} in {manifest['seconds']}s"]
    for split in DataDir.SPLITS:
        prefix = manifest["prefixes"][split]
        mb = (sizes[prefix + ".bin"] + sizes[prefix + ".idx"]) / 1e6
        counts = f"{manifest['documents'][split]} documents, {manifest['tokens'][split]} tokens"
        lines.append(f"  {split}: {counts} -> {out / prefix}.bin/.idx ({mb:.1f} MB)")
    vocab = manifest["vocab_size"]
    reached = "" if vocab["reached"] == vocab["requested"] else f" (asked for {vocab['requested']}: the corpus ran out of merges)"
    tokenizer = out / manifest["tokenizer_dir"]
    lines.append(f"  tokenizer: {tokenizer}, {vocab['reached']} tokens{reached}, EOD {manifest['eod_id']}, {manifest['dtype']} ids")
    if manifest["skipped"]:
        listed = DataDir(out).manifest.name
        lines.append(f"  skipped {len(manifest['skipped'])} files: {manifest['skipped_by_reason']} (listed in {listed})")
    return "\n".join(lines)
