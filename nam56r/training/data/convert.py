"""Convert your own data (jsonl or parquet) to a Megatron indexed dataset.

    # text, tokenized with an existing HuggingFace tokenizer directory (EOD: its eos_token)
    python -m nam56r.training.data convert 'shards/*.jsonl' --text-key text --tokenizer data/cpp-headers/tokenizer \\
        --out data/mine/train_text_document --valid-fraction 0.01
    # rows already tokenized
    python -m nam56r.training.data convert part-0.parquet --ids-key input_ids --eod-id 0 --vocab-size 32768 --out data/mine/ids

Each row is one document, followed by EOD (for `--ids-key` rows, unless the row already ends in
it). Text is encoded without the tokenizer's own BOS/EOS, and text that spells a special token is
encoded as text, so EOD appears only at document ends. Rows are numbered from 1 (in jsonl the row
number is the line number); a missing key, a value of the wrong type or an id outside the
vocabulary stops the conversion with the file and row. Empty rows are skipped and counted.

With `--valid-fraction F`, a row goes to the valid prefix (`--valid-out`, default `<PREFIX>_valid`)
when a sha256 of its content falls below F: stable across runs and file orders, and duplicate rows
never straddle the split. `<PREFIX>.json` records counts, checksums and the command; `python -m
nam56r.training.data check PREFIX` reads the EOD id from it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import shlex
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from nam56r_patchlane.artifacts import sha256_file

from nam56r.training.data.format import split_score, token_dtype

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
BATCH_ROWS = 512  # rows per encode_batch call


class RowError(ValueError):
    """A row that cannot be converted; the message names the file and row."""


@dataclass(frozen=True)
class ConvertConfig:
    inputs: tuple[Path, ...]
    out: Path  # Megatron prefix (no .bin/.idx)
    text_key: str | None = None  # exactly one of text_key / ids_key
    ids_key: str | None = None
    tokenizer_dir: Path | None = None  # needed for text; for ids, gives EOD and the vocabulary size
    eod_id: int | None = None
    vocab_size: int | None = None  # for ids without a tokenizer
    valid_fraction: float = 0.0  # 0: no valid prefix
    valid_out: Path | None = None
    force: bool = False

    def validate(self) -> ConvertConfig:
        if (self.text_key is None) == (self.ids_key is None):
            raise ValueError("pass exactly one of --text-key KEY (text to tokenize) or --ids-key KEY (token ids)")
        if self.text_key is not None and self.tokenizer_dir is None:
            raise ValueError(f"--text-key {self.text_key} needs --tokenizer DIR (a HuggingFace tokenizer directory)")
        if self.ids_key is not None and self.tokenizer_dir is None and (self.eod_id is None or self.vocab_size is None):
            raise ValueError(
                f"--ids-key {self.ids_key} without --tokenizer needs --eod-id N and --vocab-size N (to end documents and check ids)"
            )
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ValueError(f"--valid-fraction {self.valid_fraction} must be in [0, 1)")
        if not self.inputs:
            raise ValueError("no input files")
        return self

    @property
    def valid_prefix(self) -> Path | None:
        if self.valid_fraction == 0.0:
            return None
        return self.valid_out or Path(f"{self.out}_valid")


def expand_inputs(patterns: Sequence[str]) -> tuple[Path, ...]:
    """Files named or matched by each pattern, in the order given (each glob sorted)."""
    paths: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise ValueError(f"{pattern!r} matches no file")
            paths += map(Path, matches)
        elif not Path(pattern).is_file():
            raise ValueError(f"input {pattern} is not a file")
        else:
            paths.append(Path(pattern))
    return tuple(paths)


def iter_rows(path: Path, key: str) -> Iterator[tuple[int, Any]]:
    """(row number from 1, value of `key`) for each row of a jsonl or parquet file."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        yield from _parquet_rows(path, key)
    elif name.endswith(JSONL_SUFFIXES):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RowError(f"{path} row {line_no}: not JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(row, dict) or key not in row:
                    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise RowError(f"{path} row {line_no}: no key {key!r} (has {keys}): pass the right --text-key/--ids-key")
                yield line_no, row[key]
    else:
        raise ValueError(f"{path}: unknown format; expected a name ending in {', '.join(JSONL_SUFFIXES)} or .parquet")


def _parquet_rows(path: Path, key: str) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"reading {path} needs pyarrow: pip install pyarrow") from None
    parquet = pq.ParquetFile(path)
    if key not in parquet.schema_arrow.names:
        raise RowError(f"{path} row 1: no column {key!r} (has {parquet.schema_arrow.names}): pass the right --text-key/--ids-key")
    row_no = 0
    for batch in parquet.iter_batches(columns=[key], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row_no += 1
            yield row_no, value


def _load_tokenizer(directory: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise ValueError(f"--tokenizer {directory} is not a HuggingFace tokenizer directory AutoTokenizer can load: {exc}") from None
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise ValueError(f"--tokenizer {directory} has no fast tokenizer (tokenizer.json): convert it with transformers first")
    return tokenizer


def _batched(rows: Iterator[tuple[int, str]], size: int) -> Iterator[list[tuple[int, str]]]:
    batch: list[tuple[int, str]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _text_documents(config: ConvertConfig, tokenizer: Any, stats: dict) -> Iterator[tuple[Path, int, str | bytes, list[int]]]:
    """(file, row, content, ids) per non-empty text row, encoded in batches."""
    backend = tokenizer.backend_tokenizer
    backend.encode_special_tokens = True  # text spelling "<|endoftext|>" stays text
    for path in config.inputs:
        for batch in _batched(_texts(path, config.text_key, stats), BATCH_ROWS):
            encoded = backend.encode_batch([text for _, text in batch], add_special_tokens=False)
            for (row_no, text), enc in zip(batch, encoded, strict=True):
                yield path, row_no, text, enc.ids


def _texts(path: Path, key: str, stats: dict) -> Iterator[tuple[int, str]]:
    for row_no, value in iter_rows(path, key):
        if not isinstance(value, str):
            raise RowError(f"{path} row {row_no}: {key!r} is {type(value).__name__}, expected a string")
        if value:
            yield row_no, value
        else:
            stats["skipped_empty"] += 1


def _ids_documents(config: ConvertConfig, stats: dict) -> Iterator[tuple[Path, int, str | bytes, np.ndarray]]:
    """(file, row, content, ids) per non-empty ids row."""
    for path in config.inputs:
        for row_no, value in iter_rows(path, config.ids_key):
            ids = np.asarray(value if value is not None else [])
            if value is None or ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise RowError(f"{path} row {row_no}: {config.ids_key!r} is {value!r:.60}, expected a list of integer token ids")
            if not ids.size:
                stats["skipped_empty"] += 1
                continue
            ids = ids.astype(np.int64)
            yield path, row_no, ids.tobytes(), ids


def convert(config: ConvertConfig, command: Sequence[str] | None = None) -> dict:
    """Write `config.out` (and the valid prefix) from the input rows; return the recorded manifest."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    config = config.validate()
    prefixes = {"train": config.out} | ({"valid": config.valid_prefix} if config.valid_prefix else {})
    outputs = [Path(f"{p}{s}") for p in prefixes.values() for s in (".bin", ".idx", ".json")]
    if not config.force and (existing := [str(p) for p in outputs if p.exists()]):
        raise FileExistsError(f"{', '.join(existing)} already exist: pass --force to overwrite them, or another --out")
    tokenizer = _load_tokenizer(config.tokenizer_dir) if config.tokenizer_dir else None
    vocab_size = config.vocab_size if config.vocab_size is not None else len(tokenizer)
    eod_id = config.eod_id if config.eod_id is not None else tokenizer.eos_token_id
    if eod_id is None:
        raise ValueError(f"the tokenizer in {config.tokenizer_dir} has no eos_token: pass --eod-id N")
    if not 0 <= eod_id < vocab_size:
        raise ValueError(f"EOD id {eod_id} is outside the vocabulary [0, {vocab_size})")
    dtype = token_dtype(vocab_size)
    for prefix in prefixes.values():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{prefix}.json").unlink(missing_ok=True)  # written last: a prefix without it is an unfinished conversion
    builders = {split: IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype) for split, prefix in prefixes.items()}

    stats = {"skipped_empty": 0, "already_ending_in_eod": 0}
    counts = {split: {"documents": 0, "tokens": 0} for split in prefixes}
    rows = _text_documents(config, tokenizer, stats) if config.text_key else _ids_documents(config, stats)
    started = last = time.monotonic()
    try:
        for done, (path, row_no, content, ids) in enumerate(rows, start=1):
            ids = np.asarray(ids, dtype=np.int64)
            if bad := np.flatnonzero((ids < 0) | (ids >= vocab_size)).tolist():
                raise RowError(f"{path} row {row_no}: token id {int(ids[bad[0]])} is outside the vocabulary [0, {vocab_size})")
            if ids[-1] == eod_id:
                stats["already_ending_in_eod"] += 1
            else:
                ids = np.append(ids, eod_id)
            split = "valid" if "valid" in prefixes and split_score(content) < config.valid_fraction else "train"
            builders[split].add_document(ids.astype(dtype), [len(ids)])
            counts[split]["documents"] += 1
            counts[split]["tokens"] += len(ids)
            if time.monotonic() - last >= 2.0:
                last = time.monotonic()
                print(f"  {done} rows converted, now in {path} ({last - started:.1f}s)", file=sys.stderr, flush=True)
    except BaseException:
        # A half-written prefix would block the rerun behind --force: remove what this run wrote.
        for split, prefix in prefixes.items():
            builders[split].data_file.close()
            Path(f"{prefix}.bin").unlink(missing_ok=True)
            Path(f"{prefix}.idx").unlink(missing_ok=True)
        raise
    for split, prefix in prefixes.items():
        builders[split].finalize(f"{prefix}.idx")
    if "valid" in counts and counts["valid"]["documents"] == 0:
        print(f"warning: no row fell in the valid split (fraction {config.valid_fraction}): raise --valid-fraction", file=sys.stderr)

    manifest = {
        "format": 1,
        "inputs": [str(p) for p in config.inputs],
        "key": {"text": config.text_key} if config.text_key else {"ids": config.ids_key},
        "tokenizer_dir": str(config.tokenizer_dir.resolve()) if config.tokenizer_dir else None,
        "vocab_size": vocab_size,
        "eod_id": eod_id,
        "dtype": np.dtype(dtype).name,
        "prefixes": {split: str(p) for split, p in prefixes.items()},
        "valid_fraction": config.valid_fraction,
        "split_rule": "valid if sha256(row content)[:8] / 2**64 < valid_fraction (text: UTF-8; ids: int64 bytes)",
        "documents": {split: c["documents"] for split, c in counts.items()},
        "tokens": {split: c["tokens"] for split, c in counts.items()},
        **stats,
        "sha256": {f"{p}{s}": sha256_file(Path(f"{p}{s}")) for p in prefixes.values() for s in (".bin", ".idx")},
        "command": shlex.join(command) if command else None,
        "seconds": round(time.monotonic() - started, 1),
    }
    for prefix in prefixes.values():
        Path(f"{prefix}.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nam56r.training.data convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="jsonl (.jsonl/.json, or .gz) or parquet files, or (quoted) globs")
    parser.add_argument("--out", type=Path, required=True, metavar="PREFIX", help="output prefix: writes PREFIX.bin/.idx/.json")
    keys = parser.add_mutually_exclusive_group(required=True)
    keys.add_argument("--text-key", metavar="KEY", help="field holding the text to tokenize (needs --tokenizer)")
    keys.add_argument("--ids-key", metavar="KEY", help="field holding already tokenized ids (a list of ints)")
    parser.add_argument("--tokenizer", type=Path, metavar="DIR", help="HuggingFace tokenizer directory; its eos_token is the EOD")
    parser.add_argument("--eod-id", type=int, metavar="N",
                        help="EOD id (overrides the tokenizer's eos_token; needed for --ids-key without --tokenizer)")
    parser.add_argument("--vocab-size", type=int, metavar="N",
                        help="vocabulary size for --ids-key without --tokenizer (ids must be below it)")
    parser.add_argument("--valid-fraction", type=float, default=0.0, metavar="F",
                        help="also write this share of rows (by content hash) to --valid-out")
    parser.add_argument("--valid-out", type=Path, metavar="PREFIX", help="valid prefix (default: <PREFIX>_valid)")
    parser.add_argument("--force", action="store_true", help="overwrite existing PREFIX.bin/.idx/.json")
    args = parser.parse_args(argv)
    try:
        config = ConvertConfig(
            inputs=expand_inputs(args.inputs), out=args.out, text_key=args.text_key, ids_key=args.ids_key,
            tokenizer_dir=args.tokenizer, eod_id=args.eod_id, vocab_size=args.vocab_size,
            valid_fraction=args.valid_fraction, valid_out=args.valid_out, force=args.force,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Megatron's import-time notices about missing TE/Apex
            manifest = convert(config, command=["python", "-m", "nam56r.training.data", "convert", *argv])
    except (FileExistsError, ValueError) as exc:  # RowError is a ValueError
        raise SystemExit(f"error: {exc}") from None
    for split, prefix in manifest["prefixes"].items():
        print(f"{split}: {manifest['documents'][split]} documents, {manifest['tokens'][split]} tokens -> {prefix}.bin/.idx")
    print(f"EOD {manifest['eod_id']}, vocab {manifest['vocab_size']}, {manifest['dtype']}; skipped {manifest['skipped_empty']} empty rows")
    return 0
