"""Series operations on one materialized tree: sync (build), push, pop, new, refresh, import, export.

Invariants:
- A patch is applied with `git apply` and zero fuzz; offsets are reported. A patch that does not
  apply stops everything, naming the upstream, patch file, file and hunk, and the tree stays at the
  last patch that applied.
- Before anything moves HEAD or touches files, `ensure_no_unsaved_work` refuses when the tree has
  uncommitted edits or commits that no series file holds. `--discard` overrides that, and even
  then the work is kept under refs/patchlane/discarded/ in the tree's git.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import PatchApplyError, PatchlaneError, WorkAtRiskError
from .gittree import AppliedPatch, TreeState, UpstreamTree
from .patchfile import PatchFile, merge_sections, parse_commit_message, parse_patch_text, read_patch
from .series import Series, SeriesEntry, slug_from_subject

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
_FAILED_AT = re.compile(r"error: patch failed: (.+):(\d+)")
_FAILED_FILE = re.compile(r"error: (.+): (does not exist in index|No such file or directory|already exists in index|patch does not apply)")
HUNK_OFFSET = re.compile(r"Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)")
CLI = "python tools/apply_patches.py"


@dataclass(frozen=True)
class ApplyOutcome:
    name: str
    offsets: tuple[str, ...]  # "file hunk #N offset K"


def _hunk_for(patch: PatchFile, path: str, line: int) -> str:
    """The hunk of `path` that git reported failing at old-file line `line`."""
    current = None
    best = None
    number = 0
    for text in patch.diff.splitlines():
        if text.startswith("diff --git "):
            current = text.split(" b/", 1)[1]
            number = 0
        elif current == path and (m := _HUNK_HEADER.match(text)):
            number += 1
            if int(m.group(1)) <= line:
                best = f"hunk #{number} ({text.split(' @@')[0]} @@)"
    return best or f"the hunk at line {line}"


def describe_apply_failure(patch: PatchFile, stderr: str) -> list[str]:
    """Turn git apply's stderr into 'file, hunk' lines."""
    where = []
    for m in _FAILED_AT.finditer(stderr):
        where.append(f"{m.group(1)}: {_hunk_for(patch, m.group(1), int(m.group(2)))} does not match")
    for m in _FAILED_FILE.finditer(stderr):
        if m.group(2) != "patch does not apply":
            where.append(f"{m.group(1)}: {m.group(2)}")
    return where or [stderr.strip()]


def git_apply(tree: UpstreamTree, patch: PatchFile, check_only: bool = False, extra: tuple[str, ...] = (),
              with_tests: bool = False) -> tuple[bool, str]:
    """Apply the patch's diff to the tree's index and files; its upstream-test sections only `with_tests` (a tree that
    holds upstream's tests, which release artifacts lack)."""
    diff = patch.diff if with_tests else patch.code_diff()
    if not diff:
        return True, ""
    args = ["apply", "--verbose", "--whitespace=nowarn", *extra]
    args.append("--check" if check_only else "--index")
    result = tree.git(*args, "-", stdin=diff, check=False)
    return result.returncode == 0, result.stdout + result.stderr


def apply_patch(tree: UpstreamTree, upstream: str, entry: SeriesEntry) -> tuple[AppliedPatch, ApplyOutcome]:
    patch = read_patch(entry.path)
    ok, output = git_apply(tree, patch)
    if not ok:
        details = "\n".join(f"    {d}" for d in describe_apply_failure(patch, output))
        raise PatchApplyError(
            f"{upstream}: patch {entry.path} does not apply:\n{details}",
            f"the tree is left at the last patch that applied; fix the patch (or `{CLI} rebase`) and build again",
        )
    commit = tree.commit(patch.commit_message(), allow_empty=not patch.code_diff())
    offsets = tuple(f"hunk #{m.group(1)} at line {m.group(2)} (offset {m.group(3)})" for m in HUNK_OFFSET.finditer(output))
    return AppliedPatch(name=entry.name, sha256=entry.sha256(), commit=commit), ApplyOutcome(entry.name, offsets)


def unsaved_work(tree: UpstreamTree, state: TreeState) -> tuple[list[str], list[str]]:
    """(uncommitted paths, commits that no recorded series patch produced)."""
    recorded = [a.commit for a in state.applied]
    commits = tree.commits_since(state.base_commit)
    foreign = [c for c in commits if c not in recorded]
    return tree.dirty_paths(), foreign


def ensure_no_unsaved_work(tree: UpstreamTree, state: TreeState, discard: bool, log=print) -> None:
    dirty, foreign = unsaved_work(tree, state)
    if not dirty and not foreign:
        return
    if discard:
        ref = stamp = f"refs/patchlane/discarded/{time.strftime('%Y%m%d-%H%M%S')}"
        for n in range(2, 1000):  # a second --discard within the same second must not overwrite the first
            if tree.git("rev-parse", "--verify", "--quiet", ref, check=False).returncode != 0:
                break
            ref = f"{stamp}-{n}"
        sha = tree.save_ref(ref)
        log(f"  --discard: {len(dirty)} edited path(s) and {len(foreign)} unexported commit(s) set aside as"
            f" {ref} ({sha[:12]}) in {tree.path}; `git -C {tree.path} show {ref}` brings them back")
        return
    lines = [f"    edited: {p}" for p in dirty[:10]] + [f"    commit: {c[:12]} {tree.message(c).splitlines()[0]}" for c in foreign[:10]]
    more = len(dirty) + len(foreign) - len(lines)
    if more > 0:
        lines.append(f"    ... and {more} more")
    name = state.upstream
    raise WorkAtRiskError(
        f"{name}: {tree.path} holds work that is not in patches/{name}/series; refusing to touch it:\n" + "\n".join(lines),
        f"keep it: `{CLI} refresh -u {name}` (fold into the top patch), `{CLI} new SLUG -u {name} ...` (edits as a new"
        f" patch) or `{CLI} export -u {name}` (commits as patches); drop it: rerun with --discard",
    )


def applied_prefix(state: TreeState, series: Series) -> int:
    """How many leading series entries the tree holds exactly as the files now are."""
    count = 0
    for recorded, entry in zip(state.applied, series.entries, strict=False):
        if recorded.name != entry.name or not entry.path.is_file() or recorded.sha256 != entry.sha256():
            break
        count += 1
    return count


def in_sync(tree: UpstreamTree, state: TreeState, series: Series) -> bool:
    n = len(series.entries)
    return applied_prefix(state, series) == n == len(state.applied) and tree.head() == (
        state.applied[-1].commit if state.applied else state.base_commit
    )


def sync_series(tree: UpstreamTree, state: TreeState, series: Series, discard: bool, log=print) -> bool:
    """Make the tree hold exactly the series. Returns False if it already did (no-op)."""
    synced = in_sync(tree, state, series)
    if synced and not (discard and tree.dirty_paths()):
        return False
    ensure_no_unsaved_work(tree, state, discard, log)
    if synced:  # --discard with the series already applied: only the edits (now set aside) go
        tree.reset_hard(tree.head())
        return True
    reason = "first apply" if not state.applied else "the series changed"
    log(f"  {reason}: applying {len(series.entries)} patch(es) from the base {state.base_commit[:12]}")
    tree.reset_hard(state.base_commit)
    state.applied = []
    tree.write_state(state)
    push_patches(tree, state, series, len(series.entries), log)
    return True


def push_patches(tree: UpstreamTree, state: TreeState, series: Series, upto: int, log=print) -> None:
    """Apply series entries len(state.applied)..upto-1, recording each as it lands."""
    for entry in series.entries[len(state.applied) : upto]:
        applied, outcome = apply_patch(tree, series.upstream, entry)
        state.applied.append(applied)
        tree.write_state(state)
        note = f" with offsets: {'; '.join(outcome.offsets)}" if outcome.offsets else ""
        log(f"    applied {entry.name}{note}")


def pop_patches(tree: UpstreamTree, state: TreeState, keep: int, discard: bool, log=print) -> None:
    ensure_no_unsaved_work(tree, state, discard, log)
    for popped in state.applied[keep:][::-1]:
        log(f"    popped {popped.name}")
    state.applied = state.applied[:keep]
    tree.reset_hard(state.applied[-1].commit if state.applied else state.base_commit)
    tree.write_state(state)


def export_commit(tree: UpstreamTree, commit: str, parent: str, tests_of: PatchFile | None = None) -> str:
    """The commit as a patch file; with the upstream-test sections of `tests_of` (the file it is exported over) for the
    test files the tree's own diff does not touch."""
    fields, description = parse_commit_message(tree.message(commit), f"commit {commit[:12]}")
    diff = merge_sections(tree.diff(parent, commit), tests_of.test_sections() if tests_of else [])
    if not diff:
        raise PatchlaneError(f"commit {commit[:12]} changes nothing: an empty patch is not allowed")
    return PatchFile(fields=fields, description=description, diff=diff).to_text()


def export_series(tree: UpstreamTree, state: TreeState, series: Series, log=print) -> list[str]:
    """Write a patch file for every commit above the base; commits beyond the series become new patches."""
    commits = tree.commits_since(state.base_commit)
    names = [e.name for e in series.entries]
    written = []
    applied = []
    parent = state.base_commit
    series.directory.mkdir(parents=True, exist_ok=True)
    for index, commit in enumerate(commits):
        current = series.directory / names[index] if index < len(names) else None
        text = export_commit(tree, commit, parent, read_patch(current) if current and current.is_file() else None)
        if index < len(names):
            name = names[index]
        else:
            subject = parse_patch_text(text, commit).subject
            so_far = Series(series.upstream, series.directory, tuple(SeriesEntry(n, series.directory / n) for n in names))
            name = so_far.next_name(slug_from_subject(subject))
            names.append(name)
        path = series.directory / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            written.append(name)
            log(f"    wrote {path}")
        applied.append(AppliedPatch(name=name, sha256=SeriesEntry(name, path).sha256(), commit=commit))
        parent = commit
    if len(commits) < len(series.entries):
        log(f"    note: {len(series.entries) - len(commits)} series patch(es) are not applied; their files are unchanged")
        names_applied = names[: len(commits)]
        names = names_applied + [e.name for e in series.entries[len(commits) :]]
    series.write(names)
    state.applied = applied
    tree.write_state(state)
    return written


def record_new_patch(
    tree: UpstreamTree, state: TreeState, series: Series, slug: str, fields: list[tuple[str, str]], description: str, log=print
) -> Path:
    """Commit the tree's uncommitted edits as a new patch at the top of the series."""
    _, foreign = unsaved_work(tree, state)
    if foreign:
        raise WorkAtRiskError(
            f"{series.upstream}: the tree has commits not in the series", f"run `{CLI} export -u {series.upstream}` first"
        )
    if len(state.applied) != len(series.entries):
        raise PatchlaneError(
            f"{series.upstream}: {len(state.applied)} of {len(series.entries)} patches are applied",
            f"`{CLI} push --all -u {series.upstream}` first: new patches go on top",
        )
    if not tree.dirty_paths():
        raise PatchlaneError(f"{series.upstream}: no edits in {tree.path} to record", "edit files in the tree first, then run `new`")
    patch = PatchFile(fields=fields, description=description, diff="")
    tree.git("add", "--all")
    commit = tree.commit(patch.commit_message())
    path = _append_to_series(tree, state, series, series.next_name(slug), commit)
    log(f"    new patch {path}")
    return path


def _append_to_series(tree: UpstreamTree, state: TreeState, series: Series, name: str, commit: str,
                      source: PatchFile | None = None) -> Path:
    """Export the tree's new top commit as patch `name` (with the upstream-test sections of the `source` it came from),
    list it last in the series and record it as applied."""
    path = series.directory / name
    series.directory.mkdir(parents=True, exist_ok=True)
    path.write_text(export_commit(tree, commit, state.applied[-1].commit if state.applied else state.base_commit, source))
    series.write([e.name for e in series.entries] + [name])
    state.applied.append(AppliedPatch(name=name, sha256=SeriesEntry(name, path).sha256(), commit=commit))
    tree.write_state(state)
    return path


def refresh_top(tree: UpstreamTree, state: TreeState, series: Series, log=print) -> Path:
    """Fold uncommitted edits into the top applied patch and rewrite its file, header kept."""
    if not state.applied:
        raise PatchlaneError(f"{series.upstream}: no patch is applied to refresh", f"use `{CLI} new` to start one")
    top = state.applied[-1]
    _, foreign = unsaved_work(tree, state)
    if foreign:
        raise WorkAtRiskError(
            f"{series.upstream}: the tree has commits not in the series", f"run `{CLI} export -u {series.upstream}` instead"
        )
    parent = state.applied[-2].commit if len(state.applied) > 1 else state.base_commit
    message = tree.message(top.commit)
    tree.git("add", "--all")
    tree.git("commit", "--quiet", "--amend", "--no-verify", "--cleanup=verbatim", "-F", "-", stdin=message)
    commit = tree.head()
    path = series.directory / top.name
    path.write_text(export_commit(tree, commit, parent, read_patch(path) if path.is_file() else None))
    state.applied[-1] = AppliedPatch(name=top.name, sha256=SeriesEntry(top.name, path).sha256(), commit=commit)
    tree.write_state(state)
    log(f"    refreshed {path}")
    return path


def import_patch(tree: UpstreamTree, state: TreeState, series: Series, source: Path, log=print) -> Path:
    """Apply an outside patch file on top, commit it and add it to the series in canonical form."""
    ensure_no_unsaved_work(tree, state, discard=False, log=log)
    if len(state.applied) != len(series.entries):
        raise PatchlaneError(
            f"{series.upstream}: {len(state.applied)} of {len(series.entries)} patches are applied",
            f"`{CLI} push --all -u {series.upstream}` first",
        )
    patch = read_patch(source)
    ok, output = git_apply(tree, patch)
    if not ok:
        details = "\n".join(f"    {d}" for d in describe_apply_failure(patch, output))
        raise PatchApplyError(f"{series.upstream}: {source} does not apply on top of the series:\n{details}")
    commit = tree.commit(patch.commit_message(), allow_empty=not patch.code_diff())
    slug = re.sub(r"^\d{4}-", "", source.name.removesuffix(".patch")) or slug_from_subject(patch.subject)
    path = _append_to_series(tree, state, series, series.next_name(slug_from_subject(slug)), commit, patch)
    log(f"    imported {source} as {path}")
    return path
