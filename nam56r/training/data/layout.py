"""The layout of one data directory (`python -m nam56r.training.data build --out DIR`, default
data/pinned-v<VOCAB>/): every path inside it comes from `DataDir`, for the build that writes it and
the readers (the launcher, `data check`, the data checks, the resume check) alike."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nam56r import CHECKOUT_ROOT

DEFAULT_DATA_DIR = Path("data")  # relative to the repository root; git-ignored
DEFAULT_SOURCES_DIR = DEFAULT_DATA_DIR / "sources"  # the pinned corpus' extracted releases
BUILD_COMMAND = "python -m nam56r.training.data build"
CONVERT_COMMAND = "python -m nam56r.training.data convert"


def default_data_dir(vocab_size: int, root: Path = CHECKOUT_ROOT) -> Path:
    """The default corpus for a vocabulary size: `<root>/data/pinned-v<N>`. Where
    `python -m nam56r.training.data build` writes and where `nam56r.training.launcher` reads when no --data is given."""
    return root / DEFAULT_DATA_DIR / f"pinned-v{vocab_size}"


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Held while a build writes `directory`: launches that start at once on one node build the default corpus once,
    the others waiting for it (a lock file beside the directory, released when the process ends)."""
    directory = directory.resolve()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class DataDir:
    path: Path

    SPLITS = ("train", "valid")

    @property
    def manifest(self) -> Path:
        """What the build recorded (JSON: counts, skipped files, checksums, the command). Written last: a
        directory without it is an unfinished build."""
        return self.path / "data.json"

    @property
    def tokenizer_dir(self) -> Path:
        """The HuggingFace tokenizer (AutoTokenizer and Megatron's HuggingFaceTokenizer load it; EOD is <|endoftext|>)."""
        return self.path / "tokenizer"

    @property
    def train_prefix(self) -> Path:
        """The train split's Megatron indexed dataset (add .bin / .idx): every document followed by EOD."""
        return self.path / "train_text_document"

    @property
    def valid_prefix(self) -> Path:
        """The valid split's Megatron indexed dataset (add .bin / .idx)."""
        return self.path / "valid_text_document"

    def prefix(self, split: str) -> Path:
        """The prefix of `split`, one of SPLITS."""
        if split not in self.SPLITS:
            raise ValueError(f"unknown split {split!r}: a data directory holds {' and '.join(self.SPLITS)}")
        return self.train_prefix if split == "train" else self.valid_prefix


@dataclass(frozen=True)
class DataPaths:
    """Megatron indexed datasets (prefixes, without .bin/.idx) and the HuggingFace tokenizer directory: what a run reads."""

    train_prefix: Path
    valid_prefix: Path | None
    tokenizer_dir: Path
