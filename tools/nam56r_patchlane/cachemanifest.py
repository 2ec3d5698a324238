"""The offline cache's manifest: every file `cache fill` put in the cache, with its sha256, size and
kind, and the target it was filled for. `--offline` builds verify it before installing anything from
the cache; `cache split` packs the files into parts of at most N MiB for transfers with a size limit.

Layout of a cache directory:
  <pinned artifacts>     megatron_core-0.19.0.tar.gz, ... (verified against the lock as well)
  wheels/                every wheel an offline build, nox and its sessions install
  upstream-tests/        each upstream's own tests at the pinned commit (upstream_tests_source.py)
  corpus/                the releases the pinned training corpus is made of
  te/                    TransformerEngine's pinned files and Apex's source (profile gpu-te; te_sources.py)
  nam56r-cache.json      this manifest
  .parts/NN/             after `cache split`: the same layout, a share of the files and the manifest in each part;
                         a file larger than a part travels as pieces (cachepieces.py), joined when the cache is verified
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from .artifacts import sha256_file
from .cachepieces import Piece, is_piece, join_pieces, plan_pieces, write_piece
from .errors import PatchlaneError

MANIFEST_NAME = "nam56r-cache.json"
WHEELS_DIR = "wheels"
CORPUS_DIR = "corpus"  # the pinned corpus' releases; also their files' kind
TE_DIR = "te"  # TransformerEngine's pinned files and Apex's source archive; also their files' kind
PARTS_DIR = ".parts"
SCHEMA = 1
MIB = 1 << 20


@dataclass(frozen=True)
class CacheFile:
    path: str  # relative to the cache directory, '/'-separated
    sha256: str
    size: int
    kind: str  # "artifact", or the requirement group that first needs the wheel (build, runtime, ...)
    name: str
    version: str


@dataclass(frozen=True)
class CacheTarget:
    python_version: str  # "3.12"; an interpreter of another minor version cannot use the wheels
    platforms: tuple[str, ...]  # empty: the platform of the interpreter that filled it
    profile: str
    exclude: tuple[str, ...]  # distributions the target brings itself (torch for the gpu profile)


@dataclass(frozen=True)
class CacheManifest:
    target: CacheTarget
    requirements: dict[str, list[str]]  # group -> the requirements it was resolved from
    files: tuple[CacheFile, ...]

    def write(self, cache_dir: Path) -> Path:
        path = cache_dir / MANIFEST_NAME
        data = {"schema": SCHEMA, "target": asdict(self.target), "requirements": self.requirements,
                "files": [asdict(f) for f in sorted(self.files, key=lambda f: f.path)]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
        return path

    def wheels(self) -> list[CacheFile]:
        return [f for f in self.files if f.kind not in ("artifact", "upstream-tests", CORPUS_DIR, TE_DIR)]

    def total_size(self) -> int:
        return sum(f.size for f in self.files)


def read_manifest(cache_dir: Path) -> CacheManifest | None:
    path = cache_dir / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"schema {raw.get('schema')!r}, this tool reads {SCHEMA}")
        target = raw["target"]
        return CacheManifest(
            target=CacheTarget(python_version=target["python_version"], platforms=tuple(target["platforms"]),
                               profile=target["profile"], exclude=tuple(target["exclude"])),
            requirements={k: list(v) for k, v in raw["requirements"].items()},
            files=tuple(CacheFile(**f) for f in raw["files"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise PatchlaneError(f"{path}: not a cache manifest this tool can read ({exc})",
                             f"fill the cache again: apply_patches.py cache fill {cache_dir}") from exc


def file_problem(cache_dir: Path, entry: CacheFile) -> str | None:
    """Why the cache's copy of `entry` cannot be used, or None when it is there and intact."""
    path = cache_dir / entry.path
    if not path.is_file():
        return f"{entry.path}: missing"
    if path.stat().st_size != entry.size:
        return f"{entry.path}: {path.stat().st_size} bytes, the manifest says {entry.size}"
    actual = sha256_file(path)
    if actual != entry.sha256:
        return f"{entry.path}: sha256 {actual}, the manifest says {entry.sha256}"
    return None


def verify_cache(cache_dir: Path, python_version: str | None = None, log=print) -> CacheManifest:
    """The manifest, after joining the files that arrived in pieces (`cache split`), checking every file it lists and
    that wheels/ holds nothing else.

    `python_version` ("3.12.3" or "3.12"): refuse a cache filled for another minor version."""
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise PatchlaneError(
            f"{cache_dir} has no {MANIFEST_NAME}: it was not filled by `cache fill`, so its wheels cannot be verified",
            f"fill it where an index is reachable: apply_patches.py cache fill {cache_dir} --python-version X.Y"
            " --platform TAG --profile cpu|gpu",
        )
    if python_version and ".".join(python_version.split(".")[:2]) != manifest.target.python_version:
        raise PatchlaneError(
            f"{cache_dir} was filled for python {manifest.target.python_version}; the environment runs python {python_version}",
            f"fill a cache for it: apply_patches.py cache fill DIR --python-version {'.'.join(python_version.split('.')[:2])}"
            " --platform TAG, or build with that interpreter (--base-python)",
        )
    pieces = join_pieces(cache_dir, [f.path for f in manifest.files], log)
    incomplete = {p.split(": ", 1)[0] for p in pieces}
    problems = pieces + [p for f in manifest.files if f.path not in incomplete and (p := file_problem(cache_dir, f))]
    listed = {f.path for f in manifest.files}
    wheels = cache_dir / WHEELS_DIR
    if wheels.is_dir():
        problems += [f"{WHEELS_DIR}/{p.name}: not in the manifest" for p in sorted(wheels.iterdir())
                     if f"{WHEELS_DIR}/{p.name}" not in listed and not is_piece(p.name)]
    if problems:
        hint = "delete the files named, then `cache fill` again where an index is reachable"
        if (cache_dir / PARTS_DIR).is_dir():
            hint = (f"the cache is split: copy every part into it first (cp -a {cache_dir}/{PARTS_DIR}/*/. {cache_dir}/),"
                    f" or {hint}")
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise PatchlaneError(f"{cache_dir}: {len(problems)} file(s) do not match {MANIFEST_NAME}:\n"
                             + "\n".join(f"  {p}" for p in shown), hint)
    return manifest


def size_table(manifest: CacheManifest) -> list[list[str]]:
    """Rows (kind, files, MiB): pinned artifacts, then the requirement groups in fill order, then the total."""
    kinds: dict[str, list[CacheFile]] = {kind: [] for kind in ("artifact", *manifest.requirements)}
    for entry in manifest.files:
        kinds.setdefault(entry.kind, []).append(entry)
    rows = [[kind, str(len(files)), f"{sum(f.size for f in files) / MIB:.1f}"] for kind, files in kinds.items() if files]
    return rows + [["total", str(len(manifest.files)), f"{manifest.total_size() / MIB:.1f}"]]


def split_cache(cache_dir: Path, manifest: CacheManifest, max_mib: float, log=print) -> list[Path]:
    """Hard-link (or copy) the cache's files into .parts/01, 02, ... of at most `max_mib` MiB each, each
    part laid out like the cache and holding the manifest, so any part that arrived can be checked. A file
    larger than a part is cut into pieces (cachepieces.py), which verify_cache joins."""
    limit = int(max_mib * MIB)
    manifest_size = (cache_dir / MANIFEST_NAME).stat().st_size
    room = limit - manifest_size
    if room <= 0:
        raise PatchlaneError(f"--max-mib {max_mib}: each part holds the manifest ({manifest_size / MIB:.2f} MiB), which leaves"
                             " no room for files", "pass a larger --max-mib")
    entries: list[CacheFile] = []
    cut: dict[str, Piece] = {}
    for entry in manifest.files:
        if entry.size <= room:
            entries.append(entry)
            continue
        for piece in plan_pieces(entry.path, entry.size, room):
            cut[piece.path] = piece
            entries.append(CacheFile(path=piece.path, sha256="", size=piece.size, kind=entry.kind, name=entry.name,
                                     version=entry.version))
        log(f"  {entry.path} ({entry.size / MIB:.1f} MiB) travels as {len(plan_pieces(entry.path, entry.size, room))}"
            " pieces, joined by `cache verify` once every part is copied in")
    bins: list[list[CacheFile]] = []
    used: list[int] = []
    for entry in sorted(entries, key=lambda f: (-f.size, f.path)):  # first fit, largest first
        for i in range(len(bins)):
            if used[i] + entry.size <= limit:
                bins[i].append(entry)
                used[i] += entry.size
                break
        else:
            bins.append([entry])
            used.append(manifest_size + entry.size)
    parts_root = cache_dir / PARTS_DIR
    if parts_root.exists():
        log(f"  replacing the previous split in {parts_root}")
        shutil.rmtree(parts_root)
    parts = []
    copied = 0
    for number, entries in enumerate(bins, start=1):
        part = parts_root / f"{number:02d}"
        for entry in entries:
            dest = part / entry.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            if entry.path in cut:
                write_piece(cache_dir, cut[entry.path], dest)
                continue
            try:
                os.link(cache_dir / entry.path, dest)
            except OSError:
                shutil.copy2(cache_dir / entry.path, dest)
                copied += 1
        shutil.copy2(cache_dir / MANIFEST_NAME, part / MANIFEST_NAME)
        size = sum(f.stat().st_size for f in part.rglob("*") if f.is_file())
        log(f"  {part}: {len(entries)} file(s), {size / MIB:.1f} MiB")
        parts.append(part)
    if copied:
        log(f"  {copied} file(s) copied: hard links are not supported there")
    return parts
