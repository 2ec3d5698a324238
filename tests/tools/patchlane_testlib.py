"""Helpers of the patch-lane tests (fixtures in conftest.py): a fake upstream with three tagged
versions, a fake sdist for an offline cache, and a test repository root (lock +
patches/fakeup/series) driven in-process through `nam56r_patchlane.cli.main`.

The fake upstream `fakeup` (a git repository in a temporary directory, tags v1, v2, v3):
  v1  the pinned release; also packed as the sdist fakeup-1.0.tar.gz (top-level folder fakeup-1.0/)
  v2  five lines inserted at the top of fakeup/core.py: 0001 applies there with an offset
  v3  v2 plus the change of 0002 (absorbed upstream) and a changed line under 0003 (conflict)

The series written into each test root (all canonical, all applying cleanly to v1):
  0001-core-scale.patch   fakeup/core.py
  0002-util-guard.patch   fakeup/util.py
  0003-io-encoding.patch  fakeup/io.py
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nam56r_patchlane.cli import main
from nam56r_patchlane.gittree import DIFF_OPTIONS
from nam56r_patchlane.patchfile import PatchFile

UPSTREAM = "fakeup"
SDIST = "fakeup-1.0.tar.gz"

INIT_PY = '''\
"""fakeup: a tiny package standing in for a pinned upstream."""

from .core import double, scale
from .io import read_text, write_text
from .util import clamp, first

__all__ = ["clamp", "double", "first", "read_text", "scale", "write_text"]
__version__ = "1.0"
'''

CORE_PY = '''\
"""Core arithmetic of fakeup."""

FACTOR = 2


def double(x):
    """Return x doubled."""
    return x * 2


def triple(x):
    """Return x tripled."""
    return x * 3


def scale(x, factor=None):
    """Scale x by factor (default FACTOR)."""
    if factor is None:
        factor = FACTOR
    result = x * factor
    return result


def negate(x):
    """Return -x."""
    return -x


def identity(x):
    """Return x unchanged."""
    return x
'''

UTIL_PY = '''\
"""Small helpers of fakeup."""


def clamp(value, low, high):
    """Clamp value into [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value


def first(items):
    """The first item of items."""
    return items[0]


def last(items):
    """The last item of items."""
    return items[-1]


def pairs(items):
    """Adjacent pairs of items."""
    return list(zip(items, items[1:]))


def flatten(rows):
    """Flatten a list of lists."""
    return [x for row in rows for x in row]
'''

IO_PY = '''\
"""File helpers of fakeup."""

from pathlib import Path


def read_text(path):
    """Read a whole text file."""
    with open(path) as handle:
        return handle.read()


def write_text(path, text):
    """Write a whole text file."""
    Path(path).write_text(text)


def read_lines(path):
    """Read a text file as lines."""
    return read_text(path).splitlines()


def exists(path):
    """Whether path exists."""
    return Path(path).exists()


def size(path):
    """Size of path in bytes."""
    return Path(path).stat().st_size
'''

V1_FILES = {
    "README.md": "# fakeup\n\nA fake upstream for the patch-lane tests.\n",
    "fakeup/__init__.py": INIT_PY,
    "fakeup/core.py": CORE_PY,
    "fakeup/util.py": UTIL_PY,
    "fakeup/io.py": IO_PY,
}

# The series' edits, as (file, old, new) on v1.
CORE_EDIT = ("fakeup/core.py", "    result = x * factor\n", "    result = x * factor\n    result = round(result, 6)\n")
UTIL_EDIT = ("fakeup/util.py", "    return items[0]\n", "    if not items:\n        return None\n    return items[0]\n")
IO_EDIT = ("fakeup/io.py", "    with open(path) as handle:\n", '    with open(path, encoding="utf-8") as handle:\n')
# v2 moves core.py's lines down by five; v3 also takes UTIL_EDIT and rewrites the line IO_EDIT changes.
V2_CORE_INSERT = ("fakeup/core.py", 'FACTOR = 2\n', 'FACTOR = 2\nOFFSET = 0\n\n\ndef zero():\n    return 0\n')
V3_IO_CHANGE = ("fakeup/io.py", "    with open(path) as handle:\n", '    with open(path, "rb") as handle:\n')

SERIES = {
    "0001-core-scale.patch": ("Round scaled values to six decimals", "perf", CORE_EDIT),
    "0002-util-guard.patch": ("Return None from first() on an empty list", "bugfix", UTIL_EDIT),
    "0003-io-encoding.patch": ("Read text files as UTF-8 whatever the locale", "compat", IO_EDIT),
}


def git(cwd: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr}")
    return proc.stdout


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not unique in {path}"
    path.write_text(text.replace(old, new))


def header_fields(subject: str, category: str = "bugfix", **extra: str) -> list[tuple[str, str]]:
    fields = [
        ("Subject", subject),
        ("Pack", extra.pop("pack", "none")),
        ("Category", category),
        ("Upstream-Status", extra.pop("upstream_status", "not-for-upstream: a test fixture")),
        ("Retire-When", extra.pop("retire_when", "upstream fixes it")),
        ("Reproducer", extra.pop("reproducer", "none")),
        ("Upstream-Tests", extra.pop("upstream_tests", "none: a test fixture")),
    ]
    assert not extra, extra
    return fields


def patch_text(subject: str, category: str, diff: str, description: str | None = None, **extra: str) -> str:
    """A canonical patch file's text (as `export` writes it) for `diff`."""
    description = description or f"Why: {subject.lower()}."
    return PatchFile(fields=header_fields(subject, category, **extra), description=description, diff=diff).to_text()


def diff_for(files: dict[str, str], changes: list[tuple[str, str, str]], *options: str) -> str:
    """The diff (the tool's canonical options unless `options` are given) that applies `changes` to `files`;
    a change to a path not in `files` creates that file."""
    with tempfile.TemporaryDirectory(prefix="patchlane-diff-") as tmp:
        scratch = Path(tmp)
        write_files(scratch, files)
        git(scratch, "init", "--quiet")
        git(scratch, "add", "--all")
        for rel, old, new in changes:
            if rel in files:
                edit(scratch / rel, old, new)
            else:  # a new file: `old` is ignored
                write_files(scratch, {rel: new})
                git(scratch, "add", "--intent-to-add", rel)
        return git(scratch, "diff", *(options or DIFF_OPTIONS))


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(frozen=True)
class FakeUpstream:
    """The fake upstream's git repository and the commits of its tags."""

    path: Path
    commits: dict[str, str]  # tag -> commit
    sdist: Path  # fakeup-1.0.tar.gz of v1
    series: dict[str, str]  # patch file name -> canonical text

    @property
    def pinned(self) -> str:
        return self.commits["v1"]



def _apply_changes(files: dict[str, str], changes: list[tuple[str, str, str]]) -> dict[str, str]:
    out = dict(files)
    for rel, old, new in changes:
        assert out[rel].count(old) == 1, f"{old!r} is not unique in {rel}"
        out[rel] = out[rel].replace(old, new)
    return out


VERSIONS = {
    "v1": V1_FILES,
    "v2": _apply_changes(V1_FILES, [V2_CORE_INSERT]),
    "v3": _apply_changes(V1_FILES, [V2_CORE_INSERT, UTIL_EDIT, V3_IO_CHANGE]),
}


def make_fake_upstream(base: Path) -> FakeUpstream:
    """The fake upstream repository (tags v1..v3), the sdist of v1 and the canonical series texts."""
    repo = base / "fakeup"
    repo.mkdir(parents=True)
    git(repo, "init", "--quiet")
    commits = {}
    for tag, files in VERSIONS.items():
        write_files(repo, files)
        git(repo, "add", "--all")
        git(repo, "commit", "--quiet", "-m", f"fakeup {tag}")
        git(repo, "tag", tag)
        commits[tag] = git(repo, "rev-parse", "HEAD").strip()

    # The sdist: the v1 tree under one top-level folder, as `tar czf` makes it.
    staging = base / "sdist"
    write_files(staging / "fakeup-1.0", V1_FILES)
    sdist = base / SDIST
    subprocess.run(["tar", "czf", str(sdist), "-C", str(staging), "fakeup-1.0"], check=True)

    series = {name: patch_text(subject, category, diff_for(V1_FILES, [change])) for name, (subject, category, change) in SERIES.items()}
    return FakeUpstream(path=repo, commits=commits, sdist=sdist, series=series)


def lock_text(fake: FakeUpstream, sha256: str, install: str = "editable") -> str:
    return f'''\
schema = 1

[environment]
torch = "torch"
torch_min = "0"
build = []
runtime = []

[[upstream]]
name = "{UPSTREAM}"
git_url = "https://example.invalid/fakeup.git"
tag = "v1"
commit = "{fake.pinned}"
pypi = "fakeup"
version = "1.0"
install = "{install}"
imports = ["fakeup"]

[[upstream.artifact]]
filename = "{SDIST}"
sha256 = "{sha256}"
'''


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


class Lane:
    """A test repository root plus the CLI driven in-process with captured output."""

    def __init__(self, root: Path, cache: Path, fake: FakeUpstream) -> None:
        self.root = root
        self.cache = cache
        self.fake = fake

    @property
    def patches(self) -> Path:
        return self.root / "patches" / UPSTREAM

    @property
    def tree(self) -> Path:
        return self.root / "third_party" / UPSTREAM

    @property
    def series_file(self) -> Path:
        return self.patches / "series"

    def series_names(self) -> list[str]:
        return [line.strip() for line in self.series_file.read_text().splitlines() if line.strip() and not line.startswith("#")]

    def write_series(self, names: list[str], texts: dict[str, str] | None = None) -> None:
        """Make patches/fakeup hold exactly `names` (texts default to the fixture's series), listed in series."""
        texts = self.fake.series if texts is None else texts
        self.patches.mkdir(parents=True, exist_ok=True)
        for stale in self.patches.glob("*.patch"):
            if stale.name not in names:
                stale.unlink()
        for name in names:
            if name in texts:
                (self.patches / name).write_text(texts[name])
        self.series_file.write_text("".join(f"{n}\n" for n in names))

    @staticmethod
    def main(argv: list[str]) -> Result:
        """`apply_patches.py ARGV...` in-process: exit code and captured output."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        return Result(code, out.getvalue(), err.getvalue())

    def run(self, *args: str, offline: bool = True) -> Result:
        """`apply_patches.py --root ROOT --cache CACHE --python THIS [--offline] ARGS...`."""
        argv = ["--root", str(self.root), "--cache", str(self.cache), "--python", sys.executable]
        if offline:
            argv.append("--offline")
        return self.main([*argv, *args])

    def build(self, *args: str) -> Result:
        return self.run("build", "--no-install", "--profile", "cpu", *args)

    def git(self, *args: str, check: bool = True) -> str:
        return git(self.tree, *args, check=check)

    def head(self) -> str:
        return self.git("rev-parse", "HEAD").strip()

    def log(self) -> list[str]:
        """Commit ids from the base's child to HEAD, oldest first."""
        return self.git("rev-list", "--reverse", "upstream..HEAD").split()

    def message(self, rev: str) -> str:
        """The commit message exactly as stored."""
        return self.git("cat-file", "commit", rev).split("\n\n", 1)[1]

    def status_porcelain(self) -> str:
        return self.git("status", "--porcelain", "--untracked-files=all")

    def state(self) -> dict:
        return json.loads((self.tree / ".git" / "nam56r-patchlane.json").read_text())

    def clone_submodule(self, at: str | None = None) -> None:
        """A checkout of the fake upstream at the pinned commit where the tree goes (the submodule case)."""
        self.tree.parent.mkdir(parents=True, exist_ok=True)
        git(self.root, "clone", "--quiet", str(self.fake.path), str(self.tree))
        self.git("checkout", "--quiet", "--detach", at or self.fake.pinned)


def other_identity(monkeypatch) -> None:
    """Another author, committer and clock in the environment: the tool's commits must not depend on them."""
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "someone else")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "else@example.invalid")
        monkeypatch.setenv(f"GIT_{role}_DATE", "2031-07-08T09:10:11+0200")


def make_lane(root: Path, cache: Path, fake: FakeUpstream) -> Lane:
    """A repository root: the lock (pinning v1 and the sdist's sha256) and patches/fakeup with the series."""
    (root / "third_party").mkdir(parents=True)
    (root / "third_party" / "upstreams.toml").write_text(lock_text(fake, sha256_of(fake.sdist)))
    lane = Lane(root, cache, fake)
    lane.write_series(list(fake.series))
    return lane
