"""What a built data directory recorded (its data.json), as the launcher and the checks read it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nam56r.training.data.layout import BUILD_COMMAND, DataDir


@dataclass(frozen=True)
class DataManifest:
    """What the launcher needs from a built data directory (absolute paths)."""

    directory: Path
    train_prefix: Path  # Megatron prefixes: add .bin / .idx
    valid_prefix: Path
    tokenizer_dir: Path
    vocab_size: int  # the tokenizer's real size (may be below the size asked for: see data.json)
    eod_id: int

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise if the model's embedding cannot hold every token id of this data."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the data in {self.directory} uses a {self.vocab_size}-token vocabulary but the model's vocab_size is "
                f"{model_vocab_size}: rebuild it with `{BUILD_COMMAND} --out {self.directory} --vocab-size {model_vocab_size} --force`"
            )


def read_data_manifest(directory: Path) -> DataManifest:
    """The built data in `directory`; raises FileNotFoundError naming the command that builds it."""
    layout = DataDir(Path(directory).resolve())
    directory, path = layout.path, layout.manifest
    if not path.is_file():
        raise FileNotFoundError(
            f"no training data in {directory} ({path.name} is missing): build it with `{BUILD_COMMAND} --out {directory}`"
        )
    raw = json.loads(path.read_text())
    manifest = DataManifest(
        directory=directory,
        train_prefix=directory / raw["prefixes"]["train"],
        valid_prefix=directory / raw["prefixes"]["valid"],
        tokenizer_dir=directory / raw["tokenizer_dir"],
        vocab_size=raw["vocab_size"]["reached"],
        eod_id=raw["eod_id"],
    )
    expected = (*dataset_files(manifest.train_prefix), *dataset_files(manifest.valid_prefix), manifest.tokenizer_dir)
    missing = [str(p) for p in expected if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"{path} names files that are gone ({', '.join(missing)}): rebuild with `{BUILD_COMMAND} --out {directory} --force`"
        )
    return manifest


def dataset_files(prefix: Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def eod_id_near(prefix: Path) -> int | None:
    """The EOD id recorded for `prefix`: by the converter in `<prefix>.json`, or by the build in data.json beside it."""
    if (own := Path(f"{prefix}.json")).is_file():
        return json.loads(own.read_text()).get("eod_id")
    if (built := DataDir(prefix.parent).manifest).is_file():
        raw = json.loads(built.read_text())
        if prefix.name in raw.get("prefixes", {}).values():
            return raw.get("eod_id")
    return None
