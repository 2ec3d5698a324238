"""`packs preflight`: the pre-filing checklist, executable. Every item that fails is named. (The training
preflight, which gates a run, is nam56r.training.launcher.preflight; the two share nothing but the word.)

1. The reproducer passed, on both sides, on a named host within the last N days, for the current
   patch and reproducer checksum (the manifest decides, not the body's prose); so did upstream's own
   tests covering the patches (upstream_tests_item.py).
2. body.md renders as GitHub markdown (fences closed, tables well formed).
3. The reproducer is attached as a file, not pasted into the body.
4. No private infrastructure anywhere in what would be posted (body, patches, reproducer, pack.toml,
   manifest excerpt).
5. Megatron-LM targets: the upstream formatter (black, isort, with Megatron's own configuration)
   is clean on the lines the patches change.
6. The upstream state is recorded (searched, with a result).
7. A person recorded the filing approval (`packs approve`).
"""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..lock import Lock
from ..manifest import read_records
from ..patchfile import read_patch
from .markdown_check import markdown_problems
from .pack import Pack, pack_checksum, pack_problems
from .records import manifest_excerpt, passing_records
from .run import side_commits
from .scrub import added_lines, load_config, scan_text
from .upstream_tests_item import NAME as UPSTREAM_TESTS_ITEM
from .upstream_tests_item import upstream_tests_problems

MEGATRON_TARGET = "NVIDIA/Megatron-LM"
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Item:
    name: str
    problems: tuple[str, ...]
    skipped: str = ""  # why the item does not apply to this pack

    @property
    def ok(self) -> bool:
        return not self.problems


def _date(text: str) -> dt.date:
    return dt.date.fromisoformat(text[:10])


def manifest_item(pack: Pack, root: Path, today: dt.date, max_age_days: int) -> Item:
    checksum = pack_checksum(pack, root)
    latest = passing_records(pack, root, checksum)
    problems = []
    for side in ("base", "patched"):
        record = latest.get(side)
        if record is None:
            others = [r for r in read_records(root) if r.get("pack") == pack.id and r.get("side") == side]
            why = ("only for an older patch/reproducer checksum" if any(r.get("patch_sha256") != checksum for r in others)
                   else "never passed" if others else "no record")
            problems.append(f"manifest: no passing {side} run for the current checksum ({why}); run `python tools/packs.py run {pack.id}`")
            continue
        age = (today - _date(record["date"])).days
        if age > max_age_days:
            problems.append(f"manifest: the last passing {side} run is {age} days old ({record['date']}, {record['host']['gpu']});"
                            f" the limit is {max_age_days}: run it again")
    return Item("reproducer passed recently (manifest)", tuple(problems))


def upstream_tests_item(pack: Pack, root: Path, today: dt.date, max_age_days: int) -> Item:
    problems, skipped = upstream_tests_problems(pack.patch_paths(root), root, pack.upstream, today, max_age_days)
    return Item(UPSTREAM_TESTS_ITEM, tuple(problems), skipped)


def attachment_item(pack: Pack) -> Item:
    body = pack.body_path.read_text() if pack.body_path.is_file() else ""
    problems = []
    if pack.reproducer.script not in body:
        problems.append(f"body.md never names the attached reproducer {pack.reproducer.script!r}")
    if pack.script_path.is_file():
        code = {line.strip() for line in pack.script_path.read_text().splitlines() if len(line.strip()) > 30}
        pasted = [line for line in body.splitlines() if line.strip() in code]
        if len(pasted) >= 3:
            problems.append(f"body.md pastes {len(pasted)} lines of {pack.reproducer.script} (e.g. {pasted[0].strip()[:60]!r}):"
                            " attach the file instead")
    return Item("reproducer attached, not pasted", tuple(problems))


def bundle_texts(pack: Pack, root: Path) -> dict[str, str]:
    """What would be posted or attached, by name (patches: only our header, description and added lines)."""
    texts = {}
    for path in (pack.body_path, pack.script_path, pack.folder / "pack.toml"):
        if path.is_file():
            texts[str(path.relative_to(root))] = path.read_text()
    for path in pack.patch_paths(root):
        if path.is_file():
            texts[str(path.relative_to(root))] = added_lines(path.read_text())
    return texts


def scrub_item(pack: Pack, root: Path, extra: dict[str, str] | None = None) -> Item:
    config = load_config(root)
    texts = {**bundle_texts(pack, root), **(extra or {})}
    findings = [f for name, text in texts.items() for f in scan_text(text, name, config)]
    return Item("no private infrastructure in the bundle", tuple(f"private: {f}" for f in findings))


def _added_ranges(diff: str) -> dict[str, list[tuple[int, int]]]:
    """Per file (b/ path), the new-file line ranges of added lines."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    current, line_no = None, 0
    for line in diff.splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
            continue
        hunk = _HUNK.match(line)
        if hunk:
            line_no = int(hunk.group(1))
            continue
        if current is None or line.startswith(("diff --git", "index ", "--- ", "new file", "deleted file", "similarity")):
            continue
        if line.startswith("+"):
            spans = ranges.setdefault(current, [])
            if spans and spans[-1][1] == line_no - 1:
                spans[-1] = (spans[-1][0], line_no)
            else:
                spans.append((line_no, line_no))
            line_no += 1
        elif line.startswith(" "):
            line_no += 1
    return ranges


def formatter_item(pack: Pack, root: Path, lock: Lock, python: str) -> Item:
    name = "upstream formatter clean on the changed lines (black, isort)"
    if pack.target != MEGATRON_TARGET:
        return Item(name, (), skipped=f"{pack.target} has no required formatter in its PR checklist")
    if not pack.patches:
        return Item(name, (), skipped="no patch to format")
    for tool in ("black", "isort"):
        if subprocess.run([python, "-m", tool, "--version"], capture_output=True).returncode != 0:
            return Item(name, (f"{tool} is not installed for {python}: pip install 'black==26.*' isort"
                               " (Megatron's pyproject requires black 26)",))
    tree, commits = side_commits(pack, root, lock)
    problems = []
    with tempfile.TemporaryDirectory(prefix="pack-format-") as tmp:
        side = tree.shared_clone(Path(tmp) / "patched", commits["patched"], "side")
        config = side.path / "pyproject.toml"  # the upstream's own black/isort settings, when it has them
        black_config = ["--config", str(config)] if config.is_file() else []
        isort_config = ["--settings-path", str(config)] if config.is_file() else []
        for patch_path in pack.patch_paths(root):
            for rel, spans in _added_ranges(read_patch(patch_path).diff).items():
                if not rel.endswith(".py") or not (side.path / rel).is_file():
                    continue
                ranges = [f"--line-ranges={a}-{b}" for a, b in spans]
                black = subprocess.run([python, "-m", "black", "--check", "--diff", "--quiet", *black_config, *ranges, rel],
                                       cwd=side.path, capture_output=True, text=True)
                if black.returncode != 0:
                    problems.append(f"black: {patch_path.name} leaves {rel} unformatted:\n{black.stdout.strip()[:1500]}")
                isort = subprocess.run([python, "-m", "isort", "--check-only", "--diff", *isort_config, rel],
                                       cwd=side.path, capture_output=True, text=True)
                if isort.returncode != 0:
                    problems.append(f"isort: {rel} imports are not sorted after {patch_path.name}:\n{isort.stdout.strip()[:1500]}")
    return Item(name, tuple(problems))


def state_item(pack: Pack) -> Item:
    state = pack.upstream_state
    problems = []
    if not state.searched:
        problems.append("upstream_state.searched is empty: search the target's issues and PRs, record the date and result")
    if not state.notes:
        problems.append("upstream_state.notes is empty: say what the search found")
    return Item("upstream state recorded", tuple(problems))


def approval_item(pack: Pack) -> Item:
    if pack.is_guard:
        return Item("filing approval recorded", ("a regression guard (wave 'never') is never filed",))
    if not pack.filing.approved_by or not pack.filing.approved_on:
        return Item("filing approval recorded",
                    (f"no approval recorded: a person runs `python tools/packs.py approve {pack.id} --by NAME`",))
    return Item("filing approval recorded", ())


def run_filing_checklist(pack: Pack, root: Path, lock: Lock, today: dt.date, max_age_days: int, python: str = sys.executable,
                         with_approval: bool = True) -> list[Item]:
    """Every item of the checklist for one pack, in the order `packs preflight` prints them; without
    with_approval, all but the person's approval (what "ready" means to `packs waves` and `packs approve`)."""
    items = [Item("pack.toml valid", tuple(pack_problems(pack, root, lock))),
             manifest_item(pack, root, today, max_age_days),
             upstream_tests_item(pack, root, today, max_age_days)]
    body = pack.body_path.read_text() if pack.body_path.is_file() else ""
    items.append(Item("body.md renders on GitHub", tuple(markdown_problems(body, "body.md"))))
    excerpt = {f"{pack.id}/validation.md (export)": manifest_excerpt(pack, root)}
    items += [attachment_item(pack), scrub_item(pack, root, excerpt), formatter_item(pack, root, lock, python), state_item(pack)]
    if with_approval:
        items.append(approval_item(pack))
    return items


def report_filing_checklist(pack: Pack, items: list[Item], log=print) -> int:
    """Print the items, each with its problems; 0 when every item holds, else 1 (the exit code of `packs preflight`)."""
    log(f"preflight {pack.id} ({pack.kind} to {pack.target}):")
    for item in items:
        mark = "skip" if item.skipped else ("ok" if item.ok else "FAIL")
        log(f"  [{mark:>4}] {item.name}" + (f" ({item.skipped})" if item.skipped else ""))
        for problem in item.problems:
            log("         " + problem.replace("\n", "\n         "))
    failed = [i for i in items if not i.ok]
    log(f"preflight {pack.id}: " + ("passed" if not failed else f"FAILED ({len(failed)} item(s))"))
    return 0 if not failed else 1
