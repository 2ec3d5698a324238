"""`check`, the CI gate: every series applies with zero fuzz and no offset to a fresh base, every
header is complete and valid, numbering and `series` agree, no patch is empty, exporting the
applied series reproduces every committed patch file byte for byte, the superproject's
submodule gitlinks record the lock's commits, and every patch has a valid filing pack or says why
it is never filed (patches/packs/README.md)."""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path

from .apply import HUNK_OFFSET, describe_apply_failure, export_commit, git_apply
from .errors import PatchlaneError
from .gittree import BASE_TAG, UpstreamTree, is_git_tree
from .lock import Lock, Upstream
from .materialize import materialize_upstream
from .packs.pack import coverage_problems, load_packs, pack_problems
from .patchfile import read_patch, validate_header
from .series import read_series, series_problems
from .superproject import gitlink_problems
from .upstream_tests_source import cached_archive


def _fresh_base(root: Path, upstream: Upstream, cache_dir: Path, offline: bool, python: str, scratch: Path, log) -> UpstreamTree:
    """A throwaway tree at the base: a shared clone of the materialized tree, or a new materialization."""
    source = root / upstream.path
    dest = scratch / upstream.name
    if is_git_tree(source) and UpstreamTree(source).base_commit():
        tree = UpstreamTree(source)
        return tree.shared_clone(dest, tree.base_commit(), "check")
    log(f"  {upstream.name}: not materialized; materializing its base in a scratch directory")
    return materialize_upstream(root, upstream, cache_dir, offline, python, log, dest=dest).tree


def declared_tests_problems(upstream: Upstream, cache_dir: Path, entries: list, log) -> list[str]:
    """Each `Upstream-Tests` path that the pinned tests lack, when the cache holds them (else said, and not checked)."""
    if not upstream.tests:
        return []
    try:
        archive = cached_archive(upstream, cache_dir)
    except PatchlaneError:
        log(f"  {upstream.name}: Upstream-Tests paths not checked against the tests: {cache_dir} holds none (cache fill stores them)")
        return []
    with tarfile.open(archive) as tar:
        names = {member.name.rstrip("/") for member in tar.getmembers()}
    directories = {"/".join(name.split("/")[:i]) for name in names for i in range(1, name.count("/") + 1)}
    return [f"{entry.path}: Upstream-Tests {path!r} is not in {upstream.name}'s tests at {upstream.tag}"
            for entry in entries for path in read_patch(entry.path).declared_tests() if path not in names | directories]


def check_upstream(root: Path, upstream: Upstream, cache_dir: Path, offline: bool, python: str, log=print) -> list[str]:
    series = read_series(root / "patches", upstream.name)
    problems = series_problems(series)
    entries = [e for e in series.entries if e.path.is_file()]
    for entry in entries:
        try:
            patch = read_patch(entry.path)
        except PatchlaneError as exc:
            problems.append(str(exc))
            continue
        problems += validate_header(patch, str(entry.path), root)
    if upstream.install == "wheel" and series.entries:
        problems.append(f"{upstream.name}: install = \"wheel\" in the lock, but the series has patches (needs \"editable\")")
    if problems or not entries:
        return problems
    problems += declared_tests_problems(upstream, cache_dir, entries, log)
    with tempfile.TemporaryDirectory(prefix="patchlane-check-") as tmp:
        tree = _fresh_base(root, upstream, cache_dir, offline, python, Path(tmp), log)
        parent = tree.head()
        for entry in entries:
            patch = read_patch(entry.path)
            ok, output = git_apply(tree, patch)
            if not ok:
                problems += [f"{entry.path}: does not apply to the base: {d}" for d in describe_apply_failure(patch, output)]
                break
            offsets = HUNK_OFFSET.findall(output)  # not `"offset" in output`: --verbose also prints file names
            if offsets:
                problems.append(f"{entry.path}: applies only with offsets ({len(offsets)} hunk(s)); refresh it")
            commit = tree.commit(patch.commit_message(), allow_empty=not patch.code_diff())
            if export_commit(tree, commit, parent, patch) != entry.path.read_text():
                problems.append(f"{entry.path}: not in canonical form (export would rewrite it);"
                                f" run `apply_patches.py export -u {upstream.name}`")
            parent = commit
        log(f"  {upstream.name}: {len(entries)} patch(es) checked against a fresh `{BASE_TAG}` base")
    return problems


def run_ci_gate(lock: Lock, root: Path, cache_dir: Path, offline: bool, python: str, only: list[str] | None, log=print) -> int:
    """`check`: every problem of the gitlinks, the packs and each selected upstream's series, named; 0 when there is none."""
    all_problems = gitlink_problems(root, lock, only)
    log(f"gitlinks: {'ok' if not all_problems else f'{len(all_problems)} problem(s)'}")
    packs = coverage_problems(root, lock) + [p for pack in load_packs(root) for p in pack_problems(pack, root, lock)]
    log(f"packs: {'ok' if not packs else f'{len(packs)} problem(s)'}")
    all_problems += packs
    for upstream in lock.select(only):
        problems = check_upstream(root, upstream, cache_dir, offline, python, log)
        status = "ok" if not problems else f"{len(problems)} problem(s)"
        log(f"{upstream.name}: {status}")
        all_problems += problems
    for problem in all_problems:
        log(f"  ERROR {problem}")
    log("check: passed" if not all_problems else f"check: FAILED with {len(all_problems)} problem(s)")
    return 0 if not all_problems else 1
