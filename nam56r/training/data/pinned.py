"""The pinned corpus: the C/C++ sources of the releases the lock lists under [[corpus]], the same files on every
machine (each release by version and sha256, fetched through pip or taken from an offline cache `cache fill` made).

Each release's C/C++ files of at most MAX_FILE_BYTES (larger ones are generated tables and amalgamations) are
extracted under SOURCES/<name>-<version>/, keyed by that folder and their path in the release, so the build's split
and its deduplication (dedup.py) see one tree.
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from nam56r_patchlane.artifacts import default_cache_dir, download_corpus_release, sha256_file
from nam56r_patchlane.cachemanifest import CORPUS_DIR
from nam56r_patchlane.environment import read_build_record
from nam56r_patchlane.errors import PatchlaneError
from nam56r_patchlane.lock import CorpusSource, load_lock

from nam56r import CHECKOUT_ROOT
from nam56r.training.data.build import SOURCE_SUFFIXES, CorpusConfig
from nam56r.training.data.layout import DEFAULT_SOURCES_DIR

MAX_FILE_BYTES = 1_000_000
EXTRACTED_MARK = ".nam56r-extracted.json"


def corpus_sources(root: Path = CHECKOUT_ROOT) -> tuple[CorpusSource, ...]:
    sources = load_lock(root).corpus
    if not sources:
        raise ValueError(f"{root}/third_party/upstreams.toml pins no [[corpus]] release")
    return sources


def fetch(source: CorpusSource, caches: list[Path], offline: bool) -> Path:
    """The release file, sha256-verified: from `caches` (an offline cache's corpus/ folder, or the folder itself),
    else downloaded through pip into the first cache's corpus/ folder unless `offline`."""
    for cache in caches:
        for path in (cache / CORPUS_DIR / source.filename, cache / source.filename):
            if path.is_file():
                if sha256_file(path) != source.sha256:
                    raise ValueError(f"{path}: sha256 differs from the lock's {source.sha256}: delete it and fetch again")
                return path
    if offline:
        raise ValueError(f"{source.filename} is in none of {', '.join(map(str, caches))}: fill an offline cache where an "
                         "index is reachable (`nox -s patches -- cache fill DIR`) and pass it with --cache DIR")
    print(f"  downloading {source.name}=={source.version} ({source.filename}) through pip", file=sys.stderr)
    try:
        return download_corpus_release(source, caches[0] / CORPUS_DIR)
    except PatchlaneError as exc:
        raise ValueError(str(exc)) from exc


def extract(source: CorpusSource, archive: Path, sources_dir: Path) -> Path:
    """The release's C/C++ files under sources_dir/<name>-<version>/ (done once per sha256). Builds that start at once
    (e.g. two trainings of other vocabularies on one node) each extract into a folder of their own and rename it into
    place: the folder exists only whole, and the first rename wins."""
    dest = sources_dir / f"{source.name}-{source.version}"
    if _extracted(dest, source):
        return dest
    sources_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=sources_dir))
    try:
        kept = skipped = 0
        for name, size, read in _members(archive):
            inner = name.split("/", 1)[1] if "/" in name else name  # below the release's top folder
            if not inner.endswith(SOURCE_SUFFIXES) or ".." in inner.split("/"):
                continue
            if size > MAX_FILE_BYTES:
                skipped += 1
                continue
            target = staging / inner
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(read())
            kept += 1
        (staging / EXTRACTED_MARK).write_text(json.dumps({"sha256": source.sha256, "files": kept, "skipped_over_max_bytes": skipped}))
        if dest.exists() and not _extracted(dest, source):
            shutil.rmtree(dest, ignore_errors=True)  # an interrupted extraction of an older layout, or another sha256
        try:
            staging.rename(dest)
        except OSError:
            if not _extracted(dest, source):  # not another build's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def _extracted(dest: Path, source: CorpusSource) -> bool:
    mark = dest / EXTRACTED_MARK
    return mark.is_file() and json.loads(mark.read_text()).get("sha256") == source.sha256


def _members(archive: Path):
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            for info in sorted(zf.infolist(), key=lambda i: i.filename):
                if not info.is_dir():
                    yield info.filename, info.file_size, lambda info=info: zf.read(info)
        return
    with tarfile.open(archive, "r|*") as tf:  # streamed in archive order: a gzip stream cannot seek back cheaply
        for member in tf:
            if member.isfile():
                yield member.name, member.size, lambda member=member: tf.extractfile(member).read()


def pinned_source_root(sources_dir: Path, caches: list[Path] | None = None, offline: bool = False,
                       root: Path = CHECKOUT_ROOT) -> Path:
    """Every pinned release fetched and extracted under `sources_dir`; returns it (the build's one source root)."""
    caches = caches or [default_cache_dir()]
    for source in corpus_sources(root):
        extract(source, fetch(source, caches, offline), sources_dir)
    return sources_dir


def build_cache() -> tuple[list[Path], bool]:
    """Where this environment's build took its artifacts from, and whether it ran --offline: an air-gapped node's
    offline cache holds the corpus releases too. Without a build record, the patch tool's artifact cache, online."""
    built = read_build_record(Path(sys.prefix))
    if built:
        return list(dict.fromkeys([Path(built["cache"]), default_cache_dir()])), bool(built.get("offline"))
    return [default_cache_dir()], False


def default_corpus(caches: list[Path] | None = None, offline: bool | None = None) -> CorpusConfig:
    """The default corpus: the pinned releases, deduplicated; from `caches` (default: the build's, see build_cache)."""
    found, built_offline = build_cache()
    sources_dir = CHECKOUT_ROOT / DEFAULT_SOURCES_DIR
    root = pinned_source_root(sources_dir, caches or found, built_offline if offline is None else offline)
    return CorpusConfig(sources=(root,), dedup=True)
