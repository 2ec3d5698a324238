"""Count-model baselines of a data directory: the cross-entropy, in nats per token (the LM loss's units), that a
unigram and an interpolated bigram model fitted on the train split give the valid split. A run whose validation loss
is above the bigram's has learned no more than which token tends to follow which.

    python -m nam56r.training.data baselines DIR [--bigram-weight 0.7]

Both read each split as Megatron's indexed dataset holds it (every document followed by EOD) as one token stream,
and score every valid token after the first from the token before it, as the LM loss scores a packed sequence:
- unigram: p(w) = (c(w) + 1) / (N + V), add-one over the data's vocabulary V (N train tokens);
- interpolated bigram: p(w | v) = lambda * c(v, w) / c(v) + (1 - lambda) * p_unigram(w), and p_unigram(w) where the train
  split never has v.
The result goes to DIR/baselines.json with each split's token count and sha256, so a changed split shows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

BASELINES_FILE = "baselines.json"
SCHEMA = "nam56r.data_baselines/1"
DEFAULT_BIGRAM_WEIGHT = 0.7


@dataclass(frozen=True)
class Baselines:
    unigram_nats: float
    bigram_nats: float
    bigram_weight: float  # lambda
    vocab_size: int
    train_tokens: int
    valid_tokens: int
    train_sha256: str
    valid_sha256: str


def cross_entropies(train: np.ndarray, valid: np.ndarray, vocab_size: int,
                    bigram_weight: float = DEFAULT_BIGRAM_WEIGHT) -> tuple[float, float]:
    """(unigram, interpolated bigram) mean cross-entropy in nats over valid[1:], each token scored from the one before
    (the module docstring gives both models). Token ids must lie in [0, vocab_size)."""
    if not 0.0 <= bigram_weight < 1.0:
        raise ValueError(f"the bigram weight lambda must be in [0, 1), got {bigram_weight}: at 1 an unseen pair has probability 0")
    if len(train) < 2 or len(valid) < 2:
        raise ValueError(f"need at least 2 tokens in each split, got train {len(train)}, valid {len(valid)}")
    train, valid = train.astype(np.int64), valid.astype(np.int64)
    for name, tokens in (("train", train), ("valid", valid)):
        if tokens.min() < 0 or tokens.max() >= vocab_size:
            raise ValueError(f"{name} token ids span [{tokens.min()}, {tokens.max()}], outside the vocabulary [0, {vocab_size})")
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    unigram = (counts + 1.0) / (len(train) + vocab_size)
    previous, following = valid[:-1], valid[1:]
    unigram_nats = float(-np.log(unigram[following]).mean())
    # Pair counts as sorted unique keys v * V + w; each valid pair looks its count up by binary search.
    keys, pair_counts = np.unique(train[:-1] * vocab_size + train[1:], return_counts=True)
    context_counts = np.bincount(train[:-1], minlength=vocab_size).astype(np.float64)
    wanted = previous * vocab_size + following
    at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    pair = np.where(keys[at] == wanted, pair_counts[at], 0).astype(np.float64)
    context = context_counts[previous]
    seen = context > 0
    bigram = np.where(seen, bigram_weight * pair / np.where(seen, context, 1.0) + (1 - bigram_weight) * unigram[following],
                      unigram[following])
    return unigram_nats, float(-np.log(bigram).mean())


def compute(directory: Path, bigram_weight: float = DEFAULT_BIGRAM_WEIGHT) -> Baselines:
    """The baselines of a built data directory (its manifest gives the vocabulary)."""
    from nam56r.training.data.format import open_tokens
    from nam56r.training.data.manifest import read_data_manifest

    data = read_data_manifest(directory)
    (_, train), (_, valid) = open_tokens(data.train_prefix), open_tokens(data.valid_prefix)
    unigram, bigram = cross_entropies(np.asarray(train), np.asarray(valid), data.vocab_size, bigram_weight)
    return Baselines(unigram, bigram, bigram_weight, data.vocab_size, len(train), len(valid), tokens_sha256(train),
                     tokens_sha256(valid))


def tokens_sha256(tokens: np.ndarray) -> str:
    """The sha256 of a split's token stream in its stored dtype: what baselines.json records of each split."""
    return hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest()


def write(directory: Path, baselines: Baselines) -> Path:
    path = directory / BASELINES_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"schema": SCHEMA, **asdict(baselines)}, indent=2) + "\n")
    tmp.replace(path)
    return path


def describe(baselines: Baselines) -> str:
    return (f"valid split ({baselines.valid_tokens:,} tokens) scored by count models of the train split "
            f"({baselines.train_tokens:,} tokens, vocabulary {baselines.vocab_size:,}): unigram {baselines.unigram_nats:.3f}, "
            f"interpolated bigram (lambda {baselines.bigram_weight}) {baselines.bigram_nats:.3f} nats/token")
