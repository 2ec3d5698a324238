"""Bad data is refused by `python -m nam56r.train` before any GPU work, dry runs included, with a
message naming the file and how to make it again: a truncated or corrupt .bin/.idx, an empty
corpus, token ids or a tokenizer past the model's vocabulary, a --data path that does not exist.

Each fault is planted in a real corpus built by `nam56r.data build` (Megatron's own writer and
IndexedDataset), and the real launcher runs on it."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from nam56r.train import main as train_main

TINY_VOCAB = 512  # the tiny recipe's vocabulary


@pytest.fixture(scope="module")
def built(tmp_path_factory, megatron_built) -> Path:
    from nam56r.data import CorpusConfig, build, torch_include_dir

    out = tmp_path_factory.mktemp("data") / "cpp"
    build(out, TINY_VOCAB, CorpusConfig(sources=(torch_include_dir(),), max_docs=20))
    return out


@pytest.fixture
def data(built: Path, tmp_path: Path) -> Path:
    """A copy of the built corpus that a test may damage."""
    return Path(shutil.copytree(built, tmp_path / "cpp"))


def _dry_run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main(["--recipe", "tiny-1gpu", "--dry-run", *argv])
    return code, out.getvalue(), err.getvalue()


def _refused(data: Path, *extra: str) -> str:
    code, out, err = _dry_run("--data", str(data), *extra)
    assert code == 2, f"not refused (exit {code}):\n{out}\n{err}"
    assert err.startswith("error: bad data: "), err
    return err


def test_good_data_passes_the_check_and_says_what_it_read(data: Path) -> None:
    code, out, err = _dry_run("--data", str(data))
    assert code == 0, err
    assert "data checked: train_text_document " in out and "; valid_text_document " in out


def test_a_truncated_bin_is_refused(data: Path) -> None:
    bin_path = data / "train_text_document.bin"
    size = bin_path.stat().st_size
    with bin_path.open("r+b") as f:
        f.truncate(size - 100)
    err = _refused(data)
    assert f"{bin_path} is truncated: it holds {size - 100:,} bytes but its index points at {size:,}" in err
    assert "python -m nam56r.data build --out DIR --force" in err


@pytest.mark.parametrize("damage", ["magic", "cut"])
def test_a_corrupt_or_cut_index_is_refused(data: Path, damage: str) -> None:
    idx_path = data / "valid_text_document.idx"
    raw = idx_path.read_bytes()
    idx_path.write_bytes(b"NOTANIDX\x00" + raw[9:] if damage == "magic" else raw[:20])
    err = _refused(data)
    assert f"{idx_path} is not a readable Megatron index (" in err and "make it again" in err


def test_an_empty_corpus_is_refused(data: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = data / "train_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    builder.finalize(f"{prefix}.idx")
    err = _refused(data)
    assert f"{prefix} holds no tokens" in err and "the corpus is empty" in err


def test_token_ids_past_the_models_vocabulary_are_refused(data: Path) -> None:
    bin_path = data / "train_text_document.bin"
    ids = np.memmap(bin_path, dtype=np.uint16, mode="r+")
    ids[3] = TINY_VOCAB + 7
    ids.flush()
    err = _refused(data)
    assert f"{bin_path} holds token id {TINY_VOCAB + 7}, past the model's vocabulary of {TINY_VOCAB}" in err


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(data: Path, tmp_path: Path) -> None:
    """A bare prefix with --tokenizer: the tokenizer is loaded as pretrain loads it and measured."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer_dir = data / "tokenizer"
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for i in range(100):  # extra tokens the model's 512-entry embedding cannot hold
        vocab[f"extra_token_{i}"] = len(vocab)
    big = tmp_path / "big-tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|endoftext|>").save_pretrained(big)
    err = _refused(data / "train_text_document", "--tokenizer", str(big))
    assert f"the tokenizer in {big} has {TINY_VOCAB + 100} tokens but the model's vocab_size is {TINY_VOCAB}" in err


def test_a_built_corpus_of_another_vocabulary_is_refused(data: Path) -> None:
    manifest = data / "data.json"
    raw = json.loads(manifest.read_text())
    raw["vocab_size"]["reached"] = 4096
    manifest.write_text(json.dumps(raw))
    code, _, err = _dry_run("--data", str(data))
    assert code == 2 and f"uses a 4096-token vocabulary but the model's vocab_size is {TINY_VOCAB}" in err


def test_a_missing_data_path_is_refused(tmp_path: Path) -> None:
    code, _, err = _dry_run("--data", str(tmp_path / "nowhere"))
    assert code == 2 and f"--data {tmp_path / 'nowhere'} does not exist" in err
