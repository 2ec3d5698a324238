"""nox sessions for NAM56R.

  nox -s build              materialize + patch + install the pinned upstreams into .venv
  nox -s tests              build, then the CPU test suite in that same environment
  nox -s data -- ARGS       build the default C/C++ training corpus (python -m nam56r.training.data build ARGS)
  nox -s train -- ARGS      train (python -m nam56r.training.launcher ARGS), e.g. `-- --recipe proxy-1gpu --dry-run`
  nox -s bench -- ARGS      benchmarks (python -m nam56r_bench ARGS): `-- --list`, `-- tooling`, `-- kernels` ...
  nox -s prewarm -- ARGS    a portable compiled-kernel cache for recipes (python -m nam56r.training.launcher.kernel_cache_cli prewarm ARGS)
  nox -s gpu-check -- ARGS  a GPU node's acceptance check (python -m nam56r.training.gpu_check): GPU tests, GPU packs, tiny train + resume
  nox -s lint               ruff
  nox -s mutants -- NAMES   mutation testing of the patch lane's and the recipe's checks (mutmut.toml); on demand, not in CI
  nox -s patches -- CMD     the patch-lane CLI (tools/apply_patches.py CMD), e.g. `-- status`, `-- check`
  nox -s packs -- CMD       the filing-pack CLI (tools/packs.py CMD), e.g. `-- list`, `-- run ID`, `-- waves`

`.venv` is the environment the stack runs in (training, tests, reproducers). nox's own session
environments only carry the patch tool's dependency (GitPython).
Pass build options after `--`: `nox -s build -- --profile cpu --cache DIR --offline`. With a GPU
machine's own CUDA torch: `nox -s build -- --base-python /path/to/bin/python` (.venv sees its packages).
After an offline build, every session installs from that cache (.venv records it).
One build at a time writes the checkout: a second waits for the first, naming it; `nox -s build --
--lock-timeout 0` refuses at once instead (exit 75), `--lock-timeout SECONDS` waits that long at most.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from nam56r_patchlane import noxsupport  # noqa: E402  (standard library only: nox's interpreter has no GitPython)

VENV = ROOT / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
TOOL = str(ROOT / "tools" / "apply_patches.py")

# What the sessions install besides the environment: the lock's [nox] table (an offline cache carries these too).
_NOX = tomllib.loads((ROOT / "third_party" / "upstreams.toml").read_text())["nox"]
TOOL_REQUIREMENTS = _NOX["tool"]
FORMATTERS = _NOX["formatters"]
TEST_REQUIREMENTS = _NOX["tests"]
INTERPRETER_REQUIREMENTS = _NOX["interpreter"]
# `nox -s mutants` only, on demand: kept out of the lock's [nox] table so that offline caches need not carry it.
# mutmut 3.8 supports Python 3.10 to 3.14.
MUTATION_REQUIREMENTS = ["mutmut==3.8.1"]
# The training extras, read from pyproject.toml so the list lives in one place.
TRAIN_REQUIREMENTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]

nox.options.sessions = ["build"]
nox.options.reuse_venv = "yes"


def _tool(session: nox.Session, *args: str) -> None:
    """apply_patches.py ARGS in nox's session environment; with `--offline` among ARGS, GitPython comes from the cache."""
    session.install(*noxsupport.install_source(args).pip_args(), *TOOL_REQUIREMENTS)
    session.run("python", TOOL, *args)


@nox.session
def build(session: nox.Session) -> None:
    """Materialize the four pinned upstreams, apply their patch series, install them editable into .venv."""
    _build(session, *session.posargs)


def _build(session: nox.Session, *options: str) -> None:
    """The build every other session starts with; their own arguments are not build options. Without
    options it replays .venv's last offline build (cache, profile), so sessions never reach an index then."""
    try:
        options, origin = noxsupport.session_build_options(VENV, options)
    except ValueError as exc:
        session.error(str(exc))
    if origin:
        session.log(origin)
    _tool(session, "build", "--env", str(VENV), *options)
    if not _project_installed():
        session.run(str(VENV_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    *noxsupport.install_source(options).pip_args(), "--no-deps", "--no-build-isolation", "-e", str(ROOT),
                    external=True)


def _project_installed() -> bool:
    """True when .venv already has this checkout's packages installed editable."""
    probe = "import importlib.metadata as m, json; print(json.loads(m.distribution('nam56r').read_text('direct_url.json'))['url'])"
    proc = subprocess.run([str(VENV_PYTHON), "-c", probe], capture_output=True, text=True)
    return proc.returncode == 0 and proc.stdout.strip() == ROOT.as_uri()


def _venv_install(session: nox.Session, *requirements: str) -> None:
    """pip install into .venv, from the offline cache when .venv was built offline."""
    source = noxsupport.install_source(noxsupport.recorded_build_options(VENV)).pip_args()
    session.run(str(VENV_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *source, *requirements,
                external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """Build (a no-op when up to date), then run the CPU test suite in .venv."""
    _build(session)
    _venv_install(session, *TEST_REQUIREMENTS, *FORMATTERS, *TRAIN_REQUIREMENTS, *INTERPRETER_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "pytest", *(session.posargs or ["-q"]), external=True)


@nox.session
def data(session: nox.Session) -> None:
    """Build the default training corpus (the pinned C/C++ releases, deduplicated, byte-level BPE, Megatron .bin/.idx): `-- --help`."""
    _build(session)
    _venv_install(session, *TRAIN_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "nam56r.training.data", *(session.posargs or ["build"]), external=True)


@nox.session
def train(session: nox.Session) -> None:
    """Train NAM56R: `-- --recipe NAME [--dry-run] [overrides]` (`-- --help`, `-- --list`)."""
    _build(session)
    _venv_install(session, *TRAIN_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "nam56r.training.launcher", *session.posargs, external=True)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark suites, JSON + PNG per suite under docs/bench/ (`-- --list` shows them and what each needs)."""
    _build(session)
    _venv_install(session, *TRAIN_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "nam56r_bench", *session.posargs, external=True)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over our code (third_party/ excluded)."""
    session.install("ruff")
    session.run("ruff", "check", ".")


# mutmut names a mutant by its file's path under src/, which must be the import name: the session runs in a stage
# whose src/ links the two import roots in, beside the tests, with mutmut.toml as its pyproject.toml.
MUTATION_STAGE = ROOT / "build" / "mutation"
MUTATION_LINKS = {"src/nam56r_patchlane": "tools/nam56r_patchlane", "src/nam56r": "nam56r", "tests": "tests",
                  "kernels": "kernels", "bench": "bench", "mutants/third_party": "third_party"}
# The recipe's checks, not its presets or lowering; every function of the patch-lane modules mutmut.toml names.
MUTANTS = ("nam56r_patchlane.*", "nam56r.training.recipe_checks.*")


@nox.session
def mutants(session: nox.Session) -> None:
    """mutmut over the patch lane's apply, artifact, cache-manifest, scrub and pack-verdict modules and the recipe's
    checks, each against the tests that cover it (mutmut.toml); prints killed / total and the survivors. `-- NAMES`
    runs only the mutants matching those mutmut names (globs)."""
    _build(session)
    _venv_install(session, *TEST_REQUIREMENTS, *TRAIN_REQUIREMENTS, *INTERPRETER_REQUIREMENTS, *MUTATION_REQUIREMENTS)
    MUTATION_STAGE.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / "mutmut.toml", MUTATION_STAGE / "pyproject.toml")
    for link, target in MUTATION_LINKS.items():
        path = MUTATION_STAGE / link
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_symlink():
            path.symlink_to(ROOT / target)
    session.chdir(MUTATION_STAGE)
    names = session.posargs or MUTANTS
    # mutmut exits 1 when mutants survive; a run that checked none (its stats or test collection failed) is an error.
    session.run(str(VENV_PYTHON), "-m", "mutmut", "run", *names, external=True, success_codes=[0, 1])
    listing = session.run(str(VENV_PYTHON), "-m", "mutmut", "results", "--all", "true", external=True, silent=True) or ""
    status = dict(line.strip().rsplit(": ", 1) for line in listing.splitlines() if line.startswith("    "))
    status = {name: s for name, s in status.items() if any(fnmatch.fnmatchcase(name, pattern) for pattern in names)}
    checked = {name: s for name, s in status.items() if s not in ("not checked", "skipped")}
    if not checked:
        session.error(f"mutmut checked no mutant matching {' '.join(names)}: its output above says why")
    killed = [name for name, s in checked.items() if s in ("killed", "timeout", "caught by type check")]
    survivors = sorted(name for name in checked if name not in killed)
    for name in survivors:
        session.log(f"  {checked[name]}: {name}  (`mutmut show {name}` in {MUTATION_STAGE})")
    session.log(f"mutation score: {len(killed)} of {len(checked)} mutants killed ({len(survivors)} survived or untested)")


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
    _venv_install(session, *FORMATTERS)
    session.run(str(VENV_PYTHON), str(ROOT / "tools" / "packs.py"), *session.posargs, external=True)


@nox.session
def prewarm(session: nox.Session) -> None:
    """Compile recipes' kernels into a portable kernel cache on a GPU node: `-- --out DIR [--recipe R ...] [--mbs N]`."""
    _build(session)
    _venv_install(session, *TRAIN_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "nam56r.training.launcher.kernel_cache_cli", "prewarm", *session.posargs, external=True)


@nox.session(name="gpu-check")
def gpu_check(session: nox.Session) -> None:
    """A GPU node's acceptance check (python -m nam56r.training.gpu_check): GPU tests, GPU packs, tiny train + resume; one JSON summary."""
    _build(session)
    _venv_install(session, *TEST_REQUIREMENTS, *TRAIN_REQUIREMENTS)
    session.run(str(VENV_PYTHON), "-m", "nam56r.training.gpu_check", *session.posargs, external=True)


nox.session(name="gpu_check")(gpu_check)  # nox matches a session's name exactly: both spellings run it
