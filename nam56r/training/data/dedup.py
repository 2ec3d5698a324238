"""Exact and near-duplicate removal before the split, so that no valid document is a copy of a train one.

Exact: documents equal once runs of whitespace are collapsed. Near: MinHash over shingles of 5 consecutive words
(`\\w+`), 128 hash functions, banded 16 x 8 for candidates (a pair at Jaccard 0.8 shares a band with probability
0.9+), kept as duplicates when their signatures agree on at least NEAR_JACCARD of the 128. Of each group of copies
the document first in key order stays. Hashes are crc32 and fixed multipliers, so the result is the same on every
machine and every Python.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

SHINGLE_WORDS = 5
NUM_HASHES = 128
BANDS, ROWS = 16, 8
NEAR_JACCARD = 0.8
_WORD = re.compile(r"\w+")
_SPACE = re.compile(r"\s+")


def _constants(label: str) -> np.ndarray:
    """NUM_HASHES fixed 64-bit numbers from sha256 (no RNG, whose streams may change between numpy versions): the
    signatures are part of the corpus' definition."""
    return np.array([int.from_bytes(hashlib.sha256(f"nam56r-minhash-{label}-{i}".encode()).digest()[:8], "little")
                     for i in range(NUM_HASHES)], dtype=np.uint64)


_MULTIPLY = _constants("multiply") | np.uint64(1)
_ADD = _constants("add")
_CHUNK = 4096  # shingles hashed at once (128 x 4096 uint64 = 4 MiB)


class Keyed(Protocol):
    key: str
    text: str


@dataclass
class DedupReport:
    documents: int = 0
    exact: list[tuple[str, str]] = field(default_factory=list)  # (dropped key, the key it copies)
    near: list[tuple[str, str]] = field(default_factory=list)

    def as_json(self) -> dict:
        return {"documents": self.documents, "kept": self.documents - len(self.exact) - len(self.near),
                "dropped_exact": len(self.exact), "dropped_near": len(self.near), "rule": __doc__.split("\n\n")[1].strip(),
                "dropped": [{"key": k, "copies": c, "kind": kind} for kind, pairs in (("exact", self.exact), ("near", self.near))
                            for k, c in pairs]}


def signature(text: str) -> np.ndarray:
    """The MinHash signature (NUM_HASHES uint32) of the text's word shingles."""
    words = np.fromiter((zlib.crc32(w.encode()) for w in _WORD.findall(text)), dtype=np.uint64)
    if len(words) < SHINGLE_WORDS:
        words = np.concatenate([words, np.zeros(SHINGLE_WORDS - len(words), dtype=np.uint64)])
    shingles = np.zeros(len(words) - SHINGLE_WORDS + 1, dtype=np.uint64)
    for offset in range(SHINGLE_WORDS):  # a polynomial of the 5 word hashes, wrapping at 2**64
        shingles = shingles * np.uint64(1_000_003) + words[offset : offset + len(shingles)]
    shingles = np.unique(shingles)
    lowest = np.full(NUM_HASHES, np.iinfo(np.uint64).max, dtype=np.uint64)
    for start in range(0, len(shingles), _CHUNK):
        block = shingles[start : start + _CHUNK]
        hashed = (_MULTIPLY[:, None] * block[None, :] + _ADD[:, None]) >> np.uint64(32)
        lowest = np.minimum(lowest, hashed.min(axis=1))
    return lowest.astype(np.uint32)


def deduplicate(docs: Sequence[Keyed]) -> tuple[list[Keyed], DedupReport]:
    """`docs` without exact and near copies (the first in key order of each group stays), and what went."""
    report = DedupReport(documents=len(docs))
    ordered = sorted(docs, key=lambda d: d.key)
    seen: dict[str, str] = {}
    unique = []
    for doc in ordered:
        digest = hashlib.sha256(_SPACE.sub(" ", doc.text).strip().encode()).hexdigest()
        if digest in seen:
            report.exact.append((doc.key, seen[digest]))
        else:
            seen[digest] = doc.key
            unique.append(doc)
    signatures = [signature(doc.text) for doc in unique]
    kept = _drop_near(unique, signatures, report)
    return kept, report


def _drop_near(docs: list[Keyed], signatures: list[np.ndarray], report: DedupReport) -> list[Keyed]:
    """Each document against the first holder of each of its bands (linear in documents, not in pairs)."""
    first_in_band: list[dict[bytes, int]] = [{} for _ in range(BANDS)]
    copy_of: dict[int, int] = {}
    for index, sig in enumerate(signatures):
        for band in range(BANDS):
            key = sig[band * ROWS : (band + 1) * ROWS].tobytes()
            holder = first_in_band[band].setdefault(key, index)
            if holder == index or index in copy_of:
                continue
            original = copy_of.get(holder, holder)
            if np.mean(signatures[original] == sig) >= NEAR_JACCARD:
                copy_of[index] = original
    for index, original in copy_of.items():
        report.near.append((docs[index].key, docs[original].key))
    return [doc for index, doc in enumerate(docs) if index not in copy_of]
