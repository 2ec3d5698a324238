"""`upstream-tests`, the work: two trees, the pinned release and the patched series, each with upstream's own tests at
the pinned commit laid on (the patches' test sections applied on the patched side), and pytest over the chosen tests
in both, side by side. The verdicts are upstream_tests_verdict.py's.

The trees are shared clones of the materialized tree in a scratch directory: `third_party/` is never touched. Each
side imports the upstream from its own tree (PYTHONPATH first, ahead of the environment's editable install); a guard
plugin stops the run when an import resolves elsewhere.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .apply import describe_apply_failure, git_apply
from .errors import PatchlaneError
from .gittree import UpstreamTree
from .junit import Case, read_cases
from .lock import Upstream
from .patchfile import PatchFile, read_patch
from .series import read_series
from .upstream_tests_source import lay_tests

GUARD_PLUGIN = "nam56r_patchlane.upstream_tests_guard"
GUARD_EXIT = 17  # upstream_tests_guard's, which imports pytest and so is not imported here
TOOLS_DIR = Path(__file__).resolve().parents[1]
MESSAGE_CHARS = 20000  # enough of a traceback to tell what the failure needs (a CUDA device, TransformerEngine)


@dataclass(frozen=True)
class AppliedUpdate:
    """One series patch on the patched side: its commit there."""

    name: str
    path: Path
    patch: PatchFile
    commit: str

    @property
    def updated_tests(self) -> tuple[str, ...]:
        """The upstream test files the patch updates."""
        return tuple(path for path, _ in self.patch.test_sections())


@dataclass(frozen=True)
class Sides:
    base: UpstreamTree  # the release with the pinned tests laid on
    patched: UpstreamTree
    patches: tuple[AppliedUpdate, ...]


def build_sides(root: Path, upstream: Upstream, source: UpstreamTree, archive: Path, scratch: Path,
                base_includes: tuple[str, ...] = ()) -> Sides:
    """The base and patched trees under `scratch`, from the materialized `source` tree's base commit. The patches named
    in `base_includes` go onto the base side as well (a compatibility patch the release needs on this interpreter)."""
    base_commit = source.base_commit()
    if base_commit is None:
        raise PatchlaneError(f"{source.path} has no base tag", "run `python tools/apply_patches.py build` first")
    entries = read_series(root / "patches", upstream.name).entries
    unknown = sorted(set(base_includes) - {e.name for e in entries})
    if unknown:
        raise PatchlaneError(f"{upstream.name}: --base-includes {unknown} not in its series", f"series: {[e.name for e in entries]}")
    base = source.shared_clone(scratch / "base", base_commit, "release")
    tests_commit = lay_tests(upstream, archive, base)
    patched = base.shared_clone(scratch / "patched", tests_commit, "series")
    for entry in (e for e in entries if e.name in base_includes):
        _apply(upstream, base, entry.path)
    applied = [AppliedUpdate(entry.name, entry.path, *_apply(upstream, patched, entry.path)) for entry in entries]
    return Sides(base=base, patched=patched, patches=tuple(applied))


def _apply(upstream: Upstream, tree: UpstreamTree, path: Path) -> tuple[PatchFile, str]:
    patch = read_patch(path)
    ok, output = git_apply(tree, patch, with_tests=True)
    if not ok:
        details = "; ".join(describe_apply_failure(patch, output))
        raise PatchlaneError(f"{upstream.name}: {path} does not apply onto the release with its tests: {details}",
                             "a test section must apply to the pinned tests: regenerate it against them")
    return patch, tree.commit(patch.commit_message())


def missing_paths(tree: UpstreamTree, paths: list[str]) -> list[str]:
    """The paths (or the files of pytest ids, `file::name`) the tree lacks."""
    return [p for p in paths if not (tree.path / p.split("::", 1)[0]).exists()]


def run_pytest(upstream: Upstream, tree: UpstreamTree, paths: list[str], junit: Path, log_path: Path,
               python: str, timeout_s: float, test_ids: list[str] | None = None,
               extra_env: dict[str, str] | None = None, jobs: int = 1) -> subprocess.Popen:
    """Start pytest over `paths` (or exactly `test_ids`) in `tree`, importing the upstream from it; returns the process.
    With `jobs` > 1, pytest-xdist runs that many workers. The guard plugin gives each pytest process its own
    `MASTER_PORT`."""
    env = {**os.environ, **(extra_env or {}),
           "PYTHONPATH": os.pathsep.join([str(tree.path), str(TOOLS_DIR)]),
           "NAM56R_UPSTREAM_TESTS_TREE": str(tree.path), "NAM56R_UPSTREAM_TESTS_IMPORTS": ",".join(upstream.imports)}
    env.pop("PYTHONSAFEPATH", None)
    command = [python, "-m", "pytest", "-p", "no:cacheprovider", "-p", GUARD_PLUGIN, "-q", "-rN", "--color=no",
               "--continue-on-collection-errors", *(["-n", str(jobs)] if jobs > 1 else []),
               f"--junitxml={junit}", "-o", "junit_family=xunit1", *(test_ids or paths)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(["timeout", "--kill-after=30", str(int(timeout_s)), *command], cwd=tree.path, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
    return process


def finish(process: subprocess.Popen, junit: Path, log_path: Path, side: str) -> dict[str, Case]:
    """Wait for a side's pytest; its outcomes by test id. Raises when it produced none (setup or guard failure)."""
    code = process.wait()
    if code == GUARD_EXIT:
        tail = "\n".join(log_path.read_text().splitlines()[-5:])
        raise PatchlaneError(f"{side}: the import guard stopped pytest:\n{tail}")
    if code == 124 or code == 137:
        raise PatchlaneError(f"{side}: pytest ran past --timeout-s; its log: {log_path}", "raise --timeout-s or select fewer tests")
    if not junit.is_file():
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        raise PatchlaneError(f"{side}: pytest exited {code} without a report; the end of {log_path}:\n{tail}")
    return read_junit(junit)


def read_junit(path: Path) -> dict[str, Case]:
    """pytest's report as {test id: its case}."""
    return {case.id: case for case in read_cases(path, MESSAGE_CHARS)}
