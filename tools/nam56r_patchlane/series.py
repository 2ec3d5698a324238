"""patches/<upstream>/series: the ordered list of patch files for one upstream."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchlaneError

PATCH_NAME = re.compile(r"^(\d{4})-([a-z0-9][a-z0-9-]*)\.patch$")


@dataclass(frozen=True)
class SeriesEntry:
    name: str
    path: Path

    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class Series:
    """The series of one upstream. `directory` is patches/<upstream>."""

    upstream: str
    directory: Path
    entries: tuple[SeriesEntry, ...]

    @property
    def series_file(self) -> Path:
        return self.directory / "series"

    def index_of(self, name: str) -> int:
        for i, entry in enumerate(self.entries):
            if entry.name == name or entry.name.removesuffix(".patch") == name or _slug(entry.name) == name:
                return i
        raise PatchlaneError(f"{self.upstream}: no patch named {name!r} in {self.series_file}")

    def next_name(self, slug: str) -> str:
        if not re.match(r"^[a-z0-9][a-z0-9-]*$", slug):
            raise PatchlaneError(f"patch name {slug!r} must be lowercase letters, digits and dashes")
        numbers = [int(m.group(1)) for e in self.entries if (m := PATCH_NAME.match(e.name))]
        return f"{max(numbers, default=0) + 1:04d}-{slug}.patch"

    def write(self, names: list[str]) -> None:
        """Rewrite the series with `names`, keeping its comment and blank lines (export stays byte-identical)."""
        old = self.series_file.read_text().splitlines() if self.series_file.is_file() else []
        pending = list(names)
        lines = []
        for raw in old:
            entry = raw.split("#", 1)[0].strip()
            if not entry:
                lines.append(raw)
            elif pending:
                name = pending.pop(0)
                lines.append(raw if entry == name else name)
        lines += pending
        self.series_file.write_text("".join(f"{line}\n" for line in lines))


def _slug(name: str) -> str:
    match = PATCH_NAME.match(name)
    return match.group(2) if match else name


def slug_from_subject(subject: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    return slug[:48].rstrip("-") or "patch"


def read_series(patches_root: Path, upstream: str) -> Series:
    """Read patches/<upstream>/series. A missing series file is an empty series."""
    directory = patches_root / upstream
    series_file = directory / "series"
    entries = []
    if series_file.is_file():
        for raw in series_file.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if line:
                entries.append(SeriesEntry(name=line, path=directory / line))
    return Series(upstream=upstream, directory=directory, entries=tuple(entries))


def series_problems(series: Series) -> list[str]:
    """Structural problems: missing files, bad names, numbering that disagrees with the order."""
    problems = []
    if not series.series_file.is_file():
        problems.append(f"{series.series_file}: missing (an empty file means an empty series)")
    seen = set()
    for position, entry in enumerate(series.entries, start=1):
        if entry.name in seen:
            problems.append(f"{series.series_file}: {entry.name} is listed twice")
        seen.add(entry.name)
        if not entry.path.is_file():
            problems.append(f"{series.series_file}: names {entry.name}, which does not exist in {series.directory}")
        match = PATCH_NAME.match(entry.name)
        if not match:
            problems.append(f"{series.series_file}: {entry.name!r} is not named NNNN-slug.patch")
        elif int(match.group(1)) != position:
            problems.append(
                f"{series.series_file}: {entry.name} is number {int(match.group(1))} but stands at position {position}"
            )
    if series.directory.is_dir():
        for path in sorted(series.directory.glob("*.patch")):
            if path.name not in seen:
                problems.append(f"{path}: not listed in {series.series_file}")
    return problems
