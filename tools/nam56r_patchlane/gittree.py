"""One materialized upstream tree: a git repository under third_party/<name>, plus its state file.

The tree's history is `upstream` (tag, the pinned release as committed) followed by one commit per
applied patch on the `patched` branch. The state file (inside .git, so it never dirties the tree)
records where the base came from and which patch file produced which commit.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import git

from .errors import PatchlaneError
from .statefile import state_path

BASE_TAG = "upstream"
BRANCH = "patched"
# Fixed identity and dates make every commit a pure function of its content: the same release and
# the same series give the same commit ids on every machine.
IDENTITY = {
    "GIT_AUTHOR_NAME": "nam56r patchlane",
    "GIT_AUTHOR_EMAIL": "patchlane@nam56r.invalid",
    "GIT_COMMITTER_NAME": "nam56r patchlane",
    "GIT_COMMITTER_EMAIL": "patchlane@nam56r.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
# Build outputs of an editable install: never part of the base, never "uncommitted work".
BUILD_OUTPUTS = ("__pycache__/", "*.py[cod]", "*.egg-info/", "/build/", "/dist/", ".eggs/", "*.so", "*.o")
DIFF_OPTIONS = (
    "--full-index", "--binary", "--no-color", "--no-ext-diff", "--no-renames", "--no-textconv",
    "-U3", "--src-prefix=a/", "--dst-prefix=b/",
)


@dataclass(frozen=True)
class GitResult:
    returncode: int
    stdout: str
    stderr: str


@dataclass
class AppliedPatch:
    name: str
    sha256: str
    commit: str


@dataclass
class TreeState:
    upstream: str
    source: str  # submodule | pypi | cache
    pin: str  # version and commit the base stands for
    artifact_sha256: str
    base_commit: str
    applied: list[AppliedPatch] = field(default_factory=list)

    @classmethod
    def from_json(cls, text: str) -> TreeState:
        raw = json.loads(text)
        raw["applied"] = [AppliedPatch(**a) for a in raw.get("applied", [])]
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


class UpstreamTree:
    """GitPython-backed operations on one tree. Every mutating method assumes the caller checked
    for unsaved work first (see apply.ensure_no_unsaved_work)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.repo = git.Repo(path)
        except (git.InvalidGitRepositoryError, git.NoSuchPathError) as exc:
            raise PatchlaneError(f"{path} is not a git tree") from exc
        if Path(self.repo.working_tree_dir or "").resolve() != path.resolve():
            raise PatchlaneError(f"{path} is inside another git repository, not a tree of its own")

    # -- creation -------------------------------------------------------------------------
    @classmethod
    def init_from_directory(cls, path: Path, message: str) -> UpstreamTree:
        """Turn a directory of release files into a tree whose single commit is the base."""
        git.Repo.init(path, initial_branch=BRANCH)
        tree = cls(path)
        tree.write_excludes()
        tree.git("add", "--all", "--force", "--", ".", *[f":(exclude,glob)**/{p.strip('/')}" for p in ("*.egg-info", "__pycache__")])
        tree.commit(message, allow_empty=False)
        tree.git("tag", BASE_TAG)
        return tree

    def write_excludes(self) -> None:
        exclude = Path(self.repo.git_dir) / "info" / "exclude"
        exclude.parent.mkdir(parents=True, exist_ok=True)
        existing = exclude.read_text() if exclude.exists() else ""
        missing = [p for p in BUILD_OUTPUTS if p not in existing.splitlines()]
        if missing:
            header = "" if "nam56r patchlane" in existing else "# nam56r patchlane: build outputs of editable installs\n"
            exclude.write_text(existing + header + "".join(f"{p}\n" for p in missing))

    # -- plumbing ---------------------------------------------------------------------------
    def git(self, *args: str, stdin: str | None = None, check: bool = True) -> GitResult:
        """Run a git command in the tree through GitPython, with the fixed identity; output kept exact."""
        with tempfile.TemporaryFile("w+") as stdin_file:
            if stdin is not None:
                stdin_file.write(stdin)
                stdin_file.seek(0)
            status, out, err = self.repo.git.execute(
                ["git", *args],
                istream=stdin_file,
                with_extended_output=True,
                with_exceptions=False,
                strip_newline_in_stdout=False,
                env=IDENTITY,
            )
        result = GitResult(returncode=status, stdout=out, stderr=err)
        if check and status != 0:
            raise PatchlaneError(f"git {' '.join(args)} failed in {self.path}:\n{err.strip()}")
        return result

    def commit(self, message: str, allow_empty: bool = False) -> str:
        args = ["commit", "--quiet", "--no-verify", "--cleanup=verbatim", "-F", "-"]
        if allow_empty:
            args.append("--allow-empty")
        self.git(*args, stdin=message)
        return self.head()

    def head(self) -> str:
        return self.repo.head.commit.hexsha

    def shared_clone(self, dest: Path, commit: str, branch: str) -> UpstreamTree:
        """A throwaway tree at `commit` on a new `branch`, sharing this tree's objects (nothing copied)."""
        self.git("clone", "--quiet", "--shared", "--no-checkout", str(self.path), str(dest))
        clone = UpstreamTree(dest)
        clone.git("checkout", "--quiet", "-b", branch, commit)
        return clone

    def has_commit(self, sha: str) -> bool:
        return self.git("cat-file", "-e", f"{sha}^{{commit}}", check=False).returncode == 0

    def base_commit(self) -> str | None:
        try:
            return self.repo.tags[BASE_TAG].commit.hexsha
        except (IndexError, ValueError):
            return None

    def commits_since(self, base: str) -> list[str]:
        out = self.git("rev-list", "--reverse", f"{base}..HEAD").stdout.split()
        return out

    def message(self, sha: str) -> str:
        """The commit message exactly as stored."""
        raw = self.git("cat-file", "commit", sha).stdout
        return raw.split("\n\n", 1)[1] if "\n\n" in raw else ""

    def diff(self, parent: str, sha: str | None = None) -> str:
        args = ["diff", *DIFF_OPTIONS, parent] + ([sha] if sha else [])
        return self.git(*args).stdout

    def dirty_paths(self) -> list[str]:
        out = self.git("status", "--porcelain", "--untracked-files=all").stdout
        return [line[3:] for line in out.splitlines() if line.strip()]

    def reset_hard(self, sha: str) -> None:
        """Point `patched` and the files at `sha`. Callers have checked for (or saved, --discard) unsaved
        work first, so edits and untracked files go; ignored build outputs stay."""
        self.git("checkout", "--quiet", "--force", "-B", BRANCH, sha)
        self.git("reset", "--quiet", "--hard", sha)
        self.git("clean", "--quiet", "--force", "-d")

    def save_ref(self, ref: str) -> str:
        """Keep the current HEAD and any uncommitted edits reachable under `ref` (nothing is lost)."""
        head = self.head()
        if self.dirty_paths():
            self.git("add", "--all")
            tree = self.git("write-tree").stdout.strip()
            snapshot = self.git("commit-tree", tree, "-p", head, "-m", "uncommitted edits saved by --discard").stdout.strip()
            self.git("reset", "--quiet")
        else:
            snapshot = head
        self.git("update-ref", ref, snapshot)
        return snapshot

    # -- state ------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return state_path(Path(self.repo.git_dir))

    def read_state(self) -> TreeState | None:
        if not self.state_path.is_file():
            return None
        return TreeState.from_json(self.state_path.read_text())

    def write_state(self, state: TreeState) -> None:
        self.state_path.write_text(state.to_json())


def is_git_tree(path: Path) -> bool:
    return (path / ".git").exists()
