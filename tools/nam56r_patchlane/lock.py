"""third_party/upstreams.toml: what each upstream is pinned to, as typed dataclasses."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import PatchlaneError
from .lock_fields import OBJECT_ID, Artifact, artifacts_of, require, sha256_of
from .patchfile import TEST_DIRS
from .te_lock import TeLock, parse_te_lock

LOCK_RELATIVE_PATH = Path("third_party/upstreams.toml")
INSTALL_MODES = ("editable", "wheel")
PROFILES = ("cpu", "gpu")

@dataclass(frozen=True)
class Upstream:
    """One pinned upstream: its git pin, its PyPI pin, and how it is installed."""

    name: str
    git_url: str
    tag: str
    commit: str
    pypi: str
    version: str
    install: str
    artifacts: tuple[Artifact, ...]
    imports: tuple[str, ...] = ()
    runtime: tuple[str, ...] = ()
    env: dict[str, dict[str, str]] = field(default_factory=dict)
    ignore_requires_python: bool = False
    # Upstream's own tests at the pinned commit, which its release artifacts lack: each root (a directory or file under
    # `tests/` or `test/`) with its git object id there. `cache fill` stores them; `upstream-tests` runs them.
    tests: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """Tree location relative to the repository root."""
        return Path("third_party") / self.name

    @property
    def requirement(self) -> str:
        return f"{self.pypi}=={self.version}"

    def artifact(self) -> Artifact:
        """The artifact materialization uses: the sdist for editable installs, else the wheel."""
        wanted_wheel = self.install == "wheel"
        for artifact in self.artifacts:
            if artifact.is_wheel == wanted_wheel:
                return artifact
        kind = "wheel" if wanted_wheel else "sdist"
        raise PatchlaneError(
            f"{self.name}: install = {self.install!r} needs a {kind} artifact in the lock",
            f"add an [[upstream.artifact]] for {self.requirement} to {LOCK_RELATIVE_PATH}",
        )

    def env_for(self, profile: str) -> dict[str, str]:
        return dict(self.env.get(profile, {}))


@dataclass(frozen=True)
class Environment:
    """What the target environment needs besides the upstreams."""

    torch: str
    torch_min: str
    build: tuple[str, ...]
    runtime: tuple[str, ...]
    per_profile: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class NoxRequirements:
    """What nox and its sessions install besides the environment (the lock's [nox] table)."""

    nox: str = ""  # nox itself, for a node that has no index: `pip install --no-index --find-links DIR/wheels nox`
    tool: tuple[str, ...] = ()  # nox's own session environments (the patch tool's dependency)
    formatters: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    interpreter: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()  # pyproject.toml optional-dependency groups the sessions install

    def requirements(self) -> list[str]:
        """Everything the sessions install from an index, nox itself first (extras excluded: see pyproject)."""
        return [r for r in (self.nox, *self.tool, *self.formatters, *self.tests, *self.interpreter) if r]


@dataclass(frozen=True)
class CorpusSource:
    """One release whose C/C++ sources the pinned training corpus is made of (nam56r.training.data.pinned)."""

    name: str  # the PyPI project
    version: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Lock:
    path: Path
    environment: Environment
    upstreams: tuple[Upstream, ...]
    nox: NoxRequirements = field(default_factory=NoxRequirements)
    corpus: tuple[CorpusSource, ...] = ()
    te: TeLock | None = None  # [te] and [apex]: what `build --with-te` installs (te_lock.py)

    def get(self, name: str) -> Upstream:
        for upstream in self.upstreams:
            if upstream.name == name:
                return upstream
        known = ", ".join(u.name for u in self.upstreams)
        raise PatchlaneError(f"unknown upstream {name!r}", f"known upstreams: {known}")

    def select(self, names: list[str] | None) -> list[Upstream]:
        return [self.get(n) for n in names] if names else list(self.upstreams)


def _parse_upstream(raw: dict, where: str) -> Upstream:
    name = str(require(raw, "name", where))
    where = f"{where} ({name})"
    commit = str(require(raw, "commit", where))
    if not OBJECT_ID.match(commit):
        raise PatchlaneError(f"{where}: commit {commit!r} is not a 40-hex git commit")
    install = str(require(raw, "install", where))
    if install not in INSTALL_MODES:
        raise PatchlaneError(f"{where}: install {install!r} is not one of {INSTALL_MODES}")
    artifacts = artifacts_of(raw, where)
    env = {p: {k: str(v) for k, v in raw.get("env", {}).get(p, {}).items()} for p in PROFILES}
    tests = {str(k): str(v) for k, v in raw.get("tests", {}).items()}
    for test_root, tree_id in tests.items():
        if not OBJECT_ID.match(tree_id):
            raise PatchlaneError(f"{where}: tests root {test_root!r}: {tree_id!r} is not a 40-hex git object id")
        if test_root.split("/", 1)[0] not in TEST_DIRS or test_root.endswith("/") or ".." in test_root.split("/"):
            raise PatchlaneError(f"{where}: tests root {test_root!r} is not a path under {' or '.join(TEST_DIRS)}/")
    return Upstream(
        name=name,
        git_url=str(require(raw, "git_url", where)),
        tag=str(require(raw, "tag", where)),
        commit=commit,
        pypi=str(require(raw, "pypi", where)),
        version=str(require(raw, "version", where)),
        install=install,
        artifacts=artifacts,
        imports=tuple(raw.get("imports", ())),
        runtime=tuple(raw.get("runtime", ())),
        env=env,
        ignore_requires_python=bool(raw.get("ignore_requires_python", False)),
        tests=tests,
    )


def load_lock(root: Path) -> Lock:
    """Read and validate the lock under repository root `root`."""
    path = root / LOCK_RELATIVE_PATH
    if not path.is_file():
        raise PatchlaneError(f"no lock file at {path}", "run from the repository root, or pass --root")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise PatchlaneError(f"{path}: invalid TOML: {exc}") from exc
    env_raw = raw.get("environment", {})
    environment = Environment(
        torch=str(env_raw.get("torch", "torch")),
        torch_min=str(env_raw.get("torch_min", "0")),
        build=tuple(env_raw.get("build", ())),
        runtime=tuple(env_raw.get("runtime", ())),
        per_profile={p: tuple(env_raw.get(p, ())) for p in PROFILES},
    )
    upstreams = tuple(_parse_upstream(u, f"{path} upstream #{i + 1}") for i, u in enumerate(raw.get("upstream", [])))
    names = [u.name for u in upstreams]
    if len(set(names)) != len(names):
        raise PatchlaneError(f"{path}: duplicate upstream names in {names}")
    return Lock(path=path, environment=environment, upstreams=upstreams, nox=_parse_nox(raw.get("nox", {}), path),
                corpus=tuple(_parse_corpus(entry, f"{path} corpus #{i + 1}") for i, entry in enumerate(raw.get("corpus", []))),
                te=parse_te_lock(raw, str(path)))


def _parse_corpus(raw: dict, where: str) -> CorpusSource:
    sha = sha256_of(raw, where)
    return CorpusSource(name=str(require(raw, "name", where)), version=str(require(raw, "version", where)),
                        filename=str(require(raw, "filename", where)), sha256=sha)


def _parse_nox(raw: dict, path: Path) -> NoxRequirements:
    known = set(NoxRequirements.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PatchlaneError(f"{path} [nox]: unknown key(s) {unknown}", f"known keys: {sorted(known)}")
    lists = {k: tuple(str(v) for v in raw.get(k, ())) for k in known if k != "nox"}
    return NoxRequirements(nox=str(raw.get("nox", "")), **lists)
