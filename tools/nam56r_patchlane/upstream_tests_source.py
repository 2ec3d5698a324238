"""Upstream's own tests at the pinned commit: stored in the offline cache by `cache fill`, laid onto a tree by
`upstream-tests`.

Release artifacts lack them (Megatron's sdist has no `tests/`, mamba's only two files of it), so they come from git:
the lock's `git_url`, or any clone or mirror that holds the pinned tag (`cache fill --tests-from NAME=URL_OR_PATH`).
The lock's `[upstream.tests]` pins each test root's git tree id at the pinned commit; the stored archive is checked
against it when it is made, and the tests laid onto a tree are checked again there, whatever served them.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from .artifacts import sha256_file
from .cachemanifest import CacheFile, file_problem, read_manifest
from .errors import PatchlaneError
from .gittree import IDENTITY, UpstreamTree
from .lock import Upstream

TESTS_KIND = "upstream-tests"


def archive_path(upstream: Upstream) -> str:
    """Where the upstream's tests archive lives in the cache, relative to it."""
    return f"{TESTS_KIND}/{upstream.name}-{upstream.commit[:12]}.tar.gz"


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # a caller's GIT_DIR must not redirect it
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env={**env, **IDENTITY})


def _as_git_source(source: str) -> str:
    """A local path as a file:// URL, so that a shallow fetch is shallow there too."""
    path = Path(source)
    return path.resolve().as_uri() if "://" not in source and path.exists() else source


def fill_tests(upstream: Upstream, cache_dir: Path, source: str | None, log=print) -> CacheFile | None:
    """Store the upstream's pinned tests in `cache_dir` (None when the lock pins none). `source`: a git URL or a local
    clone holding the pinned tag; default the lock's `git_url`."""
    if not upstream.tests:
        return None
    dest = cache_dir / archive_path(upstream)
    if dest.is_file():
        problems = _archive_problems(upstream, dest)
        if not problems:
            log(f"  {upstream.name}: upstream tests {dest.name} present and matching the lock's tree ids")
            return _entry(upstream, cache_dir, dest)
        log(f"  {upstream.name}: {dest.name} does not match the lock ({problems[0]}): making it again")
        dest.unlink()
    origin = source or upstream.git_url
    with tempfile.TemporaryDirectory(prefix="patchlane-tests-") as tmp:
        repo = Path(tmp)
        commit = _fetch_tag(upstream, origin, repo)
        problems = _pin_problems(upstream, _root_ids(repo, commit, list(upstream.tests)), commit[:12])
        if problems:
            raise PatchlaneError(f"{upstream.name}: {problems[0]}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        made = _git("archive", "--format=tar.gz", "-o", str(dest), commit, "--", *upstream.tests, cwd=repo)
        if made.returncode != 0:
            raise PatchlaneError(f"{upstream.name}: git archive failed: {made.stderr.strip()}")
    log(f"  {upstream.name}: upstream tests {', '.join(upstream.tests)} at {upstream.tag} from {origin}"
        f" -> {dest} ({dest.stat().st_size / 2**20:.1f} MiB, tree ids verified)")
    return _entry(upstream, cache_dir, dest)


def _fetch_tag(upstream: Upstream, origin: str, repo: Path) -> str:
    """Fetch the upstream's tag from `origin` into a new bare `repo`; its commit, which must be the lock's."""
    _git("init", "--quiet", "--bare", ".", cwd=repo)
    tag_ref = f"refs/tags/{upstream.tag}"
    fetched = _git("fetch", "--quiet", "--depth", "1", "--no-tags", _as_git_source(origin), f"+{tag_ref}:{tag_ref}", cwd=repo)
    if fetched.returncode != 0:
        lines = fetched.stderr.strip().splitlines()
        why = next((line for line in lines if line.startswith("fatal:")), lines[-1] if lines else "git fetch failed")
        raise PatchlaneError(
            f"{upstream.name}: cannot fetch tag {upstream.tag} from {origin} for its upstream tests: {why}",
            f"where {upstream.git_url} is unreachable, name a clone or mirror holding the tag:"
            f" `cache fill ... --tests-from {upstream.name}=PATH_OR_URL`",
        )
    commit = _git("rev-parse", f"{tag_ref}^{{commit}}", cwd=repo).stdout.strip()
    if commit != upstream.commit:
        raise PatchlaneError(f"{upstream.name}: tag {upstream.tag} at {origin} is {commit}, the lock pins {upstream.commit}",
                             "the source's tag moved or is another project: use a source holding the pinned commit")
    return commit


def object_ids_of_tests(upstream: Upstream, roots: list[str], source: str | None) -> dict[str, str]:
    """The git object ids of `roots` at the upstream's tag (which must be its commit), for pinning them in the lock."""
    with tempfile.TemporaryDirectory(prefix="patchlane-tests-") as tmp:
        repo = Path(tmp)
        ids = _root_ids(repo, _fetch_tag(upstream, source or upstream.git_url, repo), roots)
    missing = [root for root, found in ids.items() if not found]
    if missing:
        raise PatchlaneError(f"{upstream.name}: {upstream.tag} has no {', '.join(missing)}", "the test roots moved: pin them by hand")
    return ids


def _entry(upstream: Upstream, cache_dir: Path, dest: Path) -> CacheFile:
    return CacheFile(path=archive_path(upstream), sha256=sha256_file(dest), size=dest.stat().st_size, kind=TESTS_KIND,
                     name=upstream.name, version=upstream.tag)


def _archive_problems(upstream: Upstream, archive: Path) -> list[str]:
    """How the archive's test roots differ from the lock's tree ids (none: it holds exactly the pinned tests)."""
    with tempfile.TemporaryDirectory(prefix="patchlane-tests-") as tmp:
        work = Path(tmp)
        _extract(archive, work)
        _git("init", "--quiet", ".", cwd=work)
        _git("add", "--force", "--all", cwd=work)
        tree = _git("write-tree", cwd=work).stdout.strip()
        return _pin_problems(upstream, _root_ids(work, tree, list(upstream.tests)), "the archive")


def _root_ids(repo: Path, rev: str, roots: list[str]) -> dict[str, str]:
    """The git object id of each root at `rev` in `repo` ("" where it is absent)."""
    return {root: _git("rev-parse", f"{rev}:{root}", cwd=repo).stdout.strip() for root in roots}


def _pin_problems(upstream: Upstream, found: dict[str, str], where: str) -> list[str]:
    """Each test root whose object id (`found` at `where`) is not the lock's."""
    return [f"{root} at {where} is tree {found.get(root) or '(absent)'}, the lock pins {pinned}"
            for root, pinned in upstream.tests.items() if found.get(root) != pinned]


def _extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="tar")


def cached_archive(upstream: Upstream, cache_dir: Path) -> Path:
    """The upstream's tests archive in the cache, checked against the cache's manifest; raises naming the fix."""
    fill = (f"`python tools/apply_patches.py cache fill {cache_dir}` where {upstream.git_url} (or a clone holding tag"
            f" {upstream.tag}, `--tests-from {upstream.name}=PATH`) is reachable, then carry the cache")
    if not upstream.tests:
        raise PatchlaneError(f"{upstream.name}: the lock pins no upstream tests ([upstream.tests])",
                             "add the test roots with their git tree ids at the pinned commit to third_party/upstreams.toml")
    manifest = read_manifest(cache_dir)
    entry = next((f for f in manifest.files if f.path == archive_path(upstream)), None) if manifest else None
    if entry is None:
        raise PatchlaneError(f"{upstream.name}: {cache_dir} holds no upstream tests ({archive_path(upstream)})", fill)
    problem = file_problem(cache_dir, entry)
    if problem:
        raise PatchlaneError(f"{upstream.name}: {problem}", fill)
    return cache_dir / entry.path


def lay_tests(upstream: Upstream, archive: Path, tree: UpstreamTree) -> str:
    """Replace the tree's test roots with the pinned tests and commit them; returns that commit. Raises when the result
    is not the lock's tree ids."""
    for test_root in upstream.tests:
        tree.git("rm", "-r", "--quiet", "--ignore-unmatch", "--", test_root)
    _extract(archive, tree.path)
    tree.git("add", "--force", "--", *upstream.tests)
    commit = tree.commit(f"upstream tests: {' '.join(upstream.tests)} at {upstream.tag}\n", allow_empty=True)
    problems = _pin_problems(upstream, _root_ids(tree.path, commit, list(upstream.tests)), f"{tree.path}")
    if problems:
        raise PatchlaneError(f"{upstream.name}: {problems[0]}",
                             "the cached archive is not the pinned tests: run cache fill again")
    return commit
