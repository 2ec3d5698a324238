"""`packs run`: a pack's reproducer on the unpatched base and on the patched tree, side by side.

Both sides are shared clones of the built tree third_party/<upstream> (made by `apply_patches.py
build`), checked out at a commit of its `patched` branch:
  base     the parent of the pack's first patch (a regression guard: the pinned release itself)
  patched  the tip of the series
Each side is judged by what pack.toml documents for it (the sentinels, and for the base side
`base_exit`, 0 unless stated) and appended to the validation manifest with the host stamp of the
machine it ran on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import PatchlaneError
from ..gittree import UpstreamTree, is_git_tree
from ..lock import Lock
from ..manifest import Record, append_record, now_utc, parse_host_line
from ..series import read_series
from .pack import SENTINELS, Pack, pack_checksum

EXIT_NEEDS_GPU = 3
SIDES = ("base", "patched")
_REPORTED = (*SENTINELS, "NEEDS_GPU", "NOT_REPRODUCED", "OTHER_FAILURE")  # the last two: attempts that found something else


@dataclass(frozen=True)
class SideResult:
    side: str
    commit: str
    command: list[str]
    exit_code: int
    output: str
    sentinels: tuple[str, ...]
    problems: tuple[str, ...]

    @property
    def needs_gpu(self) -> bool:
        return self.exit_code == EXIT_NEEDS_GPU and "NEEDS_GPU" in self.sentinels

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"side": self.side, "commit": self.commit, "command": self.command, "exit_code": self.exit_code,
                "sentinels": list(self.sentinels), "problems": list(self.problems)}


# ERROR: the pack could not be run (its problems say why); PARKED: pack.toml says why it cannot run on the pin.
VERDICTS = ("passed", "FAILED", "NEEDS_GPU", "PARKED", "ERROR")


@dataclass(frozen=True)
class PackOutcome:
    """One pack's run: its verdict, each side's result, and the manifest records appended for it."""

    pack: str
    verdict: str
    sides: tuple[SideResult, ...] = ()
    problems: tuple[str, ...] = ()
    records: tuple[Record, ...] = ()
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return {"passed": 0, "PARKED": 0, "NEEDS_GPU": EXIT_NEEDS_GPU}.get(self.verdict, 1)

    def to_json(self) -> dict:
        return {"pack": self.pack, "verdict": self.verdict, "exit_code": self.exit_code, "seconds": round(self.seconds, 3),
                "problems": list(self.problems), "sides": [s.to_json() for s in self.sides],
                "records": [asdict(r) for r in self.records]}


def side_commits(pack: Pack, root: Path, lock: Lock) -> tuple[UpstreamTree, dict[str, str]]:
    """The built tree and the commit of each side; refuses a tree out of step with its series."""
    upstream = lock.get(pack.upstream)
    path = root / upstream.path
    hint = "run `nox -s build` (or `python tools/apply_patches.py build`) first"
    if not is_git_tree(path):
        raise PatchlaneError(f"{path} is not materialized", hint)
    tree = UpstreamTree(path)
    state = tree.read_state()
    series = read_series(root / "patches", upstream.name)
    wanted = [(e.name, e.sha256()) for e in series.entries]
    if state is None or [(a.name, a.sha256) for a in state.applied] != wanted or tree.head() != (
            state.applied[-1].commit if state.applied else state.base_commit):
        raise PatchlaneError(f"{path} does not hold the current patches/{upstream.name}/series", hint)
    if tree.dirty_paths():
        raise PatchlaneError(f"{path} has uncommitted edits, which neither side would contain",
                             "record them as a patch (apply_patches.py refresh/new) or stash them, then run again")
    commits = {a.name: a.commit for a in state.applied}
    if pack.patches:
        base = tree.git("rev-parse", f"{commits[pack.patches[0]]}^").stdout.strip()
    else:
        base = state.base_commit
    return tree, {"base": base, "patched": tree.head()}


def _found_sentinels(output: str) -> tuple[str, ...]:
    found = []
    for line in output.splitlines():
        word = line.split(":", 1)[0].split(" ", 1)[0].strip()
        if word in _REPORTED and word not in found:
            found.append(word)
    return tuple(found)


def expected_problems(pack: Pack, side: str, exit_code: int, output: str, found: tuple[str, ...]) -> list[str]:
    """What is wrong with a side's run against what pack.toml documents for that side; [] when it behaved so."""
    wanted, wanted_exit = pack.reproducer.expected(side)
    problems = []
    first = next((line for line in output.splitlines() if line.strip()), "")
    if not first.startswith("host: "):
        problems.append(f"{side}: the first output line is not a host stamp ('host: gpu=...'): {first[:80]!r}")
    missing = [s for s in wanted if s not in found]
    if missing:
        problems.append(f"{side}: expected {', '.join(wanted)}; missing {', '.join(missing)} (printed: {', '.join(found) or 'none'})")
    contrary = {"BUG_REPRODUCED": "FIX_VALIDATED", "FIX_VALIDATED": "BUG_REPRODUCED"}
    for sentinel in wanted:
        if contrary.get(sentinel) in found:
            problems.append(f"{side}: printed {contrary[sentinel]} as well as {sentinel}")
    if exit_code != wanted_exit:
        documented = (f"pack.toml documents exit {wanted_exit} for the base side (reproducer.base_exit)" if side == "base"
                      else "0 means the sentinel matched the tree")
        problems.append(f"{side}: exit code {exit_code} ({documented})")
    return problems


def run_side(pack: Pack, side: str, trees: dict[str, Path], python: str, timeout: float | None, log=print) -> SideResult:
    values = {"base": str(trees["base"]), "patched": str(trees["patched"])}
    args = [a.replace("{base}", values["base"]).replace("{patched}", values["patched"]) for a in pack.reproducer.args]
    command = [python, str(pack.script_path), "--tree", str(trees[side]), *args]
    log(f"[{side}] $ {' '.join(command)}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    lines = []
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=pack.folder)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            log(f"[{side}] {line.rstrip()}")
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
        lines.append(f"(killed after {timeout} s)\n")
    output = "".join(lines)
    found = _found_sentinels(output)
    needs_gpu = code == EXIT_NEEDS_GPU and "NEEDS_GPU" in found
    problems = () if needs_gpu else tuple(expected_problems(pack, side, code, output, found))
    commit = UpstreamTree(trees[side]).head()
    return SideResult(side=side, commit=commit, command=command, exit_code=code, output=output, sentinels=found, problems=problems)


def _figures(output: str) -> str:
    keep = [line.strip() for line in output.splitlines() if line.startswith(("MEMORY_SAVE_VERIFIED", "FIX_VALIDATED", "BUG_REPRODUCED"))]
    return " | ".join(keep)[:2000]


_RECORDING = threading.Lock()  # `packs run --jobs` records from several threads of one process


def record_side(root: Path, lock: Lock, pack: Pack, result: SideResult) -> Record:
    first = next(line for line in result.output.splitlines() if line.strip())
    script = pack.script_path.relative_to(root) if pack.script_path.is_relative_to(root) else pack.script_path
    args = " ".join(pack.reproducer.args)
    record = Record(
        what=f"pack:{pack.id}", upstream=pack.upstream, upstream_commit=lock.get(pack.upstream).commit,
        patch_sha256=pack_checksum(pack, root), host=parse_host_line(first.strip()),
        command=f"python tools/packs.py run {pack.id}  ({result.side}: python {script} --tree <{result.side} tree> {args})".rstrip(),
        exit_code=result.exit_code, sentinels=result.sentinels, date=now_utc(), figures=_figures(result.output),
        pack=pack.id, side=result.side, tree_commit=result.commit,
    )
    append_record(root, record)
    return record


def run_pack(pack: Pack, root: Path, lock: Lock, python: str = sys.executable, sides: tuple[str, ...] = SIDES,
             record: bool = True, timeout: float | None = None, keep: Path | None = None, log=print) -> PackOutcome:
    """Run the reproducer on each side and judge it by pack.toml: passed (every side did what pack.toml
    documents, recorded), FAILED (a side did not; recorded too), NEEDS_GPU (nothing measured or recorded)."""
    started = time.monotonic()
    if pack.reproducer.parked:
        log(f"{pack.id}: PARKED: {pack.reproducer.parked} (not run, nothing recorded)")
        return PackOutcome(pack.id, "PARKED", seconds=time.monotonic() - started)
    tree, commits = side_commits(pack, root, lock)
    scratch = Path(tempfile.mkdtemp(prefix=f"pack-{pack.id}-")) if keep is None else keep
    try:
        trees = {side: tree.shared_clone(scratch / side, commits[side], "side").path for side in SIDES}
        log(f"{pack.id}: base {commits['base'][:12]}, patched {commits['patched'][:12]} ({pack.upstream}); trees in {scratch}")
        results = tuple(run_side(pack, side, trees, python, timeout, log) for side in sides)
    finally:
        if keep is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if any(r.needs_gpu for r in results):
        log(f"{pack.id}: NEEDS_GPU: the reproducer needs a CUDA GPU and this host has none; nothing was recorded")
        return PackOutcome(pack.id, "NEEDS_GPU", results, seconds=time.monotonic() - started)
    records = []
    for result in results if record else ():
        try:  # failures are recorded too: the manifest is the history, preflight reads the latest pass
            with _RECORDING:
                records.append(record_side(root, lock, pack, result))
        except PatchlaneError as exc:
            log(f"  {result.side}: not recorded: {exc}")
    problems = tuple(p for r in results for p in r.problems)
    for problem in problems:
        log(f"  ERROR {problem}")
    verdict = "passed" if not problems else "FAILED"
    recorded = " (recorded in patches/manifest.toml)" if record else " (not recorded: --no-record)"
    log(f"{pack.id}: {verdict}: " + ", ".join(f"{r.side} exit {r.exit_code} {'/'.join(r.sentinels) or '-'}" for r in results) + recorded)
    return PackOutcome(pack.id, verdict, results, problems, tuple(records), time.monotonic() - started)
