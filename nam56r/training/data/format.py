"""Megatron's side of the data: the tokenizer as Megatron loads it, the token dtype it picks, indexed
datasets written with its builder and read back with its IndexedDataset, the split rule and checksums
that the build (`nam56r.training.data.build`) and the converter (`nam56r.training.data.convert`) share."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

MAX_ID_CHUNK = 1 << 26  # token ids per read when scanning a .bin for its largest id: bounded memory on any corpus


def split_score(key: str | bytes) -> float:
    """A stable number in [0, 1) for `key` (str: its UTF-8); documents scoring below the valid fraction go to valid."""
    data = key.encode("utf-8") if isinstance(key, str) else key
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") / 2.0**64


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


def open_tokens(prefix: Path) -> tuple[Any, np.ndarray]:
    """`prefix` opened with Megatron's IndexedDataset, and its whole token stream (read-only, mapped) in its dtype."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    index = dataset.index
    count = int(index.sequence_lengths.sum(dtype=np.int64))
    tokens = np.memmap(f"{prefix}.bin", dtype=index.dtype, mode="r", shape=(count,)) if count else np.zeros(0, index.dtype)
    return dataset, tokens


def check_prefix(prefix: Path, eod_id: int) -> PrefixReport:
    """Open `prefix` with Megatron's IndexedDataset and check that every document ends in `eod_id`."""
    dataset, tokens = open_tokens(prefix)
    index = dataset.index
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
