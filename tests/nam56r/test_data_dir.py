"""nam56r.training.data.layout: the names inside a data directory are an on-disk contract (directories built
earlier are read with them), so they are pinned here; everything else reads them from `DataDir`."""

from __future__ import annotations

from pathlib import Path

import pytest

from nam56r.training.data.layout import DataDir, default_data_dir


def test_a_data_directory_names_the_files_a_build_writes() -> None:
    layout = DataDir(Path("/data/cpp"))
    assert layout.manifest == Path("/data/cpp/data.json")
    assert layout.tokenizer_dir == Path("/data/cpp/tokenizer")
    assert layout.train_prefix == Path("/data/cpp/train_text_document")
    assert layout.valid_prefix == Path("/data/cpp/valid_text_document")
    assert [layout.prefix(split) for split in DataDir.SPLITS] == [layout.train_prefix, layout.valid_prefix]


def test_an_unknown_split_is_refused_naming_the_splits() -> None:
    with pytest.raises(ValueError, match=r"unknown split 'test': a data directory holds train and valid"):
        DataDir(Path("/data/cpp")).prefix("test")


def test_the_default_corpus_lives_under_data_by_vocabulary(tmp_path: Path) -> None:
    assert default_data_dir(512, root=tmp_path) == tmp_path / "data" / "pinned-v512"
