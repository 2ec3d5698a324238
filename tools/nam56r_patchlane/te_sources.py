"""TransformerEngine's pinned files and Apex's source archive in a cache directory: gathered by `cache fill --profile
gpu-te`, looked up (and, online, fetched) by `build --with-te`. Every file is checked against the lock; a missing or
different one stops the build, named, with the command that brings it.

  te/<TE wheels>                 installed as they are
  te/<TE PyTorch extension sdist> compiled on the node against its torch (te_compile.py)
  te/apex-<commit>.tar.gz        Apex's source at the lock's commit (apex_source.py)
"""

from __future__ import annotations

import email.parser
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .apex_source import archive_path, archive_problem, fill_apex
from .artifacts import locate_and_save, sha256_file
from .cachemanifest import MIB, TE_DIR, CacheFile, CacheManifest, file_problem
from .errors import PatchlaneError
from .lock_fields import Artifact
from .te_lock import TE_PROFILE, TeLock
from .wheelhouse import canonical

try:  # the interpreter running this tool has pip, not necessarily `packaging`
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pragma: no cover - depends on the interpreter
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement


@dataclass(frozen=True)
class TeSources:
    """The verified local files `build --with-te` installs from."""

    wheels: tuple[Path, ...]
    sdist: Path
    apex_archive: Path


def fill_te_sources(te_lock: TeLock, cache_dir: Path, apex_from: str | None,
                    log: Callable[[str], None] = print) -> list[CacheFile]:
    """Fetch TE's pinned files through pip and make Apex's archive from git, into `cache_dir`; their manifest entries."""
    files = [_fill_pinned(pinned, te_lock.te.version, cache_dir, log) for pinned in te_lock.te.files]
    return [*files, fill_apex(te_lock.apex, cache_dir, apex_from, log)]


def _fill_pinned(pinned: Artifact, version: str, cache_dir: Path, log: Callable[[str], None]) -> CacheFile:
    path = fetch_pinned(pinned, version, cache_dir, log)
    log(f"  {pinned.filename} ({path.stat().st_size / MIB:.1f} MiB, sha256 verified)")
    return CacheFile(path=f"{TE_DIR}/{pinned.filename}", sha256=pinned.sha256, size=path.stat().st_size, kind=TE_DIR,
                     name=pinned.project, version=version)


def fetch_pinned(pinned: Artifact, version: str, cache_dir: Path, log: Callable[[str], None] = print) -> Path:
    """The pinned file in `cache_dir/te/`, downloaded through pip's finder unless it is there; sha256-verified."""
    dest = cache_dir / TE_DIR / pinned.filename
    if dest.is_file() and sha256_file(dest) == pinned.sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"  downloading {pinned.project}=={version} ({pinned.filename}) through pip")
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        saved = locate_and_save(None, pinned.project, version, pinned.filename, Path(tmp))
        actual = sha256_file(saved)
        if actual != pinned.sha256:
            raise PatchlaneError(f"{pinned.filename}: the index serves sha256 {actual}, the lock pins {pinned.sha256}",
                                 "the release was replaced on the index: check it, then pin it again in third_party/upstreams.toml")
        shutil.move(str(saved), dest)
    return dest


def cached_te_sources(te_lock: TeLock, cache_dir: Path, manifest: CacheManifest) -> TeSources:
    """The files of a verified offline cache; refuses, naming each missing piece, a cache that lacks any."""
    fill = (f"fill it where an index is reachable: apply_patches.py cache fill {cache_dir} --python-version X.Y"
            f" --platform TAG --profile {TE_PROFILE} [--apex-from CLONE]")
    if manifest.target.profile != TE_PROFILE:
        raise PatchlaneError(f"--with-te: {cache_dir} was filled for profile {manifest.target.profile}, which carries no"
                             " TransformerEngine or Apex", fill)
    listed = {f.path: f for f in manifest.files}
    wanted = [*(f"{TE_DIR}/{p.filename}" for p in te_lock.te.files), archive_path(te_lock.apex)]
    pins = {f"{TE_DIR}/{p.filename}": p.sha256 for p in te_lock.te.files}
    problems = []
    for path in wanted:
        entry = listed.get(path)
        if entry is None:
            problems.append(f"{path}: not in the cache (the lock changed since the fill?)")
        elif path in pins and entry.sha256 != pins[path]:
            problems.append(f"{path}: the cache has sha256 {entry.sha256}, the lock pins {pins[path]}")
        elif problem := file_problem(cache_dir, entry):
            problems.append(problem)
    if problems:
        raise PatchlaneError("--with-te: the offline cache cannot serve TransformerEngine and Apex:\n"
                             + "\n".join(f"  {p}" for p in problems), fill)
    return _sources(te_lock, cache_dir)


def online_te_sources(te_lock: TeLock, cache_dir: Path, log: Callable[[str], None] = print) -> TeSources:
    """TE's files through pip and Apex's archive from git (each kept in `cache_dir` and checked against the lock)."""
    for pinned in te_lock.te.files:
        fetch_pinned(pinned, te_lock.te.version, cache_dir, log)
    archive = cache_dir / archive_path(te_lock.apex)
    if not archive.is_file() or archive_problem(te_lock.apex, archive) is not None:
        fill_apex(te_lock.apex, cache_dir, None, log)
    return _sources(te_lock, cache_dir)


def _sources(te_lock: TeLock, cache_dir: Path) -> TeSources:
    return TeSources(wheels=tuple(cache_dir / TE_DIR / p.filename for p in te_lock.te.wheels),
                     sdist=cache_dir / TE_DIR / te_lock.te.sdist.filename, apex_archive=cache_dir / archive_path(te_lock.apex))


def te_requirement_problems(te_lock: TeLock, cache_dir: Path, cached: set[str], exclude: tuple[str, ...],
                            markers: dict[str, str]) -> list[str]:
    """Each requirement of TE's pinned files (their Requires-Dist, active on the target) that neither another pinned
    file, a wheel of the cache (`cached`, canonical names) nor the node (`exclude`) serves."""
    pinned = {canonical(p.project) for p in te_lock.te.files}
    environment = {**{str(k): str(v) for k, v in default_environment().items()}, **markers, "extra": ""}
    problems = []
    for pinned_file in te_lock.te.files:
        for text in _requires_dist(cache_dir / TE_DIR / pinned_file.filename):
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            name = canonical(requirement.name)
            if name not in pinned and name not in cached and name not in exclude:
                problems.append(f"{pinned_file.filename} requires {text}, which the cache does not carry")
    return problems


def _requires_dist(path: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA or an sdist's PKG-INFO."""
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path) as wheel:
            name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            text = wheel.read(name).decode()
    else:
        with tarfile.open(path) as sdist:
            member = next(m for m in sdist.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO"))
            handle = sdist.extractfile(member)
            text = handle.read().decode() if handle else ""
    headers = email.parser.Parser().parsestr(text.split("\n\n", 1)[0])
    return list(dict.fromkeys(headers.get_all("Requires-Dist") or ()))
