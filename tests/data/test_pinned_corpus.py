"""The pinned corpus (nam56r.training.data.pinned): releases by version and sha256 from an offline cache, their C/C++
files extracted once, deduplicated before the split, and the same corpus checksum from the same releases."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest

from nam56r.training.data.build import CorpusConfig, build, collect_corpus, corpus_checksum
from nam56r.training.data.pinned import MAX_FILE_BYTES, pinned_source_root


def _code(seed: int) -> str:
    return "\n".join(f"int f{seed}_{i}(int x) {{ return x * {i + seed} + {i * i}; }}" for i in range(60))


def _release(tmp_path: Path, name: str, files: dict[str, bytes]) -> tuple[Path, str]:
    archive = tmp_path / f"{name}-1.0.tar.gz"
    staging = tmp_path / f"staging-{name}" / f"{name}-1.0"
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(staging, arcname=f"{name}-1.0")
    return archive, hashlib.sha256(archive.read_bytes()).hexdigest()


@pytest.fixture
def checkout(tmp_path: Path) -> tuple[Path, Path]:
    """A root whose lock pins two releases, and an offline cache holding them under corpus/."""
    alpha, alpha_sha = _release(tmp_path, "alpha", {
        "src/a.c": _code(1).encode(), "src/copy_of_a.c": _code(1).encode(), "include/b.h": _code(2).encode(),
        "README.md": b"not C", "gen/table.c": b"x" * (MAX_FILE_BYTES + 1)})
    beta, beta_sha = _release(tmp_path, "beta", {f"lib/m{i}.cc": _code(10 + i).encode() for i in range(12)})
    root, cache = tmp_path / "root", tmp_path / "cache" / "corpus"
    (root / "third_party").mkdir(parents=True)
    cache.mkdir(parents=True)
    lock = "schema = 1\n"
    for archive, sha, name in ((alpha, alpha_sha, "alpha"), (beta, beta_sha, "beta")):
        (cache / archive.name).write_bytes(archive.read_bytes())
        lock += f'\n[[corpus]]\nname = "{name}"\nversion = "1.0"\nfilename = "{archive.name}"\nsha256 = "{sha}"\n'
    (root / "third_party" / "upstreams.toml").write_text(lock)
    return root, cache.parent


def test_the_releases_extract_once_dedup_and_split_to_one_checksum(checkout, tmp_path: Path) -> None:
    root, cache = checkout
    sources = pinned_source_root(tmp_path / "sources", [cache], offline=True, root=root)

    files = sorted(p.relative_to(sources).as_posix() for p in sources.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert files[:3] == ["alpha-1.0/include/b.h", "alpha-1.0/src/a.c", "alpha-1.0/src/copy_of_a.c"]
    assert "alpha-1.0/README.md" not in files and "alpha-1.0/gen/table.c" not in files  # not C/C++; over the size cap
    assert json.loads((sources / "alpha-1.0" / ".nam56r-extracted.json").read_text())["skipped_over_max_bytes"] == 1
    corpus = collect_corpus(CorpusConfig(sources=(sources,), dedup=True, valid_fraction=0.2))
    assert corpus.dedup["dropped_exact"] == 1 and corpus.dedup["dropped"][0]["key"] == "alpha-1.0/src/copy_of_a.c"
    keys = [d.key for d in corpus.train + corpus.valid]
    assert len(keys) == 14 and corpus.valid and corpus.train

    again = pinned_source_root(tmp_path / "elsewhere", [cache], offline=True, root=root)
    assert corpus_checksum(collect_corpus(CorpusConfig(sources=(again,), dedup=True, valid_fraction=0.2))) == \
        corpus_checksum(corpus)  # another folder, the same corpus

    manifest = build(tmp_path / "out", 300, CorpusConfig(sources=(sources,), dedup=True, valid_fraction=0.2))
    assert manifest["corpus_sha256"] == corpus_checksum(corpus) and manifest["dedup"]["kept"] == 14


def test_a_release_whose_sha256_differs_or_that_is_missing_offline_is_refused(checkout, tmp_path: Path) -> None:
    root, cache = checkout
    (next((cache / "corpus").glob("beta-*"))).write_bytes(b"tampered")
    with pytest.raises(ValueError, match="sha256 differs from the lock's"):
        pinned_source_root(tmp_path / "sources", [cache], offline=True, root=root)
    with pytest.raises(ValueError, match="is in none of .*cache fill"):
        pinned_source_root(tmp_path / "sources", [tmp_path / "empty"], offline=True, root=root)


def test_builds_starting_at_once_extract_each_release_whole_and_leave_no_staging(checkout, tmp_path: Path) -> None:
    import subprocess
    import sys

    root, cache = checkout
    sources = tmp_path / "sources"
    program = ("import sys; from pathlib import Path; from nam56r.training.data.pinned import pinned_source_root; "
               "pinned_source_root(Path(sys.argv[1]), [Path(sys.argv[2])], offline=True, root=Path(sys.argv[3]))")
    builds = [subprocess.Popen([sys.executable, "-c", program, str(sources), str(cache), str(root)],
                               stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [b.communicate()[1] for b in builds]

    assert [b.returncode for b in builds] == [0, 0, 0, 0], errors
    assert sorted(p.name for p in sources.iterdir()) == ["alpha-1.0", "beta-1.0"]  # no staging folder left
    assert json.loads((sources / "beta-1.0" / ".nam56r-extracted.json").read_text())["files"] == 12
    assert len([p for p in (sources / "beta-1.0").rglob("*") if p.is_file()]) == 13
