"""Pinned release artifacts: fetched through pip (so the user's index, mirror and proxy settings
apply), kept in a cache directory, and accepted only when their sha256 matches the lock."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchlaneError
from .lock import Artifact, Upstream


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


def pip_download(python: str, requirement: str, wheel: bool, dest: Path, upstream: Upstream | None = None) -> None:
    """`pip download` one distribution without its dependencies into `dest`.

    For an sdist pip builds its metadata; --no-build-isolation keeps that to seconds (the build deps
    must be importable by `python`) instead of pulling a fresh torch into an isolated build env."""
    cmd = [python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]
    cmd += ["--only-binary", ":all:"] if wheel else ["--no-binary", ":all:", "--no-build-isolation"]
    if upstream is not None and upstream.ignore_requires_python:
        cmd.append("--ignore-requires-python")
    env = {**os.environ, **(upstream.env_for("cpu") if upstream else {})}
    proc = subprocess.run([*cmd, requirement], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise PatchlaneError(
            f"pip could not download {requirement}:\n{tail}",
            "check your package index configuration (pip config list), or use --cache DIR --offline with"
            " a cache filled by `apply_patches.py cache fill DIR` on a machine that can reach the index"
            + ("; reading an sdist's metadata needs its build deps importable by the target python" if not wheel else ""),
        )


def fetch_artifact(
    upstream: Upstream, cache_dir: Path, offline: bool, python: str, log=print
) -> FetchedArtifact:
    """Return the verified local file for the upstream's pinned artifact, downloading if allowed."""
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
        pip_download(python, upstream.requirement, artifact.is_wheel, Path(tmp), upstream)
        downloaded = Path(tmp) / artifact.filename
        if not downloaded.is_file():
            got = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
            raise PatchlaneError(
                f"{upstream.name}: pip downloaded {got}, not the pinned {artifact.filename}",
                "the index serves a different file for this release; check the lock and your index",
            )
        verify(downloaded, artifact)
        shutil.move(str(downloaded), cached)
    return FetchedArtifact(path=cached, source="pypi")


def download_wheels(
    python: str, requirements: list[str], dest: Path, python_version: str | None, platforms: list[str], with_deps: bool = True
) -> None:
    """Download wheels for another interpreter into `dest`, for offline installs. `with_deps=False`
    fetches exactly the named ones (for an environment that already has torch and the like)."""
    if not requirements:
        return
    cmd = [python, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary", ":all:", "-d", str(dest)]
    if not with_deps:
        cmd.append("--no-deps")
    if python_version:
        cmd += ["--python-version", python_version, "--implementation", "cp"]
        for platform in platforms:
            cmd += ["--platform", platform]
    proc = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise PatchlaneError(f"pip could not download wheels for {requirements}:\n{tail}")
