"""Pinned release artifacts: fetched through pip (so the user's index, mirror and proxy settings
apply), kept in a cache directory, and accepted only when their sha256 matches the lock.

pip's finder locates the exact file the lock names and pip's session downloads it; `pip download`
would also build an sdist's metadata, which runs its setup.py (pip_internals.py says more)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchlaneError
from .lock import Artifact, CorpusSource, Upstream

PIP_INTERNALS = Path(__file__).with_name("pip_internals.py")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nam56r-patchlane" / "artifacts"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class FetchedArtifact:
    path: Path
    source: str  # "cache" (found there, verified) or "pypi" (downloaded now through pip, verified)


def verify(path: Path, artifact: Artifact) -> None:
    actual = sha256_file(path)
    if actual != artifact.sha256:
        raise PatchlaneError(
            f"refusing {path}: sha256 {actual} does not match the lock's {artifact.sha256}",
            "the file was tampered with or re-uploaded; delete it to fetch it again, and never edit the lock"
            " to match an artifact you did not expect",
        )


def locate_and_save(python: str | None, project: str, version: str, filename: str | None, dest: Path) -> Path:
    """Save one release file of `project` into `dest` through pip's finder (pip_internals.py locate): by exact
    `filename`, or the sdist of `version` when `filename` is None. Nothing is built."""
    request = {"project": project, "version": version, "filename": filename, "sdist": filename is None or not filename.endswith(".whl"),
               "dest": str(dest)}
    proc = subprocess.run([python or sys.executable, str(PIP_INTERNALS), "locate", json.dumps(request)], capture_output=True, text=True)
    found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 and proc.stdout.strip() else None
    if found is None:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise PatchlaneError(
            f"pip could not fetch {project}=={version}" + (f" ({filename})" if filename else "") + f":\n{tail}",
            "check your package index configuration (pip config list), or use --cache DIR --offline with a cache"
            " filled by `apply_patches.py cache fill DIR` on a machine that can reach the index",
        )
    if found["found"] is None:
        same = ", ".join(found["same_version"]) or "no file of that version"
        raise PatchlaneError(
            f"{project}: the index has no {found['wanted']} (files of {version} there: {same})",
            "the index serves different files for this release; check the lock and your index configuration",
        )
    return dest / found["found"]


def download_corpus_release(source: CorpusSource, dest: Path) -> Path:
    """A pinned corpus release saved into `dest` through pip's finder, and sha256-verified (removed when it differs)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / source.filename).unlink(missing_ok=True)
    path = locate_and_save(None, source.name, source.version, source.filename, dest)
    if sha256_file(path) != source.sha256:
        path.unlink()
        raise PatchlaneError(f"{source.filename}: the index serves another file than the lock's sha256 {source.sha256}",
                             "the release was replaced on the index: pin it again in third_party/upstreams.toml")
    return path


def pip_download(python: str, requirement: str, wheel: bool, dest: Path, upstream: Upstream | None = None) -> None:
    """Download one release (`name==version`) without its dependencies into `dest`: its sdist, or with
    `wheel` the wheel pip picks for `python`. Nothing is built (an sdist's setup.py may import torch)."""
    project, _, version = requirement.partition("==")
    if not wheel:
        locate_and_save(python, project, version, None, dest)
        return
    cmd = [python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--only-binary", ":all:", "-d", str(dest)]
    if upstream is not None and upstream.ignore_requires_python:
        cmd.append("--ignore-requires-python")
    proc = subprocess.run([*cmd, requirement], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise PatchlaneError(f"pip could not download {requirement}:\n{tail}",
                             "check your package index configuration (pip config list)")


def fetch_artifact(
    upstream: Upstream, cache_dir: Path, offline: bool, python: str | None = None, log=print
) -> FetchedArtifact:
    """Return the verified local file for the upstream's pinned artifact, downloading if allowed.
    `python`: the interpreter whose pip (and configuration) fetches it (default: this one)."""
    artifact = upstream.artifact()
    cached = cache_dir / artifact.filename
    if cached.is_file():
        verify(cached, artifact)
        return FetchedArtifact(path=cached, source="cache")
    if offline:
        raise PatchlaneError(
            f"{upstream.name}: {artifact.filename} is not in the offline cache {cache_dir}",
            f"fill the cache where the index is reachable: python tools/apply_patches.py cache fill {cache_dir}",
        )
    log(f"  downloading {upstream.requirement} ({artifact.filename}) through pip")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as tmp:
        downloaded = locate_and_save(python, upstream.pypi, upstream.version, artifact.filename, Path(tmp))
        verify(downloaded, artifact)
        shutil.move(str(downloaded), cached)
    return FetchedArtifact(path=cached, source="pypi")
