"""One filing pack, patches/packs/<id>/{pack.toml, body.md, repro.py} (schema: patches/packs/README.md): loaded,
validated against the lock and the series, and checksummed for its validation records."""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PatchlaneError
from ..lock import Lock
from ..manifest import patch_checksum
from ..patchfile import read_patch
from ..series import read_series

PACKS_RELATIVE_PATH = Path("patches/packs")
KINDS = ("issue", "pr", "comment", "regression-guard", "bug-report")
WAVES = ("crash-fix", "comment", "refactor", "bug-report", "never")  # filing priority, highest first
STATES = ("new", "overlaps", "fixed")
NEEDS = ("cpu", "gpu")
SENTINELS = ("BUG_REPRODUCED", "FIX_VALIDATED", "MEMORY_SAVE_VERIFIED")
BASE_EXITS = (0, 1)  # what a reproducer may document for its base side (README: the reproducer contract)
_ID = re.compile(r"^[0-9]{2}-[a-z0-9][a-z0-9-]*$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True)
class UpstreamState:
    state: str
    url: str
    fixed_in: str
    searched: str
    notes: str


@dataclass(frozen=True)
class Reproducer:
    script: str
    needs: str
    args: tuple[str, ...]
    base: str
    patched: tuple[str, ...]
    base_exit: int = 0  # the exit code the reproducer documents for the base side (the patched side's is always 0)
    parked: str = ""  # why it cannot run on the pinned upstream; a parked pack is reported, never run or recorded
    alone: bool = False  # its verdict times host against GPU work: it runs with no other pack or job on the machine

    def expected(self, side: str) -> tuple[tuple[str, ...], int]:
        """The sentinels a side must print and the exit code it must end with."""
        if side == "base":
            return (self.base,), self.base_exit
        return self.patched, 0


@dataclass(frozen=True)
class Filing:
    approved_by: str = ""
    approved_on: str = ""
    filed_url: str = ""
    filed_on: str = ""


@dataclass(frozen=True)
class Pack:
    id: str
    folder: Path
    title: str
    target: str
    upstream: str
    patches: tuple[str, ...]
    kind: str
    wave: str
    upstream_state: UpstreamState
    reproducer: Reproducer
    proves: tuple[str, ...]
    does_not_prove: tuple[str, ...]
    filing: Filing = field(default_factory=Filing)

    @property
    def is_guard(self) -> bool:
        """Never filed: a bug the pinned release (or upstream main) already fixed, kept as regression coverage."""
        return self.wave == "never"

    @property
    def script_path(self) -> Path:
        return self.folder / self.reproducer.script

    @property
    def body_path(self) -> Path:
        return self.folder / "body.md"

    def patch_paths(self, root: Path) -> list[Path]:
        return [root / "patches" / self.upstream / name for name in self.patches]


def _table(raw: dict, key: str, where: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise PatchlaneError(f"{where}: [{key}] must be a table")
    return value


def _strings(value, where: str, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PatchlaneError(f"{where}: {key} must be a list of strings")
    return tuple(value)


def _flag(value: object, where: str, field: str) -> bool:
    if not isinstance(value, bool):
        raise PatchlaneError(f"{where}: {field} must be true or false, not {value!r}")
    return value


def _exit_code(value, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PatchlaneError(f"{where}: {key} must be an integer exit code, got {value!r}")
    return value


def load_pack(folder: Path) -> Pack:
    where = str(folder / "pack.toml")
    try:
        raw = tomllib.loads((folder / "pack.toml").read_text())
    except FileNotFoundError:
        raise PatchlaneError(f"{folder}: no pack.toml", "see patches/packs/README.md for its fields") from None
    except tomllib.TOMLDecodeError as exc:
        raise PatchlaneError(f"{where}: invalid TOML: {exc}") from exc
    state, repro, scope, filing = (_table(raw, k, where) for k in ("upstream_state", "reproducer", "scope", "filing"))
    try:
        return Pack(
            id=raw["id"], folder=folder, title=raw["title"], target=raw["target"], upstream=raw["upstream"],
            patches=_strings(raw.get("patches", []), where, "patches"), kind=raw["kind"], wave=raw["wave"],
            upstream_state=UpstreamState(state=state["state"], url=state.get("url", ""), fixed_in=state.get("fixed_in", ""),
                                         searched=state.get("searched", ""), notes=state.get("notes", "")),
            reproducer=Reproducer(script=repro.get("script", "repro.py"), needs=repro["needs"],
                                  args=_strings(repro.get("args", []), where, "reproducer.args"), base=repro["base"],
                                  patched=_strings(repro["patched"], where, "reproducer.patched"),
                                  base_exit=_exit_code(repro.get("base_exit", 0), where, "reproducer.base_exit"),
                                  parked=str(repro.get("parked", "")), alone=_flag(repro.get("alone", False), where, "reproducer.alone")),
            proves=_strings(scope.get("proves", []), where, "scope.proves"),
            does_not_prove=_strings(scope.get("does_not_prove", []), where, "scope.does_not_prove"),
            filing=Filing(**{k: str(filing.get(k, "")) for k in Filing.__dataclass_fields__}),
        )
    except KeyError as exc:
        raise PatchlaneError(f"{where}: missing field {exc.args[0]!r}", "see patches/packs/README.md") from None


def packs_dir(root: Path) -> Path:
    return root / PACKS_RELATIVE_PATH


def load_packs(root: Path) -> list[Pack]:
    base = packs_dir(root)
    if not base.is_dir():
        return []
    return [load_pack(p) for p in sorted(base.iterdir()) if p.is_dir() and (p / "pack.toml").exists()]


def get_pack(root: Path, pack_id: str) -> Pack:
    folder = packs_dir(root) / pack_id
    if not (folder / "pack.toml").exists():
        known = ", ".join(p.id for p in load_packs(root)) or "none"
        raise PatchlaneError(f"no pack {pack_id!r} (no {folder}/pack.toml)", f"known packs: {known}")
    return load_pack(folder)


def pack_problems(pack: Pack, root: Path, lock: Lock) -> list[str]:
    """Everything wrong with a pack's metadata and files, each naming the field or file."""
    where = f"pack {pack.id}"
    problems = []
    if pack.id != pack.folder.name or not _ID.match(pack.id):
        problems.append(f"{where}: id must equal the folder name and look like '04-some-slug'")
    names = {u.name for u in lock.upstreams}
    if pack.upstream not in names:
        problems.append(f"{where}: upstream {pack.upstream!r} is not in the lock ({', '.join(sorted(names))})")
    if not re.match(r"^[\w.-]+/[\w.-]+$", pack.target):
        problems.append(f"{where}: target {pack.target!r} is not an owner/repository name")
    for key, value, allowed in (("kind", pack.kind, KINDS), ("wave", pack.wave, WAVES),
                                ("upstream_state.state", pack.upstream_state.state, STATES),
                                ("reproducer.needs", pack.reproducer.needs, NEEDS)):
        if value not in allowed:
            problems.append(f"{where}: {key} {value!r} is not one of {', '.join(allowed)}")
    state = pack.upstream_state
    if state.state == "overlaps" and not state.url.startswith("https://"):
        problems.append(f"{where}: upstream_state overlaps needs the thread's url")
    if state.state == "fixed" and not state.fixed_in:
        problems.append(f"{where}: upstream_state fixed needs fixed_in (the release or commit)")
    if state.state == "fixed" and pack.wave != "never":
        problems.append(f"{where}: already fixed upstream, so it is a regression guard: wave must be 'never'")
    if not _DATE.match(state.searched):
        problems.append(f"{where}: upstream_state.searched {state.searched!r} is not a YYYY-MM-DD date (search the tracker first)")
    for sentinel in (pack.reproducer.base, *pack.reproducer.patched):
        if sentinel not in SENTINELS:
            problems.append(f"{where}: sentinel {sentinel!r} is not one of {', '.join(SENTINELS)}")
    if pack.reproducer.base_exit not in BASE_EXITS:
        problems.append(f"{where}: reproducer.base_exit {pack.reproducer.base_exit} is not one of"
                        f" {', '.join(map(str, BASE_EXITS))} (3 means NEEDS_GPU, never a result)")
    if "FIX_VALIDATED" not in pack.reproducer.patched:
        problems.append(f"{where}: the patched tree must print FIX_VALIDATED")
    if not pack.patches and pack.reproducer.base != "FIX_VALIDATED":
        problems.append(f"{where}: a pack without patches is a regression guard: its base must print FIX_VALIDATED")
    for path in (pack.script_path, pack.body_path):
        if not path.is_file():
            problems.append(f"{where}: missing {path.relative_to(root) if path.is_relative_to(root) else path}")
    if not pack.proves or not pack.does_not_prove:
        problems.append(f"{where}: [scope] needs both proves and does_not_prove")
    if pack.upstream in names:
        listed = [e.name for e in read_series(root / "patches", pack.upstream).entries]
        order = []
        for name in pack.patches:
            if name not in listed:
                problems.append(f"{where}: patch {name} is not in patches/{pack.upstream}/series")
                continue
            order.append(listed.index(name))
            try:
                patch = read_patch(root / "patches" / pack.upstream / name)
            except (OSError, PatchlaneError) as exc:
                problems.append(f"{where}: {exc}")
                continue
            if patch.get("Pack") != pack.id:
                problems.append(f"{where}: patches/{pack.upstream}/{name} says Pack: {patch.get('Pack')}, not {pack.id}")
        if order != sorted(order):
            problems.append(f"{where}: patches must be listed in series order")
    if pack.filing.filed_on and not pack.filing.approved_by:
        problems.append(f"{where}: marked filed without a recorded approval")
    return problems


def coverage_problems(root: Path, lock: Lock) -> list[str]:
    """Every patch names a pack that lists it, or is not-for-upstream with Pack: none."""
    packs = {p.id: p for p in load_packs(root)}
    problems = []
    for upstream in lock.upstreams:
        series = read_series(root / "patches", upstream.name)
        for entry in series.entries:
            try:
                patch = read_patch(entry.path)
            except (OSError, PatchlaneError):
                continue  # missing or unreadable: check_upstream reports it
            where = f"patches/{upstream.name}/{entry.path.name}"
            pack_id, status = patch.get("Pack") or "none", patch.get("Upstream-Status") or ""
            if pack_id == "none":
                if not status.startswith("not-for-upstream:"):
                    problems.append(f"{where}: Pack: none, but Upstream-Status is not 'not-for-upstream: <reason>';"
                                    " give it a pack (patches/packs/README.md) or say why it is never filed")
            elif pack_id not in packs:
                problems.append(f"{where}: Pack: {pack_id}, but patches/packs/{pack_id}/pack.toml does not exist")
            elif entry.path.name not in packs[pack_id].patches or packs[pack_id].upstream != upstream.name:
                problems.append(f"{where}: Pack: {pack_id}, but that pack does not list it")
    return problems


def pack_checksum(pack: Pack, root: Path) -> str:
    """What a validation covers: the diffs of the pack's patches (header edits do not count), and the reproducer."""
    digest = hashlib.sha256()
    for path in pack.patch_paths(root):
        digest.update(patch_checksum(path).encode())
    digest.update(hashlib.sha256(pack.script_path.read_bytes()).hexdigest().encode() if pack.script_path.is_file() else b"")
    return digest.hexdigest()
