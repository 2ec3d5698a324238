"""Exact and near-duplicate removal (nam56r.training.data.dedup) on real C-like text."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from nam56r.training.data.dedup import NUM_HASHES, deduplicate, signature


@dataclass(frozen=True)
class Doc:
    key: str
    text: str


def _source(seed: int, lines: int = 300) -> str:
    rng = random.Random(seed)
    names = [f"value_{i}" for i in range(400)]
    return "\n".join(f"int {rng.choice(names)} = {rng.choice(names)} + {rng.randrange(1000)};" for _ in range(lines))


def test_exact_and_near_copies_go_and_distinct_files_stay() -> None:
    original = _source(1)
    lines = original.split("\n")
    near = "\n".join(lines[:150] + ["int patched = 1;"] + lines[151:])  # one line of 300 changed
    docs = [Doc("b/original.c", original), Doc("a/spaces.c", original.replace(" = ", "   =\t")),
            Doc("c/near.c", near), Doc("d/other.c", _source(2)), Doc("e/third.c", _source(3))]

    kept, report = deduplicate(docs)

    assert [d.key for d in kept] == ["a/spaces.c", "d/other.c", "e/third.c"]  # the first in key order of each group
    assert report.exact == [("b/original.c", "a/spaces.c")]
    assert report.near == [("c/near.c", "a/spaces.c")]
    assert report.as_json()["kept"] == 3 and report.as_json()["dropped_near"] == 1


def test_signatures_are_fixed_numbers_and_estimate_jaccard() -> None:
    a, b = _source(4), _source(5)
    sig_a = signature(a)
    assert sig_a.dtype == np.uint32 and sig_a.shape == (NUM_HASHES,)
    assert np.array_equal(sig_a, signature(a))  # deterministic, no per-process salt
    # the same numbers on every machine (crc32 words, sha256-derived multipliers): part of the corpus' definition
    assert signature("int main ( void ) { return 0 ; }")[:4].tolist() == [1769798081, 2143444022, 4163212977, 1014609896]
    assert np.mean(sig_a == signature(b)) < 0.2
    assert signature("x").shape == (NUM_HASHES,)  # shorter than one shingle still signs
