"""Apex's source at the lock's commit, as one archive in the cache: made with `git archive` from the lock's `git_url`
or any clone or mirror holding the commit (`cache fill --apex-from PATH_OR_URL`), and accepted only when its files make
the lock's tree id. Apex publishes no release on PyPI; the commit and its tree id are the pin.

The tree id leaves the commit's submodules out (`git archive` does not descend into them, and the extensions built
here use none), so an archive is checked by unpacking it, adding every file to a scratch index and writing its tree.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from .artifacts import sha256_file
from .cachemanifest import TE_DIR, CacheFile
from .errors import PatchlaneError
from .gittree import IDENTITY
from .te_lock import Apex


def archive_path(apex: Apex) -> str:
    """Where the archive lives in the cache, relative to it."""
    return f"{TE_DIR}/apex-{apex.short}.tar.gz"


def archive_root(apex: Apex) -> str:
    """The folder every member of the archive sits in."""
    return f"apex-{apex.short}"


def _git(*args: str, cwd: Path, index: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # a caller's GIT_DIR must not redirect it
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env={**env, **IDENTITY})


def fill_apex(apex: Apex, cache_dir: Path, source: str | None, log: Callable[[str], None] = print) -> CacheFile:
    """The archive of the pinned commit in `cache_dir`, made from `source` (a git URL or local clone; default the
    lock's git_url) unless a matching one is there."""
    dest = cache_dir / archive_path(apex)
    if dest.is_file():
        problem = archive_problem(apex, dest)
        if problem is None:
            log(f"  apex: {dest.name} present, its files make the lock's tree {apex.tree[:12]}")
            return _entry(apex, dest)
        log(f"  apex: {dest.name} does not match the lock ({problem}): making it again")
        dest.unlink()
    origin = source or apex.git_url
    with tempfile.TemporaryDirectory(prefix="patchlane-apex-") as tmp:
        repo = Path(tmp)
        _fetch_commit(apex, origin, repo)
        tree = tree_without_submodules(repo, apex.commit)
        if tree != apex.tree:
            raise PatchlaneError(f"apex: commit {apex.short} at {origin} makes tree {tree} without its submodules,"
                                 f" the lock pins {apex.tree}", "pin the tree id of that commit in third_party/upstreams.toml")
        dest.parent.mkdir(parents=True, exist_ok=True)
        made = _git("archive", "--format=tar.gz", f"--prefix={archive_root(apex)}/", "-o", str(dest), apex.commit, cwd=repo)
        if made.returncode != 0:
            raise PatchlaneError(f"apex: git archive failed: {made.stderr.strip()}")
    log(f"  apex: {apex.ref} at {apex.short} from {origin} -> {dest} ({dest.stat().st_size / 2**20:.1f} MiB, tree verified)")
    return _entry(apex, dest)


def _fetch_commit(apex: Apex, origin: str, repo: Path) -> None:
    _git("init", "--quiet", "--bare", ".", cwd=repo)
    path = Path(origin)
    url = path.resolve().as_uri() if "://" not in origin and path.exists() else origin  # file://: a shallow fetch stays shallow
    fetched = _git("fetch", "--quiet", "--depth", "1", "--no-tags", url, apex.commit, cwd=repo)
    if fetched.returncode != 0:
        lines = fetched.stderr.strip().splitlines()
        why = next((line for line in lines if line.startswith("fatal:")), lines[-1] if lines else "git fetch failed")
        raise PatchlaneError(f"apex: cannot fetch commit {apex.commit} from {origin}: {why}",
                             f"where {apex.git_url} is unreachable, name a clone or mirror holding it:"
                             " `cache fill DIR --profile gpu-te --apex-from PATH_OR_URL`")


def tree_without_submodules(repo: Path, commit: str) -> str:
    """The tree id of `commit` with its gitlinks removed: what the commit's `git archive` unpacks to."""
    index = repo / "apex-pin.index"
    _git("read-tree", commit, cwd=repo, index=index)
    listed = _git("ls-files", "--stage", cwd=repo, index=index).stdout.splitlines()
    gitlinks = [line.split("\t", 1)[1] for line in listed if line.startswith("160000 ")]
    if gitlinks:
        _git("rm", "--cached", "--quiet", "--", *gitlinks, cwd=repo, index=index)
    tree = _git("write-tree", cwd=repo, index=index).stdout.strip()
    index.unlink(missing_ok=True)
    return tree


def archive_problem(apex: Apex, archive: Path) -> str | None:
    """How the archive differs from the lock's tree (None: its files are exactly the pinned commit's)."""
    with tempfile.TemporaryDirectory(prefix="patchlane-apex-") as tmp:
        work = Path(tmp)
        try:
            extract(archive, work)
        except (tarfile.TarError, OSError) as exc:
            return f"not a readable archive ({exc})"
        top = work / archive_root(apex)
        if not top.is_dir():
            return f"it holds no {archive_root(apex)}/"
        _git("init", "--quiet", ".", cwd=top)
        _git("add", "--force", "--all", cwd=top)
        tree = _git("write-tree", cwd=top).stdout.strip()
    return None if tree == apex.tree else f"its files make tree {tree or '(none)'}, the lock pins {apex.tree}"


def extract(archive: Path, dest: Path) -> Path:
    """Unpack the archive into `dest`; the folder holding the source."""
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="tar")
    return dest


def _entry(apex: Apex, dest: Path) -> CacheFile:
    return CacheFile(path=archive_path(apex), sha256=sha256_file(dest), size=dest.stat().st_size, kind=TE_DIR,
                     name="apex", version=apex.commit)
