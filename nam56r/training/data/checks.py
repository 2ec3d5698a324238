"""The data a run reads, checked before any GPU work (`nam56r.training.launcher` calls `check_data` after choosing
the data and before the preflight, dry runs included).

Per Megatron prefix (train, and valid when there is one):
- the .idx starts with Megatron's index header and reads with Megatron's own index reader; its
  sequence pointers are contiguous and its document boundaries in order (a damaged index otherwise
  reads garbage, or only fails on the GPU when a sample lands there);
- the .bin holds exactly the bytes the index accounts for (shorter: truncated; longer: the two
  files come from different writes);
- it holds at least one token;
- `nam56r.training.data.format.check_prefix` opens it with Megatron's IndexedDataset, and no token id reaches the
  model's vocabulary and every document ends in the tokenizer's EOD id.
And the tokenizer (which Megatron's pretrain loads) loads and fits the model's vocabulary.

Cost: the index is read whole (small); the .bin is memory-mapped and scanned once for its largest
token id, in bounded chunks, with progress on stderr when the scan takes more than 2 s (about a
second per few GB from the page cache). Checksums recorded at build time are not recomputed:
hashing reads every byte at a tenth of that speed.

Every failure raises DataCheckError naming the file, what is wrong, and the command that makes it
again: the one recorded in data.json or <prefix>.json when there is one.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nam56r import verbose
from nam56r.training.data.format import PrefixReport, check_prefix
from nam56r.training.data.layout import BUILD_COMMAND, CONVERT_COMMAND, DataDir, DataPaths


class DataCheckError(ValueError):
    """The run's data cannot train this model; the message names the file and the fix."""


@dataclass(frozen=True)
class TokenizerInfo:
    directory: Path
    vocab_size: int
    eod_id: int | None  # None: the tokenizer has no eos_token


@dataclass(frozen=True)
class DataCheck:
    tokenizer: TokenizerInfo
    prefixes: tuple[PrefixReport, ...]
    eod_id: int | None  # the id every document ends in; None: neither the tokenizer nor the data records one

    def summary(self) -> str:
        eod = f"EOD {self.eod_id} ends every document" if self.eod_id is not None else "EOD not checked (none recorded)"
        parts = [f"{r.prefix.name} {r.documents:,} documents, {r.tokens:,} tokens, max id {r.max_id}" for r in self.prefixes]
        return "; ".join(parts) + f"; tokenizer {self.tokenizer.vocab_size:,} tokens; {eod}"


def remake_hint(prefix: Path) -> str:
    """How to make `prefix` again: the command recorded when it was made (<prefix>.json from `convert`,
    data.json from `build`), else the build command data.json describes, else the two commands that make data."""
    try:
        if (own := Path(f"{prefix}.json")).is_file():
            return _again(json.loads(own.read_text()).get("command"))
        built = DataDir(prefix.parent).manifest
        if built.is_file() and prefix.name in (raw := json.loads(built.read_text()))["prefixes"].values():
            return _again(_with_out(raw["command"], prefix.parent) if raw.get("command") else _build_command(prefix.parent, raw))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # an unreadable record: the generic commands below
    return (f"make it again with `{BUILD_COMMAND} --out DIR --force` (the C/C++ corpus) or "
            f"`{CONVERT_COMMAND} FILE... --out {prefix} --force` (your jsonl/parquet)")


def _again(command: str | None) -> str:
    if not command:
        return f"make it again with the `{CONVERT_COMMAND} ... --force` command that made it"
    return f"make it again with `{command}`" + ("" if "--force" in shlex.split(command) else " (add --force to overwrite)")


def _with_out(command: str, directory: Path) -> str:
    """A recorded `build` command writing to `directory`, where the data is now (it may have been moved or copied)."""
    words = shlex.split(command)
    if "--out" in words[:-1]:
        words[words.index("--out") + 1] = str(directory)
    else:
        words += ["--out", str(directory)]
    return shlex.join(words)


def _build_command(directory: Path, raw: dict) -> str:
    """The `build` command a data.json without a recorded command describes."""
    args = ["--out", str(directory), "--vocab-size", str(raw["vocab_size"]["requested"])]
    args += [a for source in raw["sources"] for a in ("--source", source)]
    args += ["--max-docs", str(raw["max_docs"])] if raw.get("max_docs") else []
    args += ["--valid-fraction", str(raw["valid_fraction"])] if "valid_fraction" in raw else []
    return shlex.join([*shlex.split(BUILD_COMMAND), *args, "--force"])


@contextlib.contextmanager
def _outside_a_rank() -> Iterator[None]:
    """Megatron's readers log on rank 0 only, and warn when the process has no rank, as the launcher has none."""
    with warnings.catch_warnings():
        if not verbose():
            warnings.filterwarnings("ignore", message=r"Could not determine rank from torch\.distributed", category=UserWarning)
        yield


def _refuse(path: Path, problem: str, prefix: Path) -> DataCheckError:
    return DataCheckError(f"{path} {problem}; {remake_hint(prefix)}")


def check_index(prefix: Path) -> tuple[int, int]:
    """Read `prefix`.idx with Megatron's index reader and hold the .bin against it. Returns (sequences, tokens)."""
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, _IndexReader

    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise DataCheckError(f"{path} does not exist: pass the prefix (without .bin/.idx) of a dataset that has both files, "
                                 f"or {remake_hint(prefix)}")
    with idx_path.open("rb") as f:
        header = f.read(len(_INDEX_HEADER))
    if header != _INDEX_HEADER:  # checked here too: Megatron's own check is an assert, gone under python -O
        raise _refuse(idx_path, f"does not start with Megatron's index header {_INDEX_HEADER!r} (it starts {header!r}): "
                      "it is not a Megatron .idx, or it is damaged", prefix)
    try:
        with _outside_a_rank():
            index = _IndexReader(str(idx_path), multimodal=False)
        lengths = np.asarray(index.sequence_lengths, dtype=np.int64)
        pointers = np.asarray(index.sequence_pointers, dtype=np.int64)
        documents = np.asarray(index.document_indices, dtype=np.int64)
        item = index.dtype_size
    except Exception as exc:  # Megatron's reader raises AssertionError, struct.error or ValueError on a damaged or cut index
        raise _refuse(idx_path, f"is not a readable Megatron index ({type(exc).__name__}: {exc})", prefix) from None
    if (lengths < 0).any():
        raise _refuse(idx_path, f"is damaged: sequence {int(np.flatnonzero(lengths < 0)[0])} has a negative length", prefix)
    if len(lengths) and (pointers[0] != 0 or (pointers[1:] != pointers[:-1] + lengths[:-1] * item).any()):
        raise _refuse(idx_path, "is damaged: its sequence pointers do not follow its sequence lengths", prefix)
    if not len(documents) or documents[0] != 0 or documents[-1] != len(lengths) or (np.diff(documents) < 0).any():
        raise _refuse(idx_path, f"is damaged: its document boundaries do not cover its {len(lengths)} sequences in order", prefix)
    needed = int(lengths.sum() * item)
    size = bin_path.stat().st_size
    if size < needed:
        raise _refuse(bin_path, f"is truncated: it holds {size:,} bytes but its index {idx_path.name} points at {needed:,}", prefix)
    if size > needed:
        raise _refuse(bin_path, f"holds {size:,} bytes but its index {idx_path.name} accounts for {needed:,}: "
                      "the two files come from different writes", prefix)
    return len(lengths), int(lengths.sum())


def check_prefix_data(prefix: Path, vocab_size: int, eod_id: int | None) -> PrefixReport:
    """One prefix, checked for a model of `vocab_size` whose documents end in `eod_id` (None: not checked)."""
    sequences, tokens = check_index(prefix)
    if tokens == 0:
        raise _refuse(prefix, f"holds no tokens ({sequences} sequences, all empty or none): the corpus is empty", prefix)
    try:
        with _outside_a_rank():
            report = check_prefix(prefix, eod_id if eod_id is not None else -1)
    except Exception as exc:  # what Megatron's IndexedDataset raises on a dataset it cannot open
        raise _refuse(prefix, f"does not open with Megatron's IndexedDataset ({type(exc).__name__}: {exc})", prefix) from None
    bin_path = Path(f"{prefix}.bin")
    if report.max_id >= vocab_size:
        raise DataCheckError(
            f"{bin_path} holds token id {report.max_id}, past the model's vocabulary of {vocab_size}: it was tokenized with a "
            f"larger tokenizer; {remake_hint(prefix)} with a tokenizer of at most {vocab_size} tokens, or pick a model whose "
            f"vocab_size holds it (--model)"
        )
    if eod_id is not None and report.bad_count:
        raise _refuse(
            bin_path, f"has {report.bad_count} of {report.documents} documents not ending in the EOD id {eod_id} "
            f"(e.g. documents {list(report.not_ending_in_eod)}): it was tokenized without EOD or with another tokenizer", prefix
        )
    return report


def load_tokenizer_info(tokenizer_dir: Path) -> TokenizerInfo:
    """The tokenizer's size and EOD as Megatron's pretrain reads them (`nam56r.training.data.format.load_megatron_tokenizer`)."""
    from nam56r.training.data.format import load_megatron_tokenizer

    if not Path(tokenizer_dir).is_dir():
        raise DataCheckError(f"tokenizer directory {tokenizer_dir} does not exist: pass --tokenizer DIR (a HuggingFace tokenizer "
                             f"directory, e.g. the tokenizer/ that `{BUILD_COMMAND}` writes)")
    try:
        tokenizer = load_megatron_tokenizer(tokenizer_dir)
        return TokenizerInfo(Path(tokenizer_dir), int(tokenizer.vocab_size), tokenizer.eod)
    except Exception as exc:
        raise DataCheckError(
            f"{tokenizer_dir} does not load as a HuggingFace tokenizer ({type(exc).__name__}: {exc}): pass the directory "
            f"`{BUILD_COMMAND}` or `save_pretrained` wrote"
        ) from None


def check_data(paths: DataPaths, vocab_size: int) -> DataCheck:
    """Check the tokenizer and every prefix of `paths` for a model of `vocab_size`; raise DataCheckError on the first fault."""
    tokenizer = load_tokenizer_info(paths.tokenizer_dir)
    if tokenizer.vocab_size > vocab_size:
        raise DataCheckError(
            f"the tokenizer in {paths.tokenizer_dir} has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab_size}: "
            f"pass the tokenizer the data was made with, or a model whose vocabulary holds it (--model); "
            f"{remake_hint(paths.train_prefix)} for a built corpus"
        )
    eod_id = tokenizer.eod_id if tokenizer.eod_id is not None else _recorded_eod(paths.train_prefix)
    prefixes = [paths.train_prefix] + ([paths.valid_prefix] if paths.valid_prefix is not None else [])
    return DataCheck(tokenizer, tuple(check_prefix_data(p, vocab_size, eod_id) for p in prefixes), eod_id)


def _recorded_eod(prefix: Path) -> int | None:
    from nam56r.training.data.manifest import eod_id_near

    try:
        return eod_id_near(prefix)
    except (OSError, ValueError):
        return None
