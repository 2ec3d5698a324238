"""`build`: materialize every pinned upstream, apply its series, install it into the target env.

Prints one line per step with the elapsed time, then a per-upstream table. A second run with
nothing changed does no work and says so. With `with_te`, TransformerEngine and Apex follow the
upstreams (te_install.py) and have rows of their own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from . import environment as envmod
from .apply import sync_series
from .artifacts import fetch_artifact
from .cachemanifest import MANIFEST_NAME, WHEELS_DIR, verify_cache
from .checkout_state import checkout_state, state_record
from .console import StepProgress, format_table
from .errors import PatchlaneError
from .lock import Lock, Upstream
from .materialize import materialize_upstream
from .series import Series, read_series, series_problems
from .superproject import protect_gitlink
from .te_install import TeOutcome, TeRequest, install_te


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
    with_te: bool = False  # also TransformerEngine and Apex, from the lock's [te] and [apex] (te_install.py)


@dataclass
class BuildRow:
    """One upstream's row of the table `build` ends with; the field names are its headers."""

    upstream: str
    pin: str
    source: str
    applied: str
    tree: str
    install: str
    action: str


NO_OP = "no-op"  # a row's action when the build changed nothing for that upstream


@dataclass(frozen=True)
class TargetEnvironment:
    """The environment the upstreams go into, as the build found it and completed it."""

    target: envmod.Target
    profile: str
    probe: envmod.Probe  # its installed distributions, after the requirements were installed
    changed: bool  # requirements were installed


def run_build(lock: Lock, options: BuildOptions) -> int:
    """The target environment, then each selected upstream, then the import check, the table and the build record."""
    upstreams = lock.select(options.only)
    te_request = _te_request(lock, options)
    progress = StepProgress(total=len(upstreams) + 2 + (te_request is not None))
    progress.next("target environment")
    env = _prepare_environment(lock, options, progress)
    rows: list[BuildRow] = []
    for upstream in upstreams:
        progress.next(f"{upstream.name} ({upstream.requirement})")
        rows.append(_build_upstream(upstream, options, env, progress, rows))
    if te_request is not None:
        progress.next(f"TransformerEngine {te_request.te_lock.te.version} and Apex {te_request.te_lock.apex.short}")
        outcome = install_te(te_request, env.target, progress)
        rows += _te_rows(outcome)
    changed = env.changed or any(row.action != NO_OP for row in rows)
    progress.next("summary")
    if changed and options.install:
        modules = [m for u in upstreams for m in u.imports]
        progress.log(f"  checking imports in the target: {', '.join(modules)}")
        failures = envmod.check_imports(env.target, modules)
    else:
        failures = []
    print(_rows_table(rows))
    if failures:
        raise PatchlaneError("imports failed in the target environment:\n" + "\n".join(f"  {f}" for f in failures))
    if options.env_dir is not None and options.install:
        envmod.write_build_record(options.env_dir, {"cache": str(options.cache_dir.resolve()), "offline": options.offline,
                                                    "profile": env.profile, "base_python": envmod.layered_base(options.env_dir),
                                                    "te": options.with_te,
                                                    "checkout": state_record(checkout_state(options.root))})
    if not changed:
        print(f"no-op: every upstream is materialized, patched and installed as the lock and series say ({progress.elapsed().strip()})")
    else:
        print(f"done in {progress.elapsed().strip()}; target python: {env.target.python}")
    return 0


def _te_request(lock: Lock, options: BuildOptions) -> TeRequest | None:
    """What `--with-te` installs, or None without it; refuses what it cannot do before anything is built."""
    if not options.with_te:
        return None
    if lock.te is None:
        raise PatchlaneError(f"--with-te: {lock.path} pins no TransformerEngine or Apex ([te] and [apex])", "see docs/te.md")
    if options.env_dir is None or not options.install:
        raise PatchlaneError("--with-te installs into the build environment: it needs --env (the default), not --python"
                             " or --no-install")
    profile, why = envmod.detect_profile(options.profile)
    if profile != "gpu":
        raise PatchlaneError(f"--with-te needs the gpu profile; this build is {profile} ({why})",
                             "TransformerEngine and Apex compile against a CUDA torch: build on a GPU node, or pass --profile gpu")
    return TeRequest(te_lock=lock.te, env_dir=options.env_dir, cache_dir=options.cache_dir, offline=options.offline)


def _te_rows(outcome: TeOutcome) -> list[BuildRow]:
    return [BuildRow(upstream=name, pin=pin, source=source, applied="-", tree="-", install="wheel", action=action)
            for name, pin, source, action in outcome.rows]


def _prepare_environment(lock: Lock, options: BuildOptions, progress: StepProgress) -> TargetEnvironment:
    """Resolve (or create) the target environment, pick the profile, and install what the lock requires
    there, keeping a torch that is new enough."""
    target = envmod.resolve_target(options.env_dir, options.python, progress.log, options.base_python)
    profile, why = envmod.detect_profile(options.profile)
    progress.log(f"  {target.description}; profile {profile}: {why}")
    for note in envmod.profile_notes(profile, lock):
        progress.log(f"  profile {profile}: {note}")
    torch_version = envmod.probe(target, []).version_of("torch")
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
    return TargetEnvironment(target, profile, probe_result, changed)


def _build_upstream(upstream: Upstream, options: BuildOptions, env: TargetEnvironment, progress: StepProgress,
                    rows: list[BuildRow]) -> BuildRow:
    """Materialize one upstream, bring its tree to the series and install it; its row of the final table.
    When the series fails to apply, prints the table so far (`rows`) with this upstream FAILED, and raises."""
    series = _buildable_series(options.root, upstream)
    materialized = materialize_upstream(options.root, upstream, options.cache_dir, options.offline, env.target.python, progress.log)
    tree, state = materialized.tree, materialized.state
    protect_gitlink(options.root, upstream)
    action = ["materialized"] if materialized.created else []
    try:
        if sync_series(tree, state, series, options.discard, progress.log):
            action.append("patched")
    except PatchlaneError:
        print(_rows_table([*rows, _row(upstream, state, series, tree, "unchanged", "FAILED")]))
        raise
    install = "skipped"
    if options.install:
        install, installed = _ensure_installed(upstream, tree.path, options, env, progress)
        if installed:
            action.append("installed")
    if tree.dirty_paths():
        progress.log(f"  {upstream.name}: uncommitted edits in {tree.path} kept (live in the editable install);"
                     f" `apply_patches.py refresh|new -u {upstream.name}` makes them a patch")
    return _row(upstream, state, series, tree, install, ", ".join(action) or NO_OP)


def _buildable_series(root: Path, upstream: Upstream) -> Series:
    """The upstream's series; refuses one with problems, or any patch on an upstream installed as the pinned wheel."""
    series = read_series(root / "patches", upstream.name)
    problems = series_problems(series)
    if upstream.install == "wheel" and series.entries:
        problems.append(f"{upstream.name}: install = \"wheel\" cannot carry patches; set install = \"editable\" in the lock")
    if problems:
        raise PatchlaneError(
            "series problems:\n" + "\n".join(f"  {p}" for p in problems), "fix them; `apply_patches.py check` lists them all"
        )
    return series


def _ensure_installed(upstream: Upstream, tree_path: Path, options: BuildOptions, env: TargetEnvironment,
                      progress: StepProgress) -> tuple[str, bool]:
    """Install the upstream as the lock says (editable from its tree, or its pinned wheel) unless the target
    already has it so; how it is installed, and whether this build installed it."""
    if envmod.is_installed(env.probe, upstream, tree_path):
        return ("editable" if upstream.install == "editable" else "wheel"), False
    artifact = None
    if upstream.install == "wheel":
        artifact = fetch_artifact(upstream, options.cache_dir, options.offline, env.target.python, progress.log).path
    how = f"editable, {tree_path}" if upstream.install == "editable" else f"pinned wheel {artifact.name}, its series is empty"
    progress.log(f"  installing {upstream.requirement} ({how})")
    if upstream.ignore_requires_python:
        progress.log(f"  {upstream.name}: with --ignore-requires-python, as the lock says (python {env.probe.python_version})")
    envmod.install_upstream(env.target, upstream, tree_path, artifact, env.profile)
    return upstream.install, True


def _offline_source(
    lock: Lock, cache_dir: Path, probe_result: envmod.Probe, torch_ok: bool, progress: StepProgress
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


def _rows_table(rows: list[BuildRow]) -> str:
    return format_table(list(BuildRow.__dataclass_fields__), [list(vars(r).values()) for r in rows])


def _row(upstream, state, series, tree, install: str, action: str) -> BuildRow:
    dirty = tree.dirty_paths()
    return BuildRow(
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
