"""`bump -u NAME --to VERSION --tag TAG --commit SHA`: move an upstream's pin in one command. The gates run on a
candidate checkout (a shared clone of this one at HEAD, with the new pin written in), and this checkout's lock and
gitlink are rewritten only when every gate passes:

  series   every patch applies clean to the new release (rebase's classification of each)
  tests    upstream's own tests at the new tag, fetched from git (the lock's `git_url` or `--tests-from`), pinned
  check    the CI gate, in the candidate
  upstream `upstream-tests` in the candidate: no unexplained regression (CUDA hidden)
  suite    the CPU suite in the candidate (`--suite CMD`, default `python3 -m nox -s tests`); `--no-suite` runs it not,
           and then nothing is rewritten

The GPU gate, `nox -s gpu-check` on a GPU node, runs at the commit that holds the new pin.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .artifacts import pip_download, sha256_file
from .cachemanifest import CacheFile, CacheManifest, CacheTarget
from .console import format_table
from .errors import PatchlaneError
from .gittree import IDENTITY, UpstreamTree
from .lock import LOCK_RELATIVE_PATH, Artifact, Lock, Upstream, load_lock
from .materialize import unpack_archive
from .rebase import CLEAN, classify
from .series import read_series
from .upstream_tests_source import fill_tests, object_ids_of_tests

TOOL = Path(__file__).resolve().parents[1] / "apply_patches.py"


@dataclass(frozen=True)
class BumpOptions:
    root: Path
    name: str
    version: str
    tag: str
    commit: str
    python: str  # the target interpreter (pytest runs in it)
    artifact: Path | None = None  # the new release's artifact; default: pip downloads it
    tests_from: str | None = None
    suite: str | None = "python3 -m nox -s tests"  # None: not run, and then nothing is rewritten
    base_includes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Gate:
    name: str
    passed: bool
    detail: str


def run_bump(lock: Lock, options: BumpOptions, log=print) -> int:
    _refuse_unsaved(options.root)
    old = lock.get(options.name)
    with tempfile.TemporaryDirectory(prefix=f"bump-{old.name}-") as tmp:
        scratch = Path(tmp)
        artifact = _artifact(old, options, scratch / "download")
        new = dataclasses.replace(old, tag=options.tag, commit=options.commit, version=options.version,
                                  artifacts=(Artifact(artifact.name, sha256_file(artifact)),))
        log(f"bump {old.name}: {old.version} ({old.commit[:12]}) -> {new.version} ({new.commit[:12]}), {artifact.name}")
        gates = [_series_gate(options.root, new, artifact, scratch / "rebase")]
        if gates[-1].passed and old.tests:
            new, gate = _tests_gate(old, new, options.tests_from)
            gates.append(gate)
        if all(g.passed for g in gates):
            gates += _candidate_gates(options, new, artifact, scratch, log)
    log(format_table(["gate", "result", "detail"], [[g.name, "passed" if g.passed else "FAILED", g.detail] for g in gates]))
    if options.suite is None:
        log("the CPU suite did not run (--no-suite): the lock is not rewritten")
        return 1
    if not all(g.passed for g in gates):
        log(f"bump {old.name}: a gate failed; the lock is not rewritten")
        return 1
    _rewrite(options.root, old, new)
    log(f"bump {old.name}: {LOCK_RELATIVE_PATH} and the gitlink now pin {new.version}; commit them, then run"
        " `nox -s gpu-check` on a GPU node at that commit")
    return 0


def _refuse_unsaved(root: Path) -> None:
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True)
    if status.returncode != 0:
        raise PatchlaneError(f"{root} is not a git checkout: the gates run on a clone of its HEAD")
    if status.stdout.strip():
        raise PatchlaneError(f"{root} has uncommitted changes: the gates run on a clone of HEAD, which lacks them",
                             "commit or stash them first")


def _artifact(old: Upstream, options: BumpOptions, dest: Path) -> Path:
    if options.artifact is not None:
        if not options.artifact.is_file():
            raise PatchlaneError(f"--artifact {options.artifact}: no such file")
        return options.artifact
    dest.mkdir(parents=True)
    pip_download(options.python, f"{old.pypi}=={options.version}", old.install == "wheel", dest, old)
    files = list(dest.iterdir())
    if len(files) != 1:
        raise PatchlaneError(f"expected one artifact for {old.pypi}=={options.version}, got {[f.name for f in files]}")
    return files[0]


def _series_gate(root: Path, new: Upstream, artifact: Path, dest: Path) -> Gate:
    dest.mkdir(parents=True)
    unpack_archive(artifact, dest)
    tree = UpstreamTree.init_from_directory(dest, f"bump base: {new.pypi}=={new.version}\n")
    reports = [classify(tree, entry.path) for entry in read_series(root / "patches", new.name).entries]
    bad = [f"{r.name}: {r.result}{f' ({r.detail})' if r.detail else ''}" for r in reports if r.result != CLEAN]
    return Gate("series", not bad, "; ".join(bad) if bad else f"{len(reports)} of {len(reports)} apply clean")


def _tests_gate(old: Upstream, new: Upstream, source: str | None) -> tuple[Upstream, Gate]:
    try:
        ids = object_ids_of_tests(new, list(old.tests), source)
    except PatchlaneError as exc:
        return new, Gate("tests", False, str(exc))
    return dataclasses.replace(new, tests=ids), Gate("tests", True, f"{', '.join(ids)} pinned at {new.tag}")


def _candidate_gates(options: BumpOptions, new: Upstream, artifact: Path, scratch: Path, log) -> list[Gate]:
    candidate, cache = scratch / "candidate", scratch / "cache"
    subprocess.run(["git", "clone", "--quiet", "--shared", str(options.root), str(candidate)], check=True)
    old_text = (candidate / LOCK_RELATIVE_PATH).read_text()
    (candidate / LOCK_RELATIVE_PATH).write_text(rewrite_lock_text(old_text, load_lock(candidate).get(new.name), new))
    _set_gitlink(candidate, new)
    subprocess.run(["git", "commit", "--quiet", "--no-verify", "-a", "-m", f"bump {new.name} to {new.version}"], cwd=candidate,
                   env={**os.environ, **IDENTITY}, check=True)  # check compares the gitlinks HEAD records with the lock
    cache.mkdir()
    (cache / artifact.name).write_bytes(artifact.read_bytes())
    files = [CacheFile(artifact.name, sha256_file(artifact), artifact.stat().st_size, "artifact", new.pypi, new.version)]
    if new.tests:
        entry = fill_tests(new, cache, options.tests_from, log=lambda _line: None)
        files += [entry] if entry else []
    CacheManifest(CacheTarget(f"{sys.version_info.major}.{sys.version_info.minor}", (), "cpu", ()), {}, tuple(files)).write(cache)
    own = candidate / "tools" / TOOL.name  # the checkout's own tool; a root without one (a test's) gets this one
    tool = [sys.executable, str(own if own.is_file() else TOOL), "--root", str(candidate), "--cache", str(cache),
            "--offline", "--python", options.python]
    gates = [_command_gate("check", [*tool, "check", new.name], candidate, log)]
    if new.tests and gates[-1].passed:
        build = subprocess.run([*tool, "build", "--no-install", "--profile", "cpu", new.name], capture_output=True, text=True)
        if build.returncode != 0:
            return [*gates, Gate("upstream", False, f"the candidate's build failed: {build.stdout[-400:]}{build.stderr[-400:]}")]
        base = [arg for name in options.base_includes for arg in ("--base-includes", name)]
        gates.append(_command_gate("upstream", [*tool, "upstream-tests", "-u", new.name, "--no-record", "--out",
                                                str(scratch / "upstream-tests"), *base], candidate, log))
    if options.suite is not None and all(g.passed for g in gates):
        gates.append(_command_gate("suite", shlex.split(options.suite), candidate, log))
    return gates


def _command_gate(name: str, command: list[str], cwd: Path, log) -> Gate:
    log(f"  gate {name}: {shlex.join(command)}")
    run = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
    return Gate(name, run.returncode == 0, f"exit {run.returncode}: {' | '.join(tail)[:300]}")


def _set_gitlink(root: Path, upstream: Upstream) -> None:
    """Point third_party/<name>'s gitlink at the new commit, where the checkout records one."""
    path = upstream.path.as_posix()
    staged = subprocess.run(["git", "ls-files", "--stage", "--", path], cwd=root, capture_output=True, text=True).stdout.split()
    if staged and staged[0] == "160000":
        subprocess.run(["git", "update-index", "--cacheinfo", f"160000,{upstream.commit},{path}"], cwd=root, check=True)
        subprocess.run(["git", "update-index", "--skip-worktree", "--", path], cwd=root, check=True)


def rewrite_lock_text(text: str, old: Upstream, new: Upstream) -> str:
    """The lock's text with `old`'s pin replaced by `new`'s (tag, commit, version, artifact, test ids), comments kept."""
    start = text.index(f'name = "{old.name}"')
    end = text.find("\n[[upstream]]", start)
    end = len(text) if end < 0 else end
    block = text[start:end]
    replacements = [(f'tag = "{old.tag}"', f'tag = "{new.tag}"'), (f'commit = "{old.commit}"', f'commit = "{new.commit}"'),
                    (f'version = "{old.version}"', f'version = "{new.version}"'),
                    (f'filename = "{old.artifact().filename}"', f'filename = "{new.artifact().filename}"'),
                    (f'sha256 = "{old.artifact().sha256}"', f'sha256 = "{new.artifact().sha256}"')]
    replacements += [(f'"{root}" = "{old.tests[root]}"', f'"{root}" = "{new.tests[root]}"') for root in old.tests]
    for before, after in replacements:
        if block.count(before) != 1:
            raise PatchlaneError(f"the lock's {old.name} block does not hold {before!r} once", "edit the lock by hand")
        block = block.replace(before, after)
    return text[:start] + block + text[end:]


def _rewrite(root: Path, old: Upstream, new: Upstream) -> None:
    path = root / LOCK_RELATIVE_PATH
    text = rewrite_lock_text(path.read_text(), old, new)
    path.write_text(text)
    written = load_lock(root).get(new.name)
    if (written.tag, written.commit, written.version, written.artifact(), written.tests) != (
            new.tag, new.commit, new.version, new.artifact(), new.tests):
        raise PatchlaneError(f"{path}: the rewritten lock does not read back as the new pin", "restore it with git checkout")
    _set_gitlink(root, new)
