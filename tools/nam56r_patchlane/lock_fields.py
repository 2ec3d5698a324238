"""The pieces every table of the lock is read with: a pinned release file, the checks of hashes and ids, a required
key (lock.py's upstreams and corpus, te_lock.py's [te] and [apex])."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import PatchlaneError

SHA256 = re.compile(r"^[0-9a-f]{64}$")
OBJECT_ID = re.compile(r"^[0-9a-f]{40}$")  # a git commit or tree id


@dataclass(frozen=True)
class Artifact:
    """One release file on the package index, identified by name and sha256."""

    filename: str
    sha256: str

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")

    @property
    def project(self) -> str:
        """The project name the file belongs to (the index is searched under it)."""
        if self.is_wheel:
            return self.filename.split("-")[0]
        return self.filename.removesuffix(".tar.gz").rsplit("-", 1)[0]


def require(table: dict, key: str, where: str) -> object:
    if key not in table:
        raise PatchlaneError(f"{where}: missing key {key!r}")
    return table[key]


def sha256_of(table: dict, where: str, what: str = "sha256") -> str:
    """The table's `sha256`, lower-cased, refused unless 64 hex digits (`what` names it in the error)."""
    sha = str(require(table, "sha256", where)).lower()
    if not SHA256.match(sha):
        raise PatchlaneError(f"{where}: {what} {sha!r} is not 64 hex digits")
    return sha


def artifacts_of(raw: dict, where: str) -> tuple[Artifact, ...]:
    """A table's [[artifact]] entries, each a file name and its sha256."""
    return tuple(Artifact(sha256=sha256_of(entry, where, "artifact sha256"), filename=str(require(entry, "filename", where)))
                 for entry in raw.get("artifact", []))
