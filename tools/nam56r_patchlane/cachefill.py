"""`cache fill DIR`: on a machine that reaches a package index, gather everything an `--offline` build
(and nox with its sessions) needs on a machine that does not, for a named interpreter and platform.

  pinned artifacts   the lock's sdists/wheels, sha256-verified against the lock
  corpus/            the releases the pinned training corpus is made of (the lock's [[corpus]]), sha256-verified
  upstream-tests/    each upstream's own tests at the pinned commit, from git, checked against the lock's
                     tree ids (upstream_tests_source.py); `--tests-from NAME=PATH` names a clone to take them from
  te/                profile gpu-te: TransformerEngine's pinned files through pip and Apex's source from git at the
                     lock's commit (`--apex-from PATH_OR_URL` names a clone), each checked against the lock
  wheels/            [environment] build + runtime + profile lists, every upstream's runtime list,
                     torch for the cpu profile (the gpu profile uses the node's own CUDA torch), the
                     lock's [nox] lists and pyproject extras, nox itself, TE's runtime list (gpu-te); with their
                     dependencies
  nam56r-cache.json  the manifest: files, sha256, sizes, target

A second run with the same lock and target re-verifies what is there and downloads nothing;
--refresh resolves again (newer releases of unpinned requirements) and removes files no longer needed.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from .artifacts import download_corpus_release, fetch_artifact, sha256_file
from .cachemanifest import (
    CORPUS_DIR,
    MANIFEST_NAME,
    MIB,
    WHEELS_DIR,
    CacheFile,
    CacheManifest,
    CacheTarget,
    file_problem,
    read_manifest,
    size_table,
)
from .console import StepProgress, format_table
from .errors import PatchlaneError
from .lock import Lock
from .te_lock import TE_PROFILE, TeLock, base_profile
from .te_sources import fill_te_sources, te_requirement_problems
from .upstream_tests_source import fill_tests
from .wheelhouse import ResolvedWheel, canonical, closure, download, resolve
from .wheeltarget import WheelTarget


@dataclass(frozen=True)
class FillOptions:
    root: Path
    cache_dir: Path
    target: WheelTarget
    exclude: tuple[str, ...]  # besides torch for the gpu profile
    only: list[str] | None
    refresh: bool
    artifacts_only: bool
    extra: tuple[str, ...] = ()  # --wheels: more requirements to carry
    tests_from: dict[str, str] | None = None  # upstream name -> git URL or clone with the pinned tag; None: no upstream tests
    apex_from: str | None = None  # profile gpu-te: a git URL or clone holding the lock's Apex commit (default its git_url)


def requirement_groups(lock: Lock, root: Path, profile: str, requested: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """What the cache must satisfy, by group; a wheel is counted under the first group that needs it."""
    env = lock.environment
    runtime: list[str] = []
    for req in (*env.runtime, *env.per_profile.get(base_profile(profile), ()), *(r for u in lock.upstreams for r in u.runtime)):
        if req not in runtime:
            runtime.append(req)
    groups = {"build": list(env.build), "torch": [env.torch] if profile == "cpu" else [], "runtime": runtime}
    if profile == TE_PROFILE:
        groups["te-runtime"] = list(_te_lock(lock).te.runtime)
    for extra in lock.nox.extras:
        groups[f"extra:{extra}"] = _pyproject_extra(root, extra)
    groups["sessions"] = [*lock.nox.tool, *lock.nox.formatters, *lock.nox.tests, *lock.nox.interpreter]
    groups["nox"] = [lock.nox.nox] if lock.nox.nox else []
    groups["requested"] = list(requested)
    return {name: reqs for name, reqs in groups.items() if reqs}


def _pyproject_extra(root: Path, extra: str) -> list[str]:
    path = root / "pyproject.toml"
    extras = tomllib.loads(path.read_text()).get("project", {}).get("optional-dependencies", {}) if path.is_file() else {}
    if extra not in extras:
        raise PatchlaneError(f"the lock's [nox] extras names {extra!r}; {path} has no such optional-dependencies group",
                             f"groups there: {sorted(extras)}")
    return list(extras[extra])


def _te_lock(lock: Lock) -> TeLock:
    if lock.te is None:
        raise PatchlaneError(f"--profile {TE_PROFILE}: {lock.path} pins no TransformerEngine or Apex ([te] and [apex])",
                             "pin them there (docs/te.md), or fill with --profile gpu")
    return lock.te


def excluded(profile: str, exclude: tuple[str, ...]) -> tuple[str, ...]:
    """Canonical names the cache leaves out, with whatever only they need."""
    names = {canonical(n) for n in exclude}
    if base_profile(profile) == "gpu":
        names.add("torch")  # the node's CUDA build; the lock's torch_min applies to it
    return tuple(sorted(names))


def run_fill(lock: Lock, options: FillOptions) -> int:
    cache_dir, target = options.cache_dir, options.target
    with_te = target.profile == TE_PROFILE
    progress = StepProgress(total=2 if options.artifacts_only else 6 + with_te)
    progress.next(f"target: {target.describe()}")
    if with_te:
        _te_lock(lock)
    cache_dir.mkdir(parents=True, exist_ok=True)
    artifacts = _fill_artifacts(lock, options, progress)
    if options.artifacts_only:
        print(f"pinned artifacts in {cache_dir}: {sum(f.size for f in artifacts) / MIB:.1f} MiB; no wheels (--artifacts-only)")
        return 0
    sourced = _fill_tests(lock, options, progress) + _fill_corpus(lock, options.cache_dir, progress)
    if with_te:
        te_lock = _te_lock(lock)
        progress.next(f"TransformerEngine {te_lock.te.version} ({len(te_lock.te.files)} pinned files) and Apex at {te_lock.apex.short}")
        sourced += fill_te_sources(te_lock, cache_dir, options.apex_from, progress.log)
    groups = requirement_groups(lock, options.root, target.profile, options.extra)
    exclude = excluded(target.profile, options.exclude)
    cache_target = CacheTarget(python_version=target.minor_version, platforms=target.platforms, profile=target.profile,
                               exclude=exclude)
    previous = read_manifest(cache_dir)
    if previous is not None and previous.target != cache_target and not options.refresh:
        raise PatchlaneError(
            f"{cache_dir} holds a cache for {previous.target}, not {cache_target}",
            "use another directory for another target, or pass --refresh to replace this one",
        )
    progress.next(f"wheels: {sum(len(r) for r in groups.values())} requirement(s) in {len(groups)} group(s)"
                  + (f"; left out, with what only they need: {', '.join(exclude)}" if exclude else ""))
    if previous is not None and previous.target == cache_target and previous.requirements == groups and not options.refresh:
        progress.log(f"  same target and requirements as {MANIFEST_NAME}: verifying its {len(previous.wheels())} wheel(s),"
                     " no resolution (--refresh resolves again)")
        wheels = _reuse(cache_dir, previous, target, progress)
    else:
        wheels = _resolve_and_download(lock, cache_dir, groups, exclude, target, previous, progress)
    if with_te:
        problems = te_requirement_problems(_te_lock(lock), cache_dir, {w.name for w in wheels}, exclude, target.markers())
        if problems:
            raise PatchlaneError("TransformerEngine's pinned files need what the cache does not carry:\n"
                                 + "\n".join(f"  {p}" for p in problems),
                                 f"add the requirement to [te] runtime in {lock.path}, then fill again")
    progress.next("manifest")
    manifest = CacheManifest(target=cache_target, requirements=groups, files=tuple(artifacts + sourced + wheels))
    path = manifest.write(cache_dir)
    progress.log(f"  wrote {path} ({len(manifest.files)} files)")
    _print_summary(cache_dir, manifest)
    return 0


def _fill_artifacts(lock: Lock, options: FillOptions, progress: StepProgress) -> list[CacheFile]:
    upstreams = lock.select(options.only)
    progress.next(f"pinned artifacts of {len(upstreams)} upstream(s)")
    files = []
    for upstream in upstreams:
        fetched = fetch_artifact(upstream, options.cache_dir, offline=False, log=progress.log)
        progress.log(f"  {upstream.name}: {fetched.path} ({fetched.source}, sha256 verified)")
        artifact = upstream.artifact()
        files.append(CacheFile(path=artifact.filename, sha256=artifact.sha256, size=fetched.path.stat().st_size,
                               kind="artifact", name=upstream.pypi, version=upstream.version))
    return files


def _fill_tests(lock: Lock, options: FillOptions, progress: StepProgress) -> list[CacheFile]:
    upstreams = [u for u in lock.select(options.only) if u.tests]
    if options.tests_from is None:
        progress.next("upstream tests: left out (--no-upstream-tests); `upstream-tests` refuses to run from this cache")
        return []
    progress.next(f"upstream tests of {len(upstreams)} upstream(s)")
    unknown = sorted(set(options.tests_from) - {u.name for u in lock.upstreams})
    if unknown:
        raise PatchlaneError(f"--tests-from names unknown upstream(s) {unknown}", f"known: {[u.name for u in lock.upstreams]}")
    return [f for u in upstreams if (f := fill_tests(u, options.cache_dir, options.tests_from.get(u.name), progress.log))]


def _fill_corpus(lock: Lock, cache_dir: Path, progress: StepProgress) -> list[CacheFile]:
    progress.next(f"the pinned corpus' {len(lock.corpus)} release(s)")
    files = []
    for source in lock.corpus:
        path = cache_dir / CORPUS_DIR / source.filename
        if not (path.is_file() and sha256_file(path) == source.sha256):
            download_corpus_release(source, path.parent)
        progress.log(f"  {source.filename} ({path.stat().st_size / MIB:.1f} MiB, sha256 verified)")
        files.append(CacheFile(path=f"{CORPUS_DIR}/{source.filename}", sha256=source.sha256, size=path.stat().st_size,
                               kind=CORPUS_DIR, name=source.name, version=source.version))
    return files


def _reuse(cache_dir: Path, previous: CacheManifest, target: WheelTarget, progress: StepProgress) -> list[CacheFile]:
    broken = [f for f in previous.wheels() if file_problem(cache_dir, f)]
    if broken:
        progress.log(f"  {len(broken)} wheel(s) missing or changed ({file_problem(cache_dir, broken[0])}"
                     f"{', ...' if len(broken) > 1 else ''}): downloading them again")
        for entry in broken:
            (cache_dir / entry.path).unlink(missing_ok=True)
        again = [ResolvedWheel(name=f.name, version=f.version, filename=Path(f.path).name, sha256=f.sha256, requires=())
                 for f in broken]
        download(again, target, cache_dir / WHEELS_DIR, progress.log)
        still = [p for p in (file_problem(cache_dir, f) for f in broken) if p]
        if still:
            raise PatchlaneError("after downloading again:\n" + "\n".join(f"  {p}" for p in still),
                                 "the index serves other files than before: run cache fill with --refresh")
    return list(previous.wheels())


def _resolve_and_download(lock: Lock, cache_dir: Path, groups: dict[str, list[str]], exclude: tuple[str, ...],
                          target: WheelTarget, previous: CacheManifest | None, progress: StepProgress) -> list[CacheFile]:
    everything = [r for reqs in groups.values() for r in reqs]
    if "torch" in exclude:
        # Packages that depend on torch resolve against a torch the node can have (torch_min), though none is fetched.
        everything.append(f"torch>={lock.environment.torch_min}")
    progress.log(f"  resolving through pip for {target.describe()}")
    resolved, environment = resolve(everything, target)
    kinds: dict[str, str] = {}
    for group, reqs in groups.items():
        for name in closure(reqs, resolved, environment, set(exclude)):
            kinds.setdefault(name, group)
    left_out = sorted(set(resolved) - set(kinds))
    progress.log(f"  pip resolved {len(resolved)} distribution(s); the cache takes {len(kinds)}"
                 + (f"; left out {len(left_out)}: {' '.join(left_out)}" if left_out else ""))
    wheels_dir = cache_dir / WHEELS_DIR
    wheels_dir.mkdir(parents=True, exist_ok=True)
    wanted = [resolved[name] for name in kinds]
    present, needed = [], []
    for wheel in wanted:
        path = wheels_dir / wheel.filename
        if path.is_file() and (wheel.sha256 is None or sha256_file(path) == wheel.sha256):
            present.append(wheel)
        else:
            path.unlink(missing_ok=True)
            needed.append(wheel)
    progress.log(f"  {len(present)} wheel(s) already present and verified; {len(needed)} to download")
    if needed:
        download(needed, target, wheels_dir, progress.log)
    files = []
    for wheel in wanted:
        path = wheels_dir / wheel.filename
        actual = sha256_file(path)
        if wheel.sha256 and actual != wheel.sha256:
            raise PatchlaneError(f"{path}: sha256 {actual}, the index said {wheel.sha256}", "delete it and run cache fill again")
        files.append(CacheFile(path=f"{WHEELS_DIR}/{wheel.filename}", sha256=actual, size=path.stat().st_size,
                               kind=kinds[wheel.name], name=wheel.name, version=wheel.version))
    keep = {f.path for f in files}
    for entry in previous.wheels() if previous else ():
        if entry.path not in keep and (cache_dir / entry.path).is_file():
            (cache_dir / entry.path).unlink()
            progress.log(f"  removed {entry.path}: no longer needed")
    strays = sorted(p.name for p in wheels_dir.iterdir() if f"{WHEELS_DIR}/{p.name}" not in keep)
    if strays:
        progress.log(f"  warning: {len(strays)} file(s) in {wheels_dir} are not from this fill and fail `--offline`"
                     f" verification until deleted: {' '.join(strays)}")
    return files


def _print_summary(cache_dir: Path, manifest: CacheManifest) -> None:
    print(f"cache {cache_dir}, for {manifest.target.python_version} / {manifest.target.profile}:")
    print(format_table(["kind", "files", "MiB"], size_table(manifest)))
    largest = max(manifest.files, key=lambda f: f.size)
    print(f"largest file: {largest.path} ({largest.size / MIB:.1f} MiB). The cache is plain files: copy the directory"
          f" as is, or `cache split {cache_dir} --max-mib N` for transfers of at most N MiB.")
