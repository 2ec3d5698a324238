"""The data a run reads, checked before any GPU work: each Megatron prefix's index reads with
Megatron's own index reader, its .bin holds every byte the index points at, it has tokens, and no token id reaches past
the model's vocabulary; a tokenizer given beside a bare prefix fits the model's vocabulary.

Each failure names the file, what is wrong, and how to make it again. The token-id check reads the
whole .bin once (memory-mapped, in chunks), so a large corpus prints its progress.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nam56r.megatron_args import DataPaths

REMAKE = (
    "make it again: `python -m nam56r.data build --out DIR --force` for a built corpus, or the same "
    "`python -m nam56r.data convert ...` command for a converted one"
)
CHUNK_TOKENS = 1 << 26  # 64 Mi token ids per read: bounded memory on any corpus
PROGRESS_AFTER_S = 2.0


class DataCheckError(ValueError):
    """The run's data cannot train this model; the message names the file and the fix."""


@dataclass(frozen=True)
class PrefixSummary:
    prefix: Path
    documents: int
    tokens: int
    max_id: int


def check_prefix_files(prefix: Path, vocab_size: int) -> PrefixSummary:
    """Read `prefix`'s index with Megatron's own reader (the one IndexedDataset uses) and check its .bin
    against the index and the vocabulary."""
    from megatron.core.datasets.indexed_dataset import _IndexReader

    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise DataCheckError(f"{path} does not exist: give the prefix without .bin/.idx of a dataset that does, or {REMAKE}")
    try:
        index = _IndexReader(str(idx_path), multimodal=False)
        lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
        pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
        dtype, dtype_size = index.dtype, index.dtype_size
    except Exception as exc:  # Megatron raises AssertionError, ValueError or struct.error on a damaged index
        raise DataCheckError(f"{idx_path} is not a readable Megatron index ({type(exc).__name__}: {exc}); {REMAKE}") from None
    needed = int(pointers[-1] + lengths[-1] * dtype_size) if len(lengths) else 0
    size = bin_path.stat().st_size
    if size < needed:
        raise DataCheckError(
            f"{bin_path} is truncated: it holds {size:,} bytes but its index points at {needed:,}; {REMAKE}"
        )
    tokens = int(lengths.sum())
    if tokens == 0:
        raise DataCheckError(f"{prefix} holds no tokens ({len(lengths)} sequences, all empty): the corpus is empty; {REMAKE}")
    max_id = _max_token_id(bin_path, dtype, needed // dtype_size)
    if max_id >= vocab_size:
        raise DataCheckError(
            f"{bin_path} holds token id {max_id}, past the model's vocabulary of {vocab_size}: it was tokenized with another "
            f"tokenizer; tokenize it with one of at most {vocab_size} tokens (`python -m nam56r.data convert ... --tokenizer DIR`)"
        )
    return PrefixSummary(prefix, len(lengths), tokens, max_id)


def _max_token_id(bin_path: Path, dtype: type[np.number], count: int) -> int:
    ids = np.memmap(bin_path, dtype=dtype, mode="r", shape=(count,))
    started, best, shown = time.monotonic(), -1, False
    for start in range(0, count, CHUNK_TOKENS):
        best = max(best, int(ids[start : start + CHUNK_TOKENS].max()))
        if time.monotonic() - started > PROGRESS_AFTER_S:
            print(f"  checking token ids in {bin_path}: {min(start + CHUNK_TOKENS, count) / count:.0%}", flush=True)
            shown = True
    if shown:
        print(f"  checked {count:,} token ids in {time.monotonic() - started:.1f} s", flush=True)
    return best


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    from nam56r.data import load_megatron_tokenizer

    try:
        return int(load_megatron_tokenizer(tokenizer_dir).vocab_size)
    except Exception as exc:
        raise DataCheckError(
            f"--tokenizer {tokenizer_dir} does not load as a HuggingFace tokenizer ({type(exc).__name__}: {exc}): "
            f"pass the directory `nam56r.data build` or `save_pretrained` wrote"
        ) from None


def check_data(paths: DataPaths, vocab_size: int, *, tokenizer_vocab: int | None = None) -> list[PrefixSummary]:
    """Check every prefix of `paths` for a model of `vocab_size`; `tokenizer_vocab`, when given, is the
    tokenizer's own size (a bare prefix's --tokenizer), which must fit the model too."""
    if tokenizer_vocab is not None and tokenizer_vocab > vocab_size:
        raise DataCheckError(
            f"the tokenizer in {paths.tokenizer_dir} has {tokenizer_vocab} tokens but the model's vocab_size is {vocab_size}: "
            f"pass the tokenizer the data was made with, or a model whose vocabulary holds it"
        )
    prefixes = [paths.train_prefix] + ([paths.valid_prefix] if paths.valid_prefix is not None else [])
    return [check_prefix_files(prefix, vocab_size) for prefix in prefixes]
