"""`build --with-te`: TransformerEngine and Apex into the build environment, from the lock's pinned files.

TE's wheels are installed as they are; its PyTorch extension (an sdist) and Apex (a git archive) are compiled against
the environment's torch into wheels kept per build key (te_compile.py), then installed with what they require: from
the offline cache's wheels with `--offline`, else through the user's index. A file the cache lacks stops the build,
named; nothing falls back. `<env>/nam56r-te.json` records what was installed, so a second build is a no-op.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import environment as envmod
from .apex_source import archive_root, extract
from .cachemanifest import WHEELS_DIR, verify_cache
from .console import StepProgress
from .errors import PatchlaneError
from .te_compile import BuiltWheel, CompileJob, WheelStore, compile_wheel, probe_key
from .te_lock import TeLock
from .te_sources import TeSources, cached_te_sources, online_te_sources

RECORD = "nam56r-te.json"


@dataclass(frozen=True)
class TeRequest:
    te_lock: TeLock
    env_dir: Path
    cache_dir: Path
    offline: bool


@dataclass(frozen=True)
class TeOutcome:
    """What the step did, for the build's table: one row each for TE and Apex."""

    rows: tuple[tuple[str, str, str, str], ...]  # (name, pin, source, action)
    changed: bool


def sources_id(te_lock: TeLock) -> str:
    """What is compiled and how: the pinned sources and the lock's build settings (part of the build key)."""
    te, apex = te_lock.te, te_lock.apex
    text = json.dumps({"te": te.sdist.sha256, "te_env": te.env, "apex": apex.commit, "apex_tree": apex.tree,
                       "apex_env": apex.env}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def install_te(request: TeRequest, target: envmod.Target, progress: StepProgress) -> TeOutcome:
    te_lock = request.te_lock
    te, apex = te_lock.te, te_lock.apex
    probe = envmod.probe(target, [])
    wanted = {"te_version": te.version, "sources": sources_id(te_lock), "torch": probe.version_of("torch")}
    record = _read_record(request.env_dir)
    if record is not None and {k: record.get(k) for k in wanted} == wanted and _installed(probe, te_lock):
        progress.log(f"  TransformerEngine {te.version} and Apex {apex.short} already installed as the lock says"
                     f" (compiled for {record.get('key', '?')})")
        return TeOutcome(rows=_rows(te_lock, "installed", "no-op"), changed=False)
    sources = _sources(request, probe.python_version, progress)
    key, node_env = probe_key(target, sources_id(te_lock))
    store = WheelStore(request.cache_dir, key)
    progress.log(f"  build key {key.dirname()}: {key.describe()}"
                 + "".join(f"; {name}={value}" for name, value in node_env.items()))
    with tempfile.TemporaryDirectory(prefix="patchlane-apex-src-") as tmp:
        apex_dir = extract(sources.apex_archive, Path(tmp)) / archive_root(apex)
        jobs = (CompileJob("te", f"{te.sdist.project} {te.version}", sources.sdist, te.env),
                CompileJob("apex", f"apex {apex.short}", apex_dir, apex.env))
        built = {job.component: _built(target, job, store, node_env, progress) for job in jobs}
    progress.log(f"  installing {len(sources.wheels)} TransformerEngine wheel(s) and the 2 compiled ones")
    files = [str(p) for p in (*sources.wheels, built["te"].path, built["apex"].path)]
    envmod.pip_install(target, ["--no-deps", "--force-reinstall", *files], env=_pip_env(request), what="TransformerEngine and Apex")
    # Again with their requirements: the files are installed now, so pip adds only what they require.
    envmod.pip_install(target, [*_pip_source(request), *files], env=_pip_env(request),
                       what="what TransformerEngine and Apex require")
    modules = [*te.imports, *apex.imports]
    progress.log(f"  checking imports: {', '.join(modules)}")
    failures = envmod.check_imports(target, modules)
    if failures:
        raise PatchlaneError("TransformerEngine or Apex does not import in the target:\n" + "\n".join(f"  {f}" for f in failures),
                             f"the compile logs are under {store.dir}")
    _write_record(request.env_dir, {**wanted, "key": key.dirname(),
                                    "wheels": {name: wheel.path.name for name, wheel in built.items()}})
    how = {name: ("kept wheel, no compile" if wheel.reused else f"compiled in {wheel.seconds / 60:.1f} min")
           for name, wheel in built.items()}
    source = "cache" if request.offline else "pypi + git"
    return TeOutcome(rows=(("transformer-engine", te.version, source, f"installed ({how['te']})"),
                           ("apex", apex.short, source, f"installed ({how['apex']})")), changed=True)


def _sources(request: TeRequest, python_version: str, progress: StepProgress) -> TeSources:
    if not request.offline:
        return online_te_sources(request.te_lock, request.cache_dir, progress.log)
    manifest = verify_cache(request.cache_dir, python_version, progress.log)
    return cached_te_sources(request.te_lock, request.cache_dir, manifest)


def _built(target: envmod.Target, job: CompileJob, store: WheelStore, node_env: dict[str, str],
           progress: StepProgress) -> BuiltWheel:
    kept = store.find(job.component)
    if kept is not None:
        progress.log(f"  {job.label}: kept wheel {kept.path.name} for this key (compiled in {kept.seconds / 60:.1f} min"
                     " where it was built): no compile")
        return kept
    wheel, seconds = compile_wheel(target, job, store.key, node_env, store.dir, progress.log)
    built = store.keep(job.component, wheel, seconds)
    wheel.unlink()
    wheel.parent.rmdir()
    progress.log(f"  kept {built.path} for the next node with this key")
    return built


def _pip_source(request: TeRequest) -> list[str]:
    return ["--no-index", "--find-links", str(request.cache_dir / WHEELS_DIR)] if request.offline else []


def _pip_env(request: TeRequest) -> dict[str, str]:
    if not request.offline:
        return {}
    return {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_INDEX_URL": "", "PIP_EXTRA_INDEX_URL": "", "PIP_CONSTRAINT": ""}


def _installed(probe: envmod.Probe, te_lock: TeLock) -> bool:
    te = te_lock.te
    return all(probe.version_of(p.project) == te.version for p in te.files) and probe.version_of("apex") is not None


def _rows(te_lock: TeLock, source: str, action: str) -> tuple[tuple[str, str, str, str], ...]:
    return (("transformer-engine", te_lock.te.version, source, action), ("apex", te_lock.apex.short, source, action))


def _read_record(env_dir: Path) -> dict | None:
    path = env_dir / RECORD
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def _write_record(env_dir: Path, record: dict) -> None:
    (env_dir / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

