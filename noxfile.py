"""nox sessions for NAM56R.

  nox -s build              materialize + patch + install the pinned upstreams into .venv
  nox -s tests              build, then the CPU test suite in that same environment
  nox -s data -- ARGS       build the default C/C++ training corpus (python -m nam56r.data build ARGS)
  nox -s train -- ARGS      train (python -m nam56r.train ARGS), e.g. `-- --recipe proxy-1gpu --dry-run`
  nox -s bench -- ARGS      benchmarks (python -m nam56r.bench ARGS): `-- --list`, `-- tooling`, `-- kernels` ...
  nox -s lint               ruff
  nox -s patches -- CMD     the patch-lane CLI (tools/apply_patches.py CMD), e.g. `-- status`, `-- check`
  nox -s packs -- CMD       the filing-pack CLI (tools/packs.py CMD), e.g. `-- list`, `-- run ID`, `-- waves`

`.venv` is the environment the stack runs in (training, tests, reproducers). nox's own session
environments only carry the patch tool's dependency (GitPython).
Pass build options after `--`: `nox -s build -- --profile cpu --cache DIR --offline`.
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
TOOL = str(ROOT / "tools" / "apply_patches.py")
TOOL_REQUIREMENTS = ["gitpython>=3.1.40"]
# Megatron-LM's pyproject requires black 26; `packs preflight` runs it (and isort) on our changed lines.
FORMATTERS = ["black==26.10.1", "isort==6.1.0"]
# The kernels' CPU tests run under Triton 3.6's interpreter, which converts 1-element arrays with int():
# an error since numpy 2.4 (triton-lang/triton#9171, fixed after 3.6). Drop once the pinned triton has the fix.
INTERPRETER_REQUIREMENTS = ["numpy<2.4"]

# The training extras, read from pyproject.toml so the list lives in one place.
TRAIN_REQUIREMENTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]

nox.options.sessions = ["build"]
nox.options.reuse_venv = "yes"


def _tool(session: nox.Session, *args: str) -> None:
    session.install(*TOOL_REQUIREMENTS)
    session.run("python", TOOL, *args)


@nox.session
def build(session: nox.Session) -> None:
    """Materialize the four pinned upstreams, apply their patch series, install them editable into .venv."""
    _build(session, *session.posargs)


def _build(session: nox.Session, *options: str) -> None:
    """The build every other session starts with; their own arguments are not build options."""
    _tool(session, "build", "--env", str(VENV), *options)
    if not _project_installed():
        session.run(str(VENV_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--no-build-isolation", "-e", str(ROOT), external=True)


def _project_installed() -> bool:
    """True when .venv already has this checkout's packages installed editable."""
    probe = "import importlib.metadata as m, json; print(json.loads(m.distribution('nam56r').read_text('direct_url.json'))['url'])"
    proc = subprocess.run([str(VENV_PYTHON), "-c", probe], capture_output=True, text=True)
    return proc.returncode == 0 and proc.stdout.strip() == ROOT.as_uri()


def _venv_install(session: nox.Session, *requirements: str) -> None:
    session.run(str(VENV_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements, external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """Build (a no-op when up to date), then run the CPU test suite in .venv."""
    _build(session)
    _venv_install(session, "pytest>=8", *FORMATTERS, *TRAIN_REQUIREMENTS, *INTERPRETER_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "pytest", *(session.posargs or ["-q"]), external=True)


@nox.session
def data(session: nox.Session) -> None:
    """Build the default training corpus (PyTorch's C++ headers, byte-level BPE, Megatron .bin/.idx): `-- --help`."""
    _build(session)
    _venv_install(session, *TRAIN_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "nam56r.data", *(session.posargs or ["build"]), external=True)


@nox.session
def train(session: nox.Session) -> None:
    """Train NAM56R: `-- --recipe NAME [--dry-run] [overrides]` (`-- --help`, `-- --list`)."""
    _build(session)
    _venv_install(session, *TRAIN_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "nam56r.train", *session.posargs, external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark suites, JSON + PNG per suite under docs/bench/ (`-- --list` shows them and what each needs)."""
    _build(session)
    _venv_install(session, *TRAIN_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "nam56r.bench", *session.posargs, external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over our code (third_party/ excluded)."""
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def patches(session: nox.Session) -> None:
    """The patch-lane CLI: `nox -s patches -- status|series|check|rebase ...`."""
    if not session.posargs:
        session.error("give a command after --, e.g. `nox -s patches -- status` (`-- --help` lists them)")
    _tool(session, *session.posargs)


@nox.session
def packs(session: nox.Session) -> None:
    """The filing-pack CLI in .venv (reproducers run there): `nox -s packs -- list|run ID|preflight ID|waves|...`."""
    if not session.posargs:
        session.error("give a command after --, e.g. `nox -s packs -- list` (`-- --help` lists them)")
    _build(session)
    session.run(str(VENV_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *FORMATTERS, external=True)
    session.run(str(VENV_PYTHON), str(ROOT / "tools" / "packs.py"), *session.posargs, external=True)
