"""`build`: materialize every pinned upstream, apply its series, install it into the target env.

Prints one line per step with the elapsed time, then a per-upstream table. A second run with
nothing changed does no work and says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import environment as envmod
from .apply import sync_series
from .artifacts import fetch_artifact
from .cachemanifest import MANIFEST_NAME, WHEELS_DIR, verify_cache
from .errors import PatchlaneError
from .lock import Lock
from .materialize import materialize_upstream
from .series import read_series, series_problems
from .superproject import protect_gitlink


@dataclass(frozen=True)
class BuildOptions:
    root: Path
    cache_dir: Path
    offline: bool
    env_dir: Path | None
    python: str | None
    profile: str
    discard: bool
    only: list[str] | None
    install: bool = True
    base_python: str | None = None  # with env_dir: a new env is layered over this interpreter's packages


@dataclass
class Row:
    upstream: str
    pin: str
    source: str
    applied: str
    tree: str
    install: str
    action: str


class Progress:
    def __init__(self, total: int) -> None:
        self.total = total
        self.step = 0
        self.start = time.monotonic()

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.start:6.1f}s"

    def next(self, text: str) -> None:
        self.step += 1
        print(f"[{self.elapsed()}] ({self.step}/{self.total}) {text}", flush=True)

    def log(self, text: str) -> None:
        print(f"[{self.elapsed()}] {text}", flush=True)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def run_build(lock: Lock, options: BuildOptions) -> int:
    upstreams = lock.select(options.only)
    progress = Progress(total=len(upstreams) + 2)
    progress.next("target environment")
    target = envmod.resolve_target(options.env_dir, options.python, progress.log, options.base_python)
    profile, why = envmod.detect_profile(options.profile)
    progress.log(f"  {target.description}; profile {profile}: {why}")
    for note in envmod.profile_notes(profile, lock):
        progress.log(f"  profile {profile}: {note}")
    first = envmod.probe(target, [])
    torch_version = first.version_of("torch")
    torch_ok = torch_version is not None and _version_at_least(torch_version, lock.environment.torch_min)
    if torch_version and torch_ok:
        progress.log(f"  torch {torch_version} already present: kept (needs >= {lock.environment.torch_min})")
    requirements = envmod.environment_requirements(lock, profile, torch_present=torch_ok)
    probe_result = envmod.probe(target, requirements)
    changed = False
    if probe_result.missing and options.install:
        source, pip_env = [], {}
        if options.offline:
            source, pip_env = _offline_source(lock, options.cache_dir, probe_result, torch_ok, progress)
        progress.log(f"  installing {len(probe_result.missing)} requirement(s): {' '.join(probe_result.missing)}")
        envmod.pip_install(target, [*source, *probe_result.missing], env=pip_env, what="environment requirements")
        probe_result = envmod.probe(target, requirements)
        changed = True
    if probe_result.missing and options.install:
        raise PatchlaneError(f"still missing after install: {probe_result.missing}")

    rows: list[Row] = []
    failures: list[str] = []
    for upstream in upstreams:
        progress.next(f"{upstream.name} ({upstream.requirement})")
        series = read_series(options.root / "patches", upstream.name)
        problems = series_problems(series)
        if upstream.install == "wheel" and series.entries:
            problems.append(f"{upstream.name}: install = \"wheel\" cannot carry patches; set install = \"editable\" in the lock")
        if problems:
            raise PatchlaneError(
                "series problems:\n" + "\n".join(f"  {p}" for p in problems), "fix them; `apply_patches.py check` lists them all"
            )
        materialized = materialize_upstream(options.root, upstream, options.cache_dir, options.offline, target.python, progress.log)
        tree, state = materialized.tree, materialized.state
        protect_gitlink(options.root, upstream)
        action = ["materialized"] if materialized.created else []
        try:
            if sync_series(tree, state, series, options.discard, progress.log):
                action.append("patched")
        except PatchlaneError:
            rows.append(_row(upstream, state, series, tree, "unchanged", "FAILED"))
            print(format_table(list(Row.__dataclass_fields__), [list(vars(r).values()) for r in rows]))
            raise
        install = "skipped"
        if options.install:
            if envmod.is_installed(probe_result, upstream, tree.path):
                install = "editable" if upstream.install == "editable" else "wheel"
            else:
                artifact = None
                if upstream.install == "wheel":
                    artifact = fetch_artifact(upstream, options.cache_dir, options.offline, target.python, progress.log).path
                how = f"editable, {tree.path}" if upstream.install == "editable" else f"pinned wheel {artifact.name}, its series is empty"
                progress.log(f"  installing {upstream.requirement} ({how})")
                if upstream.ignore_requires_python:
                    progress.log(f"  {upstream.name}: with --ignore-requires-python, as the lock says"
                                 f" (python {probe_result.python_version})")
                envmod.install_upstream(target, upstream, tree.path, artifact, profile)
                install = upstream.install
                action.append("installed")
        if tree.dirty_paths():
            progress.log(f"  {upstream.name}: uncommitted edits in {tree.path} kept (live in the editable install);"
                         f" `apply_patches.py refresh|new -u {upstream.name}` makes them a patch")
        changed = changed or bool(action)
        rows.append(_row(upstream, state, series, tree, install, ", ".join(action) or "no-op"))
    progress.next("summary")
    if changed and options.install:
        modules = [m for u in upstreams for m in u.imports]
        progress.log(f"  checking imports in the target: {', '.join(modules)}")
        failures = envmod.check_imports(target, modules)
    print(format_table(list(Row.__dataclass_fields__), [list(vars(r).values()) for r in rows]))
    if failures:
        raise PatchlaneError("imports failed in the target environment:\n" + "\n".join(f"  {f}" for f in failures))
    if options.env_dir is not None and options.install:
        envmod.write_build_record(options.env_dir, {"cache": str(options.cache_dir.resolve()), "offline": options.offline,
                                                    "profile": profile, "base_python": envmod.layered_base(options.env_dir)})
    if not changed:
        print(f"no-op: every upstream is materialized, patched and installed as the lock and series say ({progress.elapsed().strip()})")
    else:
        print(f"done in {progress.elapsed().strip()}; target python: {target.python}")
    return 0


def _offline_source(
    lock: Lock, cache_dir: Path, probe_result: envmod.Probe, torch_ok: bool, progress: Progress
) -> tuple[list[str], dict[str, str]]:
    """pip options and environment installing from the verified cache only; refuses a cache that cannot serve
    this environment."""
    manifest = verify_cache(cache_dir, probe_result.python_version)
    progress.log(f"  offline cache {cache_dir}: {len(manifest.files)} file(s) match {MANIFEST_NAME}"
                 f" (filled for python {manifest.target.python_version}, profile {manifest.target.profile})")
    if not torch_ok and "torch" in manifest.target.exclude:
        have = probe_result.version_of("torch")
        raise PatchlaneError(
            f"the environment has {'torch ' + have if have else 'no torch'} (needs >= {lock.environment.torch_min}),"
            f" and {cache_dir} leaves torch out (filled for the {manifest.target.profile} profile: the machine's own CUDA torch is used)",
            "build over the interpreter that has it: --base-python /path/to/bin/python (the env sees its torch),"
            " or --python it; or fill a cache with --profile cpu",
        )
    # No pip configuration either: a find-links or constraint of this machine's must not change what is installed.
    isolated = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_INDEX_URL": "", "PIP_EXTRA_INDEX_URL": "", "PIP_CONSTRAINT": ""}
    return ["--no-index", "--find-links", str(cache_dir / WHEELS_DIR)], isolated


def _row(upstream, state, series, tree, install: str, action: str) -> Row:
    dirty = tree.dirty_paths()
    return Row(
        upstream=upstream.name,
        pin=f"{upstream.version} ({upstream.commit[:10]})",
        source=state.source,
        applied=f"{len(state.applied)}/{len(series.entries)}",
        tree="dirty" if dirty else "clean",
        install=install,
        action=action,
    )


def _version_at_least(version: str, minimum: str) -> bool:
    def parts(v: str) -> tuple[int, ...]:
        out = []
        for piece in v.split("+")[0].split("."):
            digits = "".join(ch for ch in piece if ch.isdigit())
            if not digits:
                break
            out.append(int(digits))
        return tuple(out)

    return parts(version) >= parts(minimum)
