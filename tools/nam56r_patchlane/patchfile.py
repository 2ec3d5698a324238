"""The patch file format and its header rules.

A patch file is, byte for byte:

    Subject: <one line>
    Pack: <id or none>
    Category: <one of CATEGORIES>
    Upstream-Status: <see UPSTREAM_STATUS>
    Retire-When: <condition>
    Reproducer: <repo-relative path or none>
    Upstream-Tests: <upstream test files or directories covering it, space-separated, or none: reason>
    <any further Key: value lines, kept as written>

    <why this patch exists: free text, one or more paragraphs>
    ---
    diff --git a/... b/...            (git diff --full-index output)

The commit a patch becomes carries the same text as its message: the subject, a blank line, the
other header lines, a blank line, the description. `export` turns it back into exactly the file.

Sections of the diff under `tests/` or `test/` update upstream's own tests, as the upstream PR would.
Release artifacts do not carry those tests, so the materialized trees take a patch's other sections only,
and `export` keeps the file's test sections; `upstream-tests` applies them whole onto the pinned tests.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchlaneError

REQUIRED_FIELDS = ("Subject", "Pack", "Category", "Upstream-Status", "Retire-When", "Reproducer", "Upstream-Tests")
TEST_DIRS = ("tests", "test")
CATEGORIES = ("bugfix", "memory", "perf", "cuda-graph", "dispatch", "compat", "integration")
_PACK = re.compile(r"^(none|[0-9]{2}-[a-z0-9][a-z0-9-]*)$")
_URL = r"https://\S+"
UPSTREAM_STATUS = (
    re.compile(r"^not-filed$"),
    re.compile(rf"^filed {_URL}$"),
    re.compile(rf"^comment-on {_URL}$"),
    re.compile(r"^fixed-in \S.*$"),
    re.compile(r"^not-for-upstream: \S.*$"),
)
_FIELD_LINE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*): (.*)$")
DIFF_START = "diff --git "
SEPARATOR = "---"


@dataclass
class PatchFile:
    """A parsed patch: ordered header fields, the description and the diff text."""

    fields: list[tuple[str, str]]
    description: str
    diff: str

    def get(self, key: str) -> str | None:
        for name, value in self.fields:
            if name == key:
                return value
        return None

    @property
    def subject(self) -> str:
        return self.get("Subject") or ""

    def to_text(self) -> str:
        header = "".join(f"{k}: {v}\n" for k, v in self.fields)
        return f"{header}\n{self.description.rstrip()}\n{SEPARATOR}\n{self.diff}"

    def commit_message(self) -> str:
        rest = "".join(f"{k}: {v}\n" for k, v in self.fields if k != "Subject")
        return f"{self.subject}\n\n{rest}\n{self.description.rstrip()}\n"

    def touched_files(self) -> list[str]:
        return [line.split(" b/", 1)[1] for line in self.diff.splitlines() if line.startswith(DIFF_START)]

    def sections(self) -> list[tuple[str, str]]:
        """The diff per file, in order: (path, its `diff --git` section)."""
        return diff_sections(self.diff)

    def code_diff(self) -> str:
        """The diff without the sections that update upstream's tests."""
        return "".join(text for path, text in self.sections() if not is_test_path(path))

    def test_sections(self) -> list[tuple[str, str]]:
        return [(path, text) for path, text in self.sections() if is_test_path(path)]

    def declared_tests(self) -> tuple[str, ...]:
        """`Upstream-Tests`: the upstream test paths covering this patch (empty for `none: reason`)."""
        value = (self.get("Upstream-Tests") or "").strip()
        return () if value.startswith("none:") else tuple(value.split())


def is_test_path(path: str) -> bool:
    """A path in upstream's own tests (`tests/...` or `test/...`)."""
    return path.split("/", 1)[0] in TEST_DIRS and "/" in path


def diff_sections(diff: str) -> list[tuple[str, str]]:
    sections: list[tuple[str, str]] = []
    for chunk in diff.split(f"\n{DIFF_START}"):
        text = chunk if chunk.startswith(DIFF_START) else DIFF_START + chunk
        if not chunk.strip():
            continue
        path = text.split("\n", 1)[0].split(" b/", 1)[1]
        sections.append((path, text if text.endswith("\n") else text + "\n"))
    return sections


def merge_sections(diff: str, kept: list[tuple[str, str]]) -> str:
    """`diff` with the `kept` sections of files it lacks, in git's path order."""
    if not kept:
        return diff
    sections = dict(diff_sections(diff)) if diff else {}
    for path, text in kept:
        sections.setdefault(path, text)
    return "".join(sections[path] for path in sorted(sections, key=lambda p: p.encode()))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _parse_header_block(lines: list[str], where: str) -> tuple[list[tuple[str, str]], int]:
    fields: list[tuple[str, str]] = []
    index = 0
    while index < len(lines) and lines[index].strip():
        match = _FIELD_LINE.match(lines[index])
        if not match:
            raise PatchlaneError(f"{where}: header line {index + 1} is not 'Key: value': {lines[index]!r}")
        fields.append((match.group(1), match.group(2).strip()))
        index += 1
    return fields, index


def parse_patch_text(text: str, where: str) -> PatchFile:
    """Parse a patch file's text. Raises with the file name and line on malformed input."""
    head, sep, diff_rest = text.partition(f"\n{DIFF_START}")
    if not sep:
        raise PatchlaneError(f"{where}: no 'diff --git' section: the patch is empty", "drop it from the series or refresh it")
    diff = DIFF_START + diff_rest
    lines = head.split("\n")
    if not lines or lines[-1] != SEPARATOR:
        raise PatchlaneError(f"{where}: the line before the first 'diff --git' must be '---'")
    fields, end = _parse_header_block(lines[:-1], where)
    description = "\n".join(lines[end + 1 : -1]).strip("\n")
    return PatchFile(fields=fields, description=description, diff=diff)


def parse_commit_message(message: str, where: str) -> tuple[list[tuple[str, str]], str]:
    """Inverse of PatchFile.commit_message: (fields, description)."""
    subject, _, rest = message.partition("\n")
    rest = rest.lstrip("\n")
    fields, end = _parse_header_block(rest.split("\n"), where)
    description = "\n".join(rest.split("\n")[end + 1 :]).strip("\n")
    return [("Subject", subject.strip())] + fields, description


def read_patch(path: Path) -> PatchFile:
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise PatchlaneError(f"patch file {path} does not exist") from exc
    return parse_patch_text(text, str(path))


def validate_header(patch: PatchFile, where: str, repo_root: Path | None = None) -> list[str]:
    """Every problem with the header, as messages naming the field and the offending value."""
    problems = []
    names = [k for k, _ in patch.fields]
    for key in REQUIRED_FIELDS:
        count = names.count(key)
        if count == 0:
            problems.append(f"{where}: missing header field {key!r}")
        elif count > 1:
            problems.append(f"{where}: header field {key!r} appears {count} times")
    if problems:
        return problems
    if not patch.subject:
        problems.append(f"{where}: Subject is empty")
    pack = patch.get("Pack") or ""
    if not _PACK.match(pack):
        problems.append(f"{where}: Pack {pack!r} is not 'none' or an id like '03-dsa-index-memory'")
    category = patch.get("Category") or ""
    if category not in CATEGORIES:
        problems.append(f"{where}: Category {category!r} is not one of {', '.join(CATEGORIES)}")
    status = patch.get("Upstream-Status") or ""
    if not any(p.match(status) for p in UPSTREAM_STATUS):
        problems.append(
            f"{where}: Upstream-Status {status!r} is not one of: not-filed | filed URL | comment-on URL"
            " | fixed-in VERSION | not-for-upstream: reason"
        )
    if not (patch.get("Retire-When") or "").strip():
        problems.append(f"{where}: Retire-When is empty (say when this patch can be deleted)")
    reproducer = patch.get("Reproducer") or ""
    if reproducer != "none" and repo_root is not None and not (repo_root / reproducer).is_file():
        problems.append(f"{where}: Reproducer {reproducer!r} is not a file in the repository (or write 'none')")
    problems += _upstream_tests_problems(patch.get("Upstream-Tests") or "", where)
    if not patch.description.strip():
        problems.append(f"{where}: no description: say why the patch exists")
    return problems


def _upstream_tests_problems(value: str, where: str) -> list[str]:
    if value.startswith("none:"):
        return [] if value[5:].strip() else [f"{where}: Upstream-Tests 'none:' needs a reason (why no upstream test covers it)"]
    paths = value.split()
    if not paths:
        return [f"{where}: Upstream-Tests is empty: name the upstream test files or directories covering the patch,"
                " or write 'none: reason'"]
    return [f"{where}: Upstream-Tests {path!r} is not a relative path under {' or '.join(TEST_DIRS)}/"
            for path in paths if not is_test_path(path) or path.startswith("/") or ".." in path.split("/")]
