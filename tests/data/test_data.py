"""The default data pipeline (`python -m nam56r.training.data build/check`) and the converter for users' data,
read back through Megatron's own IndexedDataset, tokenizer and GPTDataset. CPU only; builds a
60-header, 512-token subset of the default corpus."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from nam56r_patchlane.artifacts import sha256_file

from nam56r.training.data.build import EOD_TOKEN, CorpusConfig, build, torch_include_dir
from nam56r.training.data.cli import main
from nam56r.training.data.convert import ConvertConfig, RowError, convert
from nam56r.training.data.format import check_prefix, write_indexed_dataset
from nam56r.training.data.layout import DataDir
from nam56r.training.data.manifest import read_data_manifest

ROOT = Path(__file__).resolve().parents[2]
MAX_DOCS, VOCAB = 60, 512

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|absl).*")


@pytest.fixture(scope="session", autouse=True)
def megatron_built() -> None:
    if not (ROOT / "third_party" / "megatron-lm" / ".git").exists():
        pytest.skip("third_party/megatron-lm is not materialized: run `nox -s build`")


def subset_config(max_docs: int = MAX_DOCS) -> CorpusConfig:
    return CorpusConfig(sources=(torch_include_dir(),), max_docs=max_docs)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cpp-headers")
    build(out, VOCAB, subset_config(), command=["python", "-m", "nam56r.training.data", "build", "--max-docs", str(MAX_DOCS)])
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(built: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DataDir(built).tokenizer_dir))


def documents(prefix: Path) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [np.array(dataset[i]) for i in range(len(dataset))]


def expected_split(max_docs: int = MAX_DOCS, valid_fraction: float = 0.02) -> tuple[list[Path], list[Path]]:
    """The first readable headers in sorted order, split by the documented rule (recomputed here)."""
    root = torch_include_dir()
    files = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in {".h", ".hpp", ".cuh"} and p.is_file()):
        try:
            if path.read_bytes().decode("utf-8"):
                files.append(path)
        except UnicodeDecodeError:
            continue
        if len(files) == max_docs:
            break
    score = {p: int.from_bytes(hashlib.sha256(p.relative_to(root).as_posix().encode()).digest()[:8], "big") / 2**64 for p in files}
    valid = [p for p in files if score[p] < valid_fraction] or [min(files, key=score.__getitem__)]
    return [p for p in files if p not in valid], valid


def test_documents_end_in_eod_decode_to_their_files_and_follow_the_split(built: Path, hf_tokenizer) -> None:
    eod = hf_tokenizer.convert_tokens_to_ids(EOD_TOKEN)
    train_files, valid_files = expected_split()
    assert valid_files and not set(train_files) & set(valid_files)
    for split, files in (("train", train_files), ("valid", valid_files)):
        docs = documents(DataDir(built).prefix(split))
        assert len(docs) == len(files)
        for doc, path in zip(docs, files, strict=True):
            assert doc[-1] == eod and eod not in doc[:-1].tolist()
            assert hf_tokenizer.decode(doc[:-1].tolist()) == path.read_text(encoding="utf-8"), path


def test_manifest_records_counts_checksums_and_tokenizer(built: Path, hf_tokenizer) -> None:
    raw = json.loads(DataDir(built).manifest.read_text())
    train_files, valid_files = expected_split()
    assert raw["documents"] == {"train": len(train_files), "valid": len(valid_files)}
    for split in ("train", "valid"):
        assert raw["tokens"][split] == sum(len(d) for d in documents(DataDir(built).prefix(split)))
    assert raw["valid_documents"] == [p.relative_to(torch_include_dir()).as_posix() for p in valid_files]
    assert raw["vocab_size"] == {"requested": VOCAB, "reached": len(hf_tokenizer)} and len(hf_tokenizer) == VOCAB
    assert raw["eod_id"] == hf_tokenizer.eos_token_id == hf_tokenizer.convert_tokens_to_ids(EOD_TOKEN)
    assert raw["dtype"] == "uint16"
    assert raw["sources"] == [str(torch_include_dir())] and raw["max_docs"] == MAX_DOCS
    assert raw["command"] == f"python -m nam56r.training.data build --max-docs {MAX_DOCS}"
    assert raw["sha256"] == {name: sha256_file(built / name) for name in raw["sha256"]} and len(raw["sha256"]) == 4

    manifest = read_data_manifest(built)
    layout = DataDir(built)
    assert layout.tokenizer_dir.is_dir()
    assert all(Path(f"{layout.prefix(split)}{suffix}").is_file() for split in DataDir.SPLITS for suffix in (".bin", ".idx"))
    assert manifest.train_prefix == layout.train_prefix and manifest.valid_prefix == layout.valid_prefix
    assert (manifest.tokenizer_dir, manifest.vocab_size, manifest.eod_id) == (layout.tokenizer_dir, VOCAB, raw["eod_id"])
    manifest.check_vocab(VOCAB)
    with pytest.raises(ValueError, match=r"512-token vocabulary but the model's vocab_size is 256.*--vocab-size 256"):
        manifest.check_vocab(256)


def test_rebuild_is_identical_and_refused_without_force(built: Path, tmp_path: Path) -> None:
    build(tmp_path, VOCAB, subset_config())
    first, second = (json.loads(DataDir(d).manifest.read_text()) for d in (built, tmp_path))
    assert second["sha256"] == first["sha256"] and second["valid_documents"] == first["valid_documents"]
    tokenizers = (DataDir(d).tokenizer_dir / "tokenizer.json" for d in (tmp_path, built))
    assert next(tokenizers).read_bytes() == next(tokenizers).read_bytes()

    with pytest.raises(FileExistsError, match=r"not empty: pass --force"):
        build(tmp_path, VOCAB, subset_config())
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    build(tmp_path, VOCAB, subset_config(max_docs=MAX_DOCS + 20), force=True)
    assert notes.read_text() == "mine"
    grown = json.loads(DataDir(tmp_path).manifest.read_text())
    assert sum(grown["documents"].values()) == MAX_DOCS + 20
    root = torch_include_dir()
    assert grown["valid_documents"] == [p.relative_to(root).as_posix() for p in expected_split(MAX_DOCS + 20)[1]]


def test_missing_data_names_the_build_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=rf"no training data in {tmp_path}.*python -m nam56r.training.data build --out {tmp_path}"):
        read_data_manifest(tmp_path)


def test_megatron_builds_the_tokenizer_from_its_args(built: Path, hf_tokenizer) -> None:
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    # The attributes Megatron 0.19's build_tokenizer reads for tokenizer_type HuggingFaceTokenizer.
    args = SimpleNamespace(
        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(DataDir(built).tokenizer_dir), metadata_path=None, chat_template=None,
        vocab_file=None, merge_file=None, special_tokens=None, tokenizer_hf_no_use_fast=False, trust_remote_code=False,
        tokenizer_hf_no_include_special_tokens=False, pad_vocab_size=False,
    )
    tokenizer = build_tokenizer(args)
    manifest = read_data_manifest(built)
    assert tokenizer.eod == manifest.eod_id and tokenizer.vocab_size == manifest.vocab_size
    path = expected_split()[0][0]
    text = path.read_text(encoding="utf-8")
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text
    assert np.array_equal(np.append(ids, tokenizer.eod), documents(manifest.train_prefix)[0])


def test_gpt_dataset_draws_sequences_from_the_train_prefix(built: Path, tmp_path: Path) -> None:
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from nam56r.training.data.format import load_megatron_tokenizer

    manifest, seq = read_data_manifest(built), 64
    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=seq, tokenizer=load_megatron_tokenizer(manifest.tokenizer_dir),
        blend_per_split=[([str(manifest.train_prefix)], None), ([str(manifest.valid_prefix)], None), None],
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"),
    )
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [200, 8, None], lambda: True, config).build()
    assert isinstance(train, GPTDataset) and len(train) >= 200 and len(valid) >= 8 and test is None
    stream = np.concatenate([documents(manifest.train_prefix)[i] for i in train.document_index]).astype(np.int64).tobytes()
    for i in (0, 1, len(train) - 1):
        sample = train[i]
        assert sample["tokens"].shape == sample["labels"].shape == (seq,)
        assert np.array_equal(sample["tokens"][1:], sample["labels"][:-1])
        window = np.append(sample["tokens"].numpy(), sample["labels"][-1].item()).astype(np.int64).tobytes()  # seq + 1 tokens
        assert stream.find(window) % 8 == 0, f"sample {i} is not a contiguous run of the train documents"


def test_extra_sources_skips_and_unreached_vocab_are_reported(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    texts = {
        "a.cpp": "int main() { return 0; }\n",
        "sub/b.h": "#pragma once\n// " + EOD_TOKEN + " is text here\nstruct B { int x; };\n",
        "sub/c.cu": "__global__ void k(float* y) { y[threadIdx.x] = 1.0f; }\n\t\u00e9\n",
    }
    for name, text in texts.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "empty.hpp").write_text("")
    (src / "latin1.c").write_bytes(b"/* caf\xe9 */\n")
    (src / "notes.txt").write_text("not a C/C++ file")
    out = tmp_path / "out"
    manifest = build(out, 5000, CorpusConfig(sources=(src,), valid_fraction=0.3))

    skipped = {(Path(s["path"]).name, s["reason"]) for s in manifest["skipped"]}
    assert skipped == {("empty.hpp", "empty"), ("latin1.c", "not UTF-8 (byte 6)")}
    assert manifest["skipped_by_reason"] == {"empty": 1, "not UTF-8": 1}
    reached = manifest["vocab_size"]["reached"]
    assert manifest["vocab_size"]["requested"] == 5000 and 257 < reached < 5000  # reported, never padded
    assert read_data_manifest(out).vocab_size == reached
    from nam56r.training.data.format import load_megatron_tokenizer

    assert load_megatron_tokenizer(DataDir(out).tokenizer_dir).vocab_size == reached
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DataDir(out).tokenizer_dir))
    decoded = {}
    for split in ("train", "valid"):
        for doc in documents(DataDir(out).prefix(split)):
            assert doc[-1] == manifest["eod_id"] and manifest["eod_id"] not in doc[:-1].tolist()  # "<|endoftext|>" in text stays text
            decoded[tokenizer.decode(doc[:-1].tolist())] = split
    assert set(decoded) == set(texts.values())
    assert sorted(manifest["valid_documents"]) == sorted(k for k, t in texts.items() if decoded[t] == "valid")


def test_check_command_counts_and_fails_on_a_document_without_eod(built: Path, tmp_path: Path, capsys) -> None:
    assert main(["check", str(DataDir(built).train_prefix), str(DataDir(built).valid_prefix)]) == 0
    out = capsys.readouterr().out
    raw = json.loads(DataDir(built).manifest.read_text())
    assert f"{raw['documents']['train']} documents, {raw['tokens']['train']} tokens" in out and out.count(": ok") == 2

    bad = tmp_path / "bad"
    write_indexed_dataset(bad, [[5, 6, 0], [7, 8], [9, 0]], np.uint16)
    report = check_prefix(bad, eod_id=0)
    assert (report.documents, report.tokens, report.not_ending_in_eod, report.max_id) == (3, 7, (1,), 9)
    assert main(["check", str(bad), "--eod-id", "0"]) == 1
    assert "FAIL: 1 documents do not end in EOD 0" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="pass --eod-id"):
        main(["check", str(bad)])


def test_build_help_explains_every_option(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--out", "--vocab-size", "--max-docs", "--source", "--valid-fraction", "--force", "--torch-headers",
                   "--cache", "--offline", "pinned-v<VOCAB>"):
        assert option in text


# --- the converter for users' data --------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


TEXTS = ["int a = 1;\n", "// " + EOD_TOKEN + " spelled out\n", "", "template <typename T> T f(T x) { return x; }\n", "caf\u00e9 \u2603"]


def test_convert_jsonl_text_round_trips(built: Path, hf_tokenizer, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    manifest = convert(ConvertConfig(inputs=(src,), out=tmp_path / "mine", text_key="text", tokenizer_dir=DataDir(built).tokenizer_dir))
    docs = documents(tmp_path / "mine")
    eod = hf_tokenizer.eos_token_id
    assert [hf_tokenizer.decode(d[:-1].tolist()) for d in docs] == [t for t in TEXTS if t]
    assert all(d[-1] == eod and eod not in d[:-1].tolist() for d in docs)
    assert manifest["skipped_empty"] == 1 and manifest["documents"] == {"train": 4} and manifest["eod_id"] == eod
    assert check_prefix(tmp_path / "mine", eod).bad_count == 0
    with pytest.raises(FileExistsError, match=r"mine\.bin.*pass --force"):
        convert(ConvertConfig(inputs=(src,), out=tmp_path / "mine", text_key="text", tokenizer_dir=DataDir(built).tokenizer_dir))


def test_convert_parquet_text_round_trips_and_splits_by_content(built: Path, hf_tokenizer, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"int v{i} = {i};\n" for i in range(200)]
    pq.write_table(pa.table({"content": texts}), tmp_path / "in.parquet", row_group_size=64)
    config = ConvertConfig(
        inputs=(tmp_path / "in.parquet",), out=tmp_path / "p", text_key="content", tokenizer_dir=DataDir(built).tokenizer_dir,
        valid_fraction=0.2,
    )
    manifest = convert(config)
    decoded = {split: [hf_tokenizer.decode(d[:-1].tolist()) for d in documents(Path(p))] for split, p in manifest["prefixes"].items()}
    assert manifest["prefixes"]["valid"] == str(tmp_path / "p_valid")
    assert sorted(decoded["train"] + decoded["valid"]) == sorted(texts) and 10 < len(decoded["valid"]) < 70
    again = convert(replace(config, out=tmp_path / "q", valid_out=tmp_path / "q_valid"))
    assert again["documents"] == manifest["documents"]
    assert sha256_file(tmp_path / "q_valid.bin") == sha256_file(tmp_path / "p_valid.bin")


def test_convert_jsonl_ids_appends_eod_once(tmp_path: Path) -> None:
    rows = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 0]}, {"input_ids": []}, {"input_ids": [70000]}]
    src = write_jsonl(tmp_path / "ids.jsonl", rows[:3])
    manifest = convert(ConvertConfig(inputs=(src,), out=tmp_path / "ids", ids_key="input_ids", eod_id=0, vocab_size=100_000))
    assert [d.tolist() for d in documents(tmp_path / "ids")] == [[5, 6, 7, 0], [8, 9, 0]]
    assert manifest["dtype"] == "int32" and manifest["already_ending_in_eod"] == 1 and manifest["skipped_empty"] == 1
    assert main(["check", str(tmp_path / "ids")]) == 0  # EOD read from ids.json

    src = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(RowError, match=rf"{src} row 4: token id 70000 is outside the vocabulary \[0, 512\)"):
        convert(ConvertConfig(inputs=(src,), out=tmp_path / "big", ids_key="input_ids", eod_id=0, vocab_size=512))
    assert not list(tmp_path.glob("big.*"))  # nothing half-written is left to block the rerun


def test_convert_errors_name_file_and_row(built: Path, tmp_path: Path) -> None:
    tok = DataDir(built).tokenizer_dir
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"text": "a"}, {"body": "b"}])
    with pytest.raises(RowError, match=rf"{missing} row 2: no key 'text' \(has \['body'\]\)"):
        convert(ConvertConfig(inputs=(missing,), out=tmp_path / "o1", text_key="text", tokenizer_dir=tok))
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"text": "a"}, {"text": "b"}, {"text": 3}])
    with pytest.raises(RowError, match=rf"{wrong} row 3: 'text' is int, expected a string"):
        convert(ConvertConfig(inputs=(wrong,), out=tmp_path / "o2", text_key="text", tokenizer_dir=tok))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(RowError, match=rf"{broken} row 2: not JSON"):
        convert(ConvertConfig(inputs=(broken,), out=tmp_path / "o3", text_key="text", tokenizer_dir=tok))
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"ids": [1, 2]}, {"ids": [1, 600]}])
    with pytest.raises(RowError, match=rf"{ids} row 2: token id 600 is outside the vocabulary \[0, 512\)"):
        convert(ConvertConfig(inputs=(ids,), out=tmp_path / "o4", ids_key="ids", tokenizer_dir=tok))
    floats = write_jsonl(tmp_path / "floats.jsonl", [{"ids": [1.5]}])
    with pytest.raises(RowError, match=rf"{floats} row 1: 'ids' is \[1.5\], expected a list of integer token ids"):
        convert(ConvertConfig(inputs=(floats,), out=tmp_path / "o5", ids_key="ids", tokenizer_dir=tok))

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "nulls.parquet")
    with pytest.raises(RowError, match=r"nulls\.parquet row 2: 'text' is NoneType"):
        convert(ConvertConfig(inputs=(tmp_path / "nulls.parquet",), out=tmp_path / "o6", text_key="text", tokenizer_dir=tok))
    with pytest.raises(RowError, match=r"nulls\.parquet row 1: no column 'body' \(has \['text'\]\)"):
        convert(ConvertConfig(inputs=(tmp_path / "nulls.parquet",), out=tmp_path / "o7", text_key="body", tokenizer_dir=tok))
    with pytest.raises(ValueError, match="needs --eod-id N and --vocab-size N"):
        convert(ConvertConfig(inputs=(ids,), out=tmp_path / "o8", ids_key="ids", eod_id=0))


def test_convert_cli_expands_globs(built: Path, tmp_path: Path, capsys) -> None:
    for i in range(3):
        write_jsonl(tmp_path / f"shard-{i}.jsonl", [{"text": f"int s{i}_{j};\n"} for j in range(4)])
    out = tmp_path / "cli"
    tokenizer = str(DataDir(built).tokenizer_dir)
    argv = ["convert", str(tmp_path / "shard-*.jsonl"), "--text-key", "text", "--tokenizer", tokenizer, "--out", str(out)]
    assert main(argv) == 0
    assert "train: 12 documents" in capsys.readouterr().out
    recorded = json.loads(Path(f"{out}.json").read_text())
    assert recorded["inputs"] == [str(tmp_path / f"shard-{i}.jsonl") for i in range(3)]
    with pytest.raises(SystemExit, match="matches no file"):
        main(["convert", str(tmp_path / "nope-*.jsonl"), "--text-key", "text", "--tokenizer", tokenizer, "--out", str(out)])
