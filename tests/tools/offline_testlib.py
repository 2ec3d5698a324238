"""A local package index for the offline-cache tests: real wheels and an sdist built here, served to pip
as a find-links directory, with pip's own configuration switched off so nothing else is reachable.

The packages stand for the real stack's shapes:
  alpha        runtime requirement; needs beta (2.0: 100 KiB), nativepkg, and one wheel per Python version by marker
  nativepkg    tagged for manylinux_2_17 only (reachable for a manylinux_2_28 target only through the older tags)
  gamma        an upstream's runtime requirement that depends on torch (as torch-c-dlpack-ext does)
  torch        a stand-in for the heavy framework (100 KiB), with a dependency of its own (heavydep)
  buildpkg     the build requirement; noxlike / toolpkg: what the [nox] table names
  fakeup       the pinned upstream: a wheel (install = "wheel") or an sdist whose setup.py imports a module
               nobody has (as mamba-ssm's setup.py imports torch)
"""

from __future__ import annotations

import base64
import hashlib
import io
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from patchlane_testlib import Lane, Result

RUNNING = f"{sys.version_info[0]}.{sys.version_info[1]}"
OTHER = "3.12" if RUNNING != "3.12" else "3.11"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = (), tag: str = "py3-none-any",
               payload: bytes = b"", init: str = "") -> Path:
    """A minimal valid wheel: package `name` (VERSION, then `init`; optional DATA blob), METADATA, WHEEL, RECORD."""
    module = name.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {f"{module}/__init__.py": f'VERSION = "{version}"\n{init}'.encode()}
    if payload:
        files[f"{module}/data.bin"] = payload
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    files[f"{dist_info}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{dist_info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: offline-testlib\nRoot-Is-Purelib: true\nTag: {tag}\n".encode()
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items()) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    path = directory / f"{module}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for rel, data in files.items():
            zf.writestr(rel, data)
    return path


def make_sdist_needing(directory: Path, missing_module: str) -> Path:
    """fakeup-1.0.tar.gz whose setup.py imports `missing_module` first: preparing its metadata fails."""
    path = directory / "fakeup-1.0.tar.gz"
    members = {
        "fakeup-1.0/setup.py": f"import {missing_module}\nfrom setuptools import setup\nsetup(name='fakeup', version='1.0')\n",
        "fakeup-1.0/PKG-INFO": "Metadata-Version: 2.1\nName: fakeup\nVersion: 1.0\n",
        "fakeup-1.0/fakeup/__init__.py": 'VERSION = "1.0"\n',
    }
    with tarfile.open(path, "w:gz") as tf:
        for rel, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(rel)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@dataclass(frozen=True)
class LocalIndex:
    directory: Path
    upstream_wheel: Path

    def files(self) -> set[str]:
        return {p.name for p in self.directory.iterdir()}


def make_index(directory: Path) -> LocalIndex:
    directory.mkdir(parents=True)
    make_wheel(directory, "alpha", "1.0", ("beta>=1", "nativepkg", f'onlyrunning; python_version == "{RUNNING}"',
                                          f'onlyother; python_version == "{OTHER}"'))
    make_wheel(directory, "beta", "1.0")
    make_wheel(directory, "beta", "2.0", payload=bytes(range(256)) * 400)  # 100 KiB (stored): something to split
    make_wheel(directory, "onlyrunning", "1.0")
    make_wheel(directory, "onlyother", "1.0")
    for version in {RUNNING, OTHER}:
        abi = "cp" + version.replace(".", "")
        make_wheel(directory, "nativepkg", "1.0", tag=f"{abi}-{abi}-manylinux_2_17_x86_64")
    make_wheel(directory, "gamma", "1.0", ("torch",))
    make_wheel(directory, "torch", "9.0", ("heavydep",), payload=bytes(range(256)) * 400)
    make_wheel(directory, "heavydep", "1.0")
    make_wheel(directory, "buildpkg", "1.0")
    make_wheel(directory, "noxlike", "1.0", ("toolpkg",))
    make_wheel(directory, "toolpkg", "1.0")
    upstream = make_wheel(directory, "fakeup", "1.0")
    return LocalIndex(directory=directory, upstream_wheel=upstream)


def lock_text(artifact: Path, install: str = "wheel") -> str:
    return f'''\
schema = 1

[environment]
torch = "torch==9.0"
torch_min = "9.0"
build = ["buildpkg"]
runtime = ["alpha"]
cpu = []
gpu = []

[nox]
nox = "noxlike"
tool = ["toolpkg"]

[[upstream]]
name = "fakeup"
git_url = "https://example.invalid/fakeup.git"
tag = "v1"
commit = "{COMMIT}"
pypi = "fakeup"
version = "1.0"
install = "{install}"
imports = ["fakeup", "alpha", "gamma"]
runtime = ["gamma"]

[[upstream.artifact]]
filename = "{artifact.name}"
sha256 = "{hashlib.sha256(artifact.read_bytes()).hexdigest()}"
'''


def make_root(root: Path, artifact: Path, install: str = "wheel") -> Path:
    (root / "third_party").mkdir(parents=True)
    (root / "third_party" / "upstreams.toml").write_text(lock_text(artifact, install))
    (root / "patches" / "fakeup").mkdir(parents=True)
    (root / "patches" / "fakeup" / "series").write_text("")
    return root


def only_index(monkeypatch: pytest.MonkeyPatch, find_links: Path | None) -> None:
    """pip sees no configuration and no index: only `find_links` (None: nothing at all)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    if find_links is None:
        monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    else:
        monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))


def cli(root: Path, *args: str) -> Result:
    return Lane.main(["--root", str(root), *args])


def fill(root: Path, cache: Path, *args: str) -> Result:
    return cli(root, "cache", "fill", str(cache), *args)


def cached_wheels(cache: Path) -> set[str]:
    return {p.name.split("-")[0] for p in (cache / "wheels").iterdir()}


def run_python(python: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True)
