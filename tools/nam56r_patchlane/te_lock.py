"""The lock's [te] and [apex] tables: TransformerEngine and Apex, optional, pinned for `cache fill --profile gpu-te`
and `build --with-te`.

  [te]     a PyPI release: its wheels (installed as they are) and the sdist of its PyTorch extension (compiled on
           the node against the node's torch), each file with its sha256
  [apex]   a git commit of NVIDIA/apex and its tree id without submodules: `cache fill` stores `git archive` of the
           commit and accepts it only when the archive's files make that tree (apex_source.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import PatchlaneError
from .lock_fields import OBJECT_ID, Artifact, artifacts_of, require

TE_PROFILE = "gpu-te"  # `cache fill --profile gpu-te`: the gpu profile plus what `build --with-te` installs


def base_profile(profile: str) -> str:
    """The build profile a cache profile stands on: gpu-te is gpu."""
    return "gpu" if profile == TE_PROFILE else profile


@dataclass(frozen=True)
class TransformerEngine:
    version: str
    files: tuple[Artifact, ...]
    runtime: tuple[str, ...]  # what the installed files need besides each other and torch, from the index or cache
    imports: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # set while its extension compiles

    @property
    def wheels(self) -> tuple[Artifact, ...]:
        return tuple(f for f in self.files if f.is_wheel)

    @property
    def sdist(self) -> Artifact:
        return next(f for f in self.files if not f.is_wheel)


@dataclass(frozen=True)
class Apex:
    git_url: str
    ref: str  # the branch the commit was taken from; the commit is the pin
    commit: str
    tree: str  # the commit's tree id with its submodules (gitlinks) left out: what the archive must make
    imports: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # selects the extensions setup.py compiles

    @property
    def short(self) -> str:
        return self.commit[:12]


@dataclass(frozen=True)
class TeLock:
    te: TransformerEngine
    apex: Apex


def parse_te_lock(raw: dict, where: str) -> TeLock | None:
    """[te] and [apex] from the lock's parsed TOML (None when neither is there; one without the other is refused)."""
    if "te" not in raw and "apex" not in raw:
        return None
    if "te" not in raw or "apex" not in raw:
        missing = "te" if "te" not in raw else "apex"
        raise PatchlaneError(f"{where}: [{missing}] is missing", "`build --with-te` installs both: pin both, or neither")
    return TeLock(te=_parse_te(raw["te"], f"{where} [te]"), apex=_parse_apex(raw["apex"], f"{where} [apex]"))


def _env(raw: dict, where: str) -> dict[str, str]:
    env = raw.get("env", {})
    if not isinstance(env, dict):
        raise PatchlaneError(f"{where}: env must be a table of NAME = \"value\"")
    return {str(k): str(v) for k, v in env.items()}


def _parse_te(raw: dict, where: str) -> TransformerEngine:
    version = str(require(raw, "version", where))
    files = artifacts_of(raw, where)
    sdists = [f.filename for f in files if not f.is_wheel]
    if len(sdists) != 1 or not any(f.is_wheel for f in files):
        raise PatchlaneError(f"{where}: needs its wheels and exactly one sdist (the PyTorch extension) as [[te.artifact]];"
                             f" found wheels {[f.filename for f in files if f.is_wheel]}, sdists {sdists}")
    strays = [f.filename for f in files if f"-{version}" not in f.filename]
    if strays:
        raise PatchlaneError(f"{where}: {strays} are not files of version {version}")
    return TransformerEngine(version=version, files=files, runtime=tuple(str(r) for r in raw.get("runtime", ())),
                             imports=tuple(str(m) for m in raw.get("imports", ())), env=_env(raw, where))


def _parse_apex(raw: dict, where: str) -> Apex:
    ids = {key: str(require(raw, key, where)) for key in ("commit", "tree")}
    for key, value in ids.items():
        if not OBJECT_ID.match(value):
            raise PatchlaneError(f"{where}: {key} {value!r} is not a 40-hex git object id")
    return Apex(git_url=str(require(raw, "git_url", where)), ref=str(require(raw, "ref", where)), commit=ids["commit"],
                tree=ids["tree"], imports=tuple(str(m) for m in raw.get("imports", ())), env=_env(raw, where))
