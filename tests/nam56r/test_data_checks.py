"""Bad data is refused by `python -m nam56r.training.launcher` before any GPU work, dry runs included, with exit
status 2 and a message naming the file and the command that makes it again: a truncated, padded or
corrupt .bin/.idx (train or valid), an empty corpus, token ids or a tokenizer past the model's
vocabulary, documents without EOD, a --data path that does not exist. `nam56r.training.data build` over
sources with no usable file fails and leaves an earlier build whole.

Each fault is planted in a real corpus made by `nam56r.training.data build` or `convert` (Megatron's own
writer), and the real launcher runs on it."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

from nam56r.training.data.layout import BUILD_COMMAND, DataDir
from nam56r.training.launcher.train import main as train_main

TINY_VOCAB = 512  # the tiny recipe's vocabulary


@pytest.fixture(scope="module")
def built(tmp_path_factory, megatron_built) -> Path:
    from nam56r.training.data.build import CorpusConfig, build, torch_include_dir

    out = tmp_path_factory.mktemp("data") / "cpp"
    build(out, TINY_VOCAB, CorpusConfig(sources=(torch_include_dir(),), max_docs=20))  # no command recorded
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
    assert "error: bad data: " in err, err
    assert "preflight" not in out and "command:" not in out  # refused before the preflight and the command
    return err


def _rebuild(data: Path) -> str:
    """The fix a refusal names for the built corpus in `data`: the build command its data.json describes, writing to `data`."""
    from nam56r.training.data.build import torch_include_dir

    return (f"make it again with `{BUILD_COMMAND} --out {data} --vocab-size {TINY_VOCAB} --source {torch_include_dir().resolve()} "
            f"--max-docs 20 --valid-fraction 0.02 --force`")


def _pointers(prefix: Path) -> tuple[np.ndarray, np.ndarray]:
    from megatron.core.datasets.indexed_dataset import _IndexReader

    index = _IndexReader(f"{prefix}.idx", multimodal=False)
    return np.array(index.sequence_pointers), np.array(index.sequence_lengths)


def test_good_data_passes_the_check_and_says_what_it_read(data: Path) -> None:
    code, out, err = _dry_run("--data", str(data))
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("data checked: "))
    layout = DataDir(data)
    assert f"{layout.train_prefix.name} " in line and f"; {layout.valid_prefix.name} 1 documents" in line and "max id 511" in line
    assert f"tokenizer {TINY_VOCAB} tokens; EOD 0 ends every document" in line


@pytest.mark.parametrize("split", DataDir.SPLITS)
def test_a_truncated_bin_is_refused(data: Path, split: str) -> None:
    prefix = DataDir(data).prefix(split)
    bin_path = Path(f"{prefix}.bin")
    size = bin_path.stat().st_size
    with bin_path.open("r+b") as f:
        f.truncate(size - 100)
    err = _refused(data)
    assert f"{bin_path} is truncated: it holds {size - 100:,} bytes but its index {prefix.name}.idx points at {size:,}" in err
    assert _rebuild(data) in err


def test_a_bin_longer_than_its_index_is_refused(data: Path) -> None:
    prefix = DataDir(data).train_prefix
    bin_path = Path(f"{prefix}.bin")
    size = bin_path.stat().st_size
    with bin_path.open("ab") as f:
        f.write(b"\0" * 64)
    err = _refused(data)
    assert f"{bin_path} holds {size + 64:,} bytes but its index {prefix.name}.idx accounts for {size:,}: the two files come from" in err
    assert _rebuild(data) in err


@pytest.mark.parametrize("split", DataDir.SPLITS)
def test_an_index_with_another_header_is_refused(data: Path, split: str) -> None:
    idx_path = Path(f"{DataDir(data).prefix(split)}.idx")
    raw = idx_path.read_bytes()
    idx_path.write_bytes(b"NOTANIDX\x00" + raw[9:])
    err = _refused(data)
    assert f"{idx_path} does not start with Megatron's index header b'MMIDIDX\\x00\\x00' (it starts b'NOTANIDX\\x00')" in err
    assert _rebuild(data) in err


@pytest.mark.parametrize("keep", [20, -8], ids=["in-the-header", "in-the-arrays"])
def test_a_cut_index_is_refused(data: Path, keep: int) -> None:
    idx_path = Path(f"{DataDir(data).valid_prefix}.idx")
    raw = idx_path.read_bytes()
    idx_path.write_bytes(raw[:keep])
    err = _refused(data)
    assert f"{idx_path} is not a readable Megatron index (" in err  # what Megatron's reader raised, translated
    assert _rebuild(data) in err


def test_an_index_whose_pointers_do_not_follow_its_lengths_is_refused(data: Path) -> None:
    prefix = DataDir(data).train_prefix
    pointers, _ = _pointers(prefix)
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    at = raw.find(pointers.tobytes())  # the int64 pointer array, written whole by Megatron's writer
    raw[at + 8 : at + 16] = np.int64(pointers[1] + 2).tobytes()
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    err = _refused(data)
    assert f"{prefix}.idx is damaged: its sequence pointers do not follow its sequence lengths" in err


@pytest.mark.parametrize("documents", [[], [[]]], ids=["no-documents", "empty-documents"])
def test_an_empty_corpus_is_refused(data: Path, documents: list) -> None:
    from nam56r.training.data.format import write_indexed_dataset

    prefix = DataDir(data).train_prefix
    write_indexed_dataset(prefix, documents, np.uint16)
    err = _refused(data)
    assert f"{prefix} holds no tokens ({len(documents)} sequences, all empty or none): the corpus is empty" in err
    assert _rebuild(data) in err


def test_token_ids_past_the_models_vocabulary_are_refused(data: Path) -> None:
    bin_path = Path(f"{DataDir(data).train_prefix}.bin")
    ids = np.memmap(bin_path, dtype=np.uint16, mode="r+")
    ids[3] = TINY_VOCAB + 7
    ids.flush()
    err = _refused(data)
    assert f"{bin_path} holds token id {TINY_VOCAB + 7}, past the model's vocabulary of {TINY_VOCAB}" in err
    assert _rebuild(data).removesuffix("`") in err


def test_documents_without_eod_are_refused(data: Path) -> None:
    prefix = DataDir(data).valid_prefix
    pointers, lengths = _pointers(prefix)
    ids = np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r+")
    ids[pointers[0] // 2 + lengths[0] - 1] = 5  # the last token of document 0, its EOD
    ids.flush()
    err = _refused(data)
    assert f"{prefix}.bin has 1 of 1 documents not ending in the EOD id 0 (e.g. documents [0])" in err


def _bigger_tokenizer(tokenizer_dir: Path, out: Path, extra: int) -> Path:
    """`tokenizer_dir` with `extra` more tokens, saved as HuggingFace saves it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for i in range(extra):
        vocab[f"extra_token_{i}"] = len(vocab)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|endoftext|>").save_pretrained(out)
    return out


def test_a_tokenizer_larger_than_the_model_is_refused_beside_a_bare_prefix(data: Path, tmp_path: Path) -> None:
    """A bare prefix with --tokenizer: the tokenizer is loaded as pretrain loads it and measured."""
    big = _bigger_tokenizer(DataDir(data).tokenizer_dir, tmp_path / "big-tokenizer", 100)
    err = _refused(DataDir(data).train_prefix, "--tokenizer", str(big))
    assert f"the tokenizer in {big} has {TINY_VOCAB + 100} tokens but the model's vocab_size is {TINY_VOCAB}" in err
    assert "pass the tokenizer the data was made with" in err


def test_a_built_corpus_whose_tokenizer_was_replaced_is_refused(data: Path, tmp_path: Path) -> None:
    """data.json still says 512; the tokenizer directory it names now holds 612 tokens."""
    big = _bigger_tokenizer(DataDir(data).tokenizer_dir, tmp_path / "big-tokenizer", 100)
    shutil.rmtree(DataDir(data).tokenizer_dir)
    shutil.copytree(big, DataDir(data).tokenizer_dir)
    err = _refused(data)
    assert f"the tokenizer in {DataDir(data).tokenizer_dir} has {TINY_VOCAB + 100} tokens but the model's vocab_size is {TINY_VOCAB}" in err
    assert _rebuild(data) in err


def test_a_built_corpus_of_another_vocabulary_is_refused(data: Path) -> None:
    manifest = DataDir(data).manifest
    raw = json.loads(manifest.read_text())
    raw["vocab_size"]["reached"] = 4096
    manifest.write_text(json.dumps(raw))
    code, _, err = _dry_run("--data", str(data))
    assert code == 2 and f"uses a 4096-token vocabulary but the model's vocab_size is {TINY_VOCAB}: rebuild it with `" in err


def test_a_converted_prefix_names_the_command_that_made_it(data: Path, tmp_path: Path) -> None:
    """`nam56r.training.data convert` records its command in <prefix>.json; a damaged prefix (here the valid one) names it."""
    from nam56r.training.data.cli import main as data_main

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"int f{i}(void) {{ return {i}; }}\n" * 20}) + "\n" for i in range(40)))
    prefix = tmp_path / "mine" / "train"
    argv = ["convert", str(rows), "--text-key", "text", "--tokenizer", str(DataDir(data).tokenizer_dir), "--out", str(prefix),
            "--valid-fraction", "0.2"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert data_main(argv) == 0
    valid = Path(f"{prefix}_valid")
    code, out, err = _dry_run("--data", str(prefix), "--valid-data", str(valid), "--tokenizer", str(DataDir(data).tokenizer_dir))
    assert code == 0, err
    with open(f"{valid}.bin", "r+b") as f:
        f.truncate(10)
    err = _refused(prefix, "--valid-data", str(valid), "--tokenizer", str(DataDir(data).tokenizer_dir))
    assert f"{valid}.bin is truncated" in err
    assert f"make it again with `{shlex.join(['python', '-m', 'nam56r.training.data', *argv])}` (add --force to overwrite)" in err


@pytest.mark.parametrize("name", ["nowhere", "nowhere/"])
def test_a_missing_data_path_is_refused(tmp_path: Path, name: str) -> None:
    code, _, err = _dry_run("--data", f"{tmp_path}/{name}")
    assert code == 2 and f"--data {tmp_path / 'nowhere'} does not exist: give a data directory with data.json" in err


def test_a_directory_without_data_json_names_its_prefixes(data: Path) -> None:
    DataDir(data).manifest.unlink()
    code, _, err = _dry_run("--data", str(data))
    assert code == 2 and f"no training data in {data} (data.json is missing)" in err
    assert f"pass one of its prefixes as --data, with --tokenizer: {DataDir(data).train_prefix}, {DataDir(data).valid_prefix}" in err


def test_tokenizer_or_valid_data_beside_a_data_directory_is_refused(data: Path) -> None:
    code, _, err = _dry_run("--data", str(data), "--tokenizer", str(DataDir(data).tokenizer_dir))
    assert code == 2 and f"--data {data} is a data directory, which names its own tokenizer and valid split" in err
    assert "drop --tokenizer" in err


@pytest.mark.parametrize("files", [{}, {"empty.h": b"", "latin1.h": b"caf\xe9\n"}], ids=["no-files", "only-unusable-files"])
def test_build_over_sources_with_no_usable_file_fails_and_keeps_the_earlier_build(data: Path, tmp_path: Path, files: dict) -> None:
    from nam56r.training.data.cli import main as data_main

    source = tmp_path / "src"
    source.mkdir()
    for name, content in files.items():
        (source / name).write_bytes(content)
    before = DataDir(data).manifest.read_text()
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()):
        data_main(["build", "--source", str(source), "--out", str(data), "--vocab-size", str(TINY_VOCAB), "--force"])
    message = str(exc.value)
    assert message.startswith(f"error: no usable source files under {source} (")
    assert ("2 files with those suffixes, all skipped: {'empty': 1, 'not UTF-8': 1}" if files else "no such files") in message
    assert DataDir(data).manifest.read_text() == before  # the earlier build is still whole


def test_a_copied_corpus_names_its_recorded_build_command_writing_where_it_is_now(built: Path, data: Path) -> None:
    """data.json records the command that built it (`--out` the original directory); the fix rebuilds the copy read."""
    manifest = DataDir(data).manifest
    raw = json.loads(manifest.read_text())
    raw["command"] = shlex.join(["python", "-m", "nam56r.training.data", "build", "--vocab-size", str(TINY_VOCAB), "--out", str(built)])
    manifest.write_text(json.dumps(raw))
    with open(f"{DataDir(data).train_prefix}.bin", "r+b") as f:
        f.truncate(0)
    err = _refused(data)
    rebuild = f"python -m nam56r.training.data build --vocab-size {TINY_VOCAB} --out {data}"
    assert f"make it again with `{rebuild}` (add --force to overwrite)" in err
