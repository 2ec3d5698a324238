"""The target Python environment: which interpreter, which profile (cpu/gpu), what is installed.

Profiles are explicit and printed. On a machine without an NVIDIA GPU the cpu profile skips
GPU-only pieces (CUDA extension builds) with a line saying so; nothing degrades silently.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchlaneError
from .lock import Lock, Upstream

# Runs inside the target interpreter; must not import torch (the no-op build stays fast).
_PROBE = r"""
import json, sys, importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
reqs = json.loads(sys.argv[1])
dists = {}
for d in md.distributions():
    name = (d.metadata["Name"] or "").lower().replace("_", "-")
    url = d.read_text("direct_url.json")
    editable = None
    if url:
        info = json.loads(url)
        if info.get("dir_info", {}).get("editable"):
            editable = info["url"].removeprefix("file://")
    if name in dists and dists[name]["editable"] and not editable:
        continue  # an in-tree .egg-info found through an editable install's path entry
    dists[name] = {"version": d.version, "editable": editable}
missing = []
for r in reqs:
    req = Requirement(r)
    have = dists.get(req.name.lower().replace("_", "-"))
    if have is None or (req.specifier and not req.specifier.contains(have["version"], prereleases=True)):
        missing.append(r)
print(json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "dists": dists, "missing": missing}))
"""


@dataclass(frozen=True)
class Target:
    python: str
    description: str


@dataclass(frozen=True)
class Probe:
    python_version: str
    dists: dict[str, dict]
    missing: list[str]

    def version_of(self, dist: str) -> str | None:
        info = self.dists.get(dist.lower().replace("_", "-"))
        return info["version"] if info else None

    def editable_location(self, dist: str) -> str | None:
        info = self.dists.get(dist.lower().replace("_", "-"))
        return info["editable"] if info else None


def resolve_target(env_dir: Path | None, python: str | None, log=print, base_python: str | None = None) -> Target:
    """`--python EXE` uses that interpreter's environment; `--env DIR` makes a venv there if needed,
    layered over `base_python`'s environment when given (see create_layered_env)."""
    if python:
        if base_python:
            raise PatchlaneError("--python and --base-python exclude each other",
                                 "--python installs into that interpreter's environment; --base-python makes --env see it")
        exe = _interpreter(python, "--python")
        return Target(python=exe, description=f"interpreter {exe}")
    assert env_dir is not None
    exe = env_dir / "bin" / "python"
    base = _interpreter(base_python, "--base-python") if base_python else None
    if not exe.exists():
        if base:
            create_layered_env(env_dir, base, log)
        else:
            log(f"  creating virtual environment {env_dir} (python {sys.version.split()[0]})")
            venv.EnvBuilder(with_pip=True, clear=False, symlinks=True).create(env_dir)
    layered = layered_base(env_dir)
    if base and layered != base:
        raise PatchlaneError(
            f"{env_dir} exists and is " + (f"layered over {layered}" if layered else "not layered over another environment")
            + f", not over --base-python {base}",
            f"move it aside (mv {env_dir} {env_dir}.old) and build again, or drop --base-python",
        )
    return Target(python=str(exe), description=f"venv {env_dir}" + (f" over {layered}'s packages" if layered else ""))


def _interpreter(python: str, option: str) -> str:
    """The interpreter's absolute path, symlinks kept (a venv's python is a symlink to its base's)."""
    exe = shutil.which(python) or python
    if not Path(exe).exists():
        raise PatchlaneError(f"{option} {python}: no such interpreter")
    return os.path.abspath(exe)


LAYER_PTH = "nam56r-base-environment.pth"
_LAYER_MARK = "# nam56r base-python: "
# Runs in the base interpreter: its version and the site directories it imports from.
_BASE_SITES = r"""
import json, os, sys
sites = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
print(json.dumps({"version": "%d.%d.%d" % sys.version_info[:3], "sites": sites}))
"""


def create_layered_env(env_dir: Path, base_python: str, log=print) -> None:
    """A venv made by `base_python`'s interpreter that also imports that interpreter's packages (a cluster's
    CUDA torch, say), after its own: installs go into `env_dir`, the base environment is never modified.

    `--system-site-packages` cannot do this when the base is itself a venv (it exposes the base's base).
    A .pth file in the new venv adds the base's site directories with site.addsitedir (so .pth files there,
    editable installs included, work too); pip sees the base's distributions and counts them as installed."""
    proc = subprocess.run([base_python, "-c", _BASE_SITES], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PatchlaneError(f"--base-python {base_python} does not run:\n{proc.stderr.strip()}")
    base = json.loads(proc.stdout)
    log(f"  creating virtual environment {env_dir} with {base_python} (python {base['version']}),"
        f" layered over its packages in {', '.join(base['sites']) or '(no site directory)'}")
    made = subprocess.run([base_python, "-m", "venv", "--without-pip", str(env_dir)], capture_output=True, text=True)
    if made.returncode != 0:
        raise PatchlaneError(f"{base_python} -m venv {env_dir} failed:\n{made.stderr.strip()}",
                             "that interpreter needs its venv module (Debian/Ubuntu: the python3.X-venv package)")
    python = str(env_dir / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    lines = [f"{_LAYER_MARK}{base_python}\n"] + [f"import site; site.addsitedir({site!r})\n" for site in base["sites"]]
    (Path(purelib) / LAYER_PTH).write_text("".join(lines))
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        return
    log(f"  {base_python} has no pip to share: installing one into {env_dir} with ensurepip")
    ensured = subprocess.run([python, "-m", "ensurepip", "--default-pip"], capture_output=True, text=True)
    if ensured.returncode != 0:
        raise PatchlaneError(f"no pip in {env_dir}: the base has none and ensurepip failed:\n{ensured.stderr.strip()[-2000:]}",
                             f"install pip into the base environment ({base_python} -m ensurepip, or your system's package)")


def layered_base(env_dir: Path) -> str | None:
    """The --base-python a venv was layered over, or None."""
    for pth in (env_dir / "lib").glob(f"python*/site-packages/{LAYER_PTH}"):
        first = pth.read_text().splitlines()[:1]
        if first and first[0].startswith(_LAYER_MARK):
            return first[0][len(_LAYER_MARK):]
    return None


BUILD_RECORD = "nam56r-build.json"


def write_build_record(env_dir: Path, record: dict) -> None:
    """How `env_dir` was last built (cache, offline, profile: noxfile.py replays them for the other sessions)
    and from which checkout state (`checkout_state.built_checkout`)."""
    (env_dir / BUILD_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def read_build_record(env_dir: Path) -> dict | None:
    """What the last build of `env_dir` recorded (write_build_record), or None when none did."""
    path = env_dir / BUILD_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def probe(target: Target, requirements: list[str]) -> Probe:
    proc = subprocess.run([target.python, "-c", _PROBE, json.dumps(requirements)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise PatchlaneError(f"could not inspect {target.description}:\n{proc.stderr.strip()}")
    raw = json.loads(proc.stdout)
    return Probe(python_version=raw["python"], dists=raw["dists"], missing=raw["missing"])


def detect_profile(requested: str) -> tuple[str, str]:
    """(profile, why). `auto` means gpu when nvidia-smi lists a GPU, else cpu."""
    if requested in ("cpu", "gpu"):
        return requested, "chosen with --profile"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu", "no NVIDIA GPU found (nvidia-smi is not on PATH)"
    proc = subprocess.run([smi, "-L"], capture_output=True, text=True)
    if proc.returncode != 0 or "GPU" not in proc.stdout:
        return "cpu", "nvidia-smi lists no GPU"
    return "gpu", proc.stdout.strip().splitlines()[0]


def profile_notes(profile: str, lock: Lock) -> list[str]:
    """What the profile skips or builds, said out loud."""
    notes = []
    for upstream in lock.upstreams:
        for key, value in upstream.env_for(profile).items():
            notes.append(f"{upstream.name}: {key}={value}")
    if profile == "cpu":
        notes.append("skipped (GPU-only): CUDA extension builds, TransformerEngine")
    else:
        notes.append("TransformerEngine and Apex are installed with --with-te only (docs/te.md); without them NAM56R uses"
                     " Megatron's local backend, and says so")
    return notes


def environment_requirements(lock: Lock, profile: str, torch_present: bool) -> list[str]:
    env = lock.environment
    reqs = list(env.build) + list(env.runtime) + list(env.per_profile.get(profile, ()))
    if not torch_present:
        reqs.insert(0, env.torch)
    for upstream in lock.upstreams:
        reqs += [r for r in upstream.runtime if r not in reqs]
    return reqs


def pip_install(target: Target, args: list[str], env: dict[str, str] | None = None, what: str = "") -> None:
    cmd = [target.python, "-m", "pip", "install", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise PatchlaneError(f"pip install {what or ' '.join(args)} failed in {target.description}:\n{tail}")


def install_upstream(target: Target, upstream: Upstream, tree_path: Path, artifact: Path | None, profile: str) -> None:
    """Editable install of the patched tree, or the pinned wheel for install = "wheel"."""
    if upstream.install == "wheel":
        assert artifact is not None
        pip_install(target, ["--no-deps", "--force-reinstall", str(artifact)], what=upstream.requirement)
        restore_wheel_mtimes(target, upstream.pypi, artifact)
        return
    # setuptools-scm would read a version off our tree's git history; the release's own is the truth.
    env = {**upstream.env_for(profile), "SETUPTOOLS_SCM_PRETEND_VERSION": upstream.version}
    args = ["--no-deps", "--no-build-isolation"]
    if upstream.ignore_requires_python:
        args.append("--ignore-requires-python")
    pip_install(target, [*args, "-e", str(tree_path)], env=env, what=f"-e {tree_path}")


# Run in the target: each installed file of the distribution gets its wheel entry's timestamp (read as UTC).
_RESTORE_MTIMES = r"""
import calendar, importlib.metadata, json, os, sys, zipfile
wheel, name = sys.argv[1:3]
with zipfile.ZipFile(wheel) as archive:
    stamps = {i.filename: calendar.timegm(i.date_time + (0, 0, 0)) for i in archive.infolist()}
restored = 0
for file in importlib.metadata.distribution(name).files or ():
    when, path = stamps.get(file.as_posix()), file.locate()
    if when is not None and os.path.isfile(path):
        os.utime(path, (when, when))
        restored += 1
print(json.dumps(restored))
"""


def restore_wheel_mtimes(target: Target, distribution: str, wheel: Path) -> int:
    """Give the installed files of `distribution` the timestamps their entries carry in `wheel`; the number set.
    pip writes them at install time, and TileLang's kernel-cache key stamps libtilelang.so's mtime: with the wheel's
    own timestamps, every node built from the same wheel keys its compiled kernels alike, so a kernel cache filled on
    one node serves the others (nam56r.training.launcher.kernel_cache)."""
    proc = subprocess.run([target.python, "-c", _RESTORE_MTIMES, str(wheel), distribution], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PatchlaneError(f"could not give {distribution}'s installed files the timestamps of {wheel.name}: {last}")
    return int(proc.stdout)


def is_installed(probe_result: Probe, upstream: Upstream, tree_path: Path) -> bool:
    installed = probe_result.version_of(upstream.pypi) or ""
    # megatron-core appends the tree's git commit as a local version label (0.19.0+abc1234).
    if installed.split("+")[0] != upstream.version:
        return False
    location = probe_result.editable_location(upstream.pypi)
    if upstream.install == "wheel":
        return location is None
    return location is not None and Path(location).resolve() == tree_path.resolve()


def check_imports(target: Target, modules: list[str], env: dict[str, str] | None = None) -> list[str]:
    """Import each module in the target, each in its own interpreter so one failure cannot hide another; return
    the failures as 'module: error' lines, in the order of `modules`. The interpreters run side by side: each
    loads torch, and one after another they take minutes on a fresh GPU node."""
    run_env = {**os.environ, **(env or {})}

    def failure(module: str) -> str | None:
        proc = subprocess.run([target.python, "-c", f"import {module}"], capture_output=True, text=True, env=run_env)
        if proc.returncode == 0:
            return None
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"{module}: {last}"

    with ThreadPoolExecutor(max_workers=max(1, len(modules))) as pool:
        return [line for line in pool.map(failure, modules) if line is not None]
