"""`rebase --to REF_OR_VERSION`: re-apply a series onto another upstream version, in a scratch
tree, and report per patch: clean, offset, fuzz, conflict (files), or absorbed upstream.

The real tree and the series are not touched. The rebased scratch tree is left under
third_party/.rebase/ for inspection, and the report is printed and written as markdown.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .artifacts import pip_download, sha256_file
from .console import format_table
from .errors import PatchlaneError
from .gittree import UpstreamTree, is_git_tree
from .lock import Upstream
from .materialize import unpack_archive
from .patchfile import read_patch
from .series import read_series

CLEAN, OFFSET, FUZZ, CONFLICT, ABSORBED = "applies clean", "applies with offset", "applies with fuzz", "conflicts", "absorbed upstream"
_FILE_ERR = re.compile(r"error: (?:patch failed: )?([^:\s]+)[:]")
_MISSING = re.compile(r"error: ([^:\s]+): (?:No such file or directory|does not exist in index)")


@dataclass(frozen=True)
class PatchReport:
    name: str
    result: str
    detail: str


def _scratch_base(root: Path, upstream: Upstream, ref: str, dest: Path, python: str, log) -> tuple[UpstreamTree, str]:
    source = root / upstream.path
    if is_git_tree(source):
        tree = UpstreamTree(source)
        resolved = tree.git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False).stdout.strip()
        if resolved:
            return tree.shared_clone(dest, resolved, "rebase"), f"git {ref} ({resolved[:12]})"
    log(f"  {ref!r} is not a commit in {source}; fetching {upstream.pypi}=={ref} through pip")
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(python, f"{upstream.pypi}=={ref}", upstream.install == "wheel", Path(tmp), upstream)
        files = list(Path(tmp).iterdir())
        if len(files) != 1:
            raise PatchlaneError(f"expected one artifact for {upstream.pypi}=={ref}, got {[f.name for f in files]}")
        digest = sha256_file(files[0])
        dest.mkdir(parents=True)
        unpack_archive(files[0], dest)
    scratch = UpstreamTree.init_from_directory(dest, f"rebase base: {upstream.pypi}=={ref}\n")
    return scratch, f"PyPI {upstream.pypi}=={ref} ({files[0].name}, sha256 {digest}, not pinned)"


def classify(tree: UpstreamTree, patch_path: Path) -> PatchReport:
    patch = read_patch(patch_path)
    name = patch_path.name
    diff = patch.code_diff()  # a release artifact has no upstream tests for the test sections to apply to
    forward = tree.git("apply", "--check", "--verbose", "-", stdin=diff, check=False)
    if forward.returncode == 0:
        offsets = re.findall(r"offset (-?\d+) lines?", forward.stdout + forward.stderr)
        _apply_and_commit(tree, patch, diff, ())
        return PatchReport(name, OFFSET if offsets else CLEAN, f"offsets {', '.join(offsets)}" if offsets else "")
    reverse = tree.git("apply", "--check", "--reverse", "-", stdin=diff, check=False)
    if reverse.returncode == 0:
        return PatchReport(name, ABSORBED, "already in this version (the patch reverse-applies)")
    for context in (2, 1):
        fuzzed = tree.git("apply", "--check", f"-C{context}", "-", stdin=diff, check=False)
        if fuzzed.returncode == 0:
            _apply_and_commit(tree, patch, diff, (f"-C{context}",))
            return PatchReport(name, FUZZ, f"fuzz {3 - context}: context lines moved; refresh and review")
    missing = set(_MISSING.findall(forward.stderr))
    files = sorted(set(_FILE_ERR.findall(forward.stderr)) | missing) or patch.touched_files()
    return PatchReport(name, CONFLICT, "files: " + ", ".join(f"{f} (missing in this version)" if f in missing else f for f in files))


def _apply_and_commit(tree: UpstreamTree, patch, diff: str, extra: tuple[str, ...]) -> None:
    if diff:
        tree.git("apply", "--index", *extra, "-", stdin=diff)
    tree.commit(patch.commit_message(), allow_empty=not diff)


def run_rebase(root: Path, upstream: Upstream, ref: str, report_path: Path | None, python: str, log=print) -> int:
    series = read_series(root / "patches", upstream.name)
    safe_ref = re.sub(r"[^A-Za-z0-9._-]+", "_", ref)
    scratch_dir = root / "third_party" / ".rebase" / f"{upstream.name}-{safe_ref}"
    if scratch_dir.exists():
        shutil.rmtree(scratch_dir)  # our own scratch output from an earlier rebase report
    scratch_dir.parent.mkdir(parents=True, exist_ok=True)
    tree, base_label = _scratch_base(root, upstream, ref, scratch_dir, python, log)
    reports = [classify(tree, entry.path) for entry in series.entries]
    rows = [[r.name, r.result, r.detail] for r in reports]
    table = format_table(["patch", "result", "detail"], rows) if rows else "(empty series)"
    log(f"rebase of {upstream.name} series ({len(reports)} patch(es)) onto {base_label}")
    log(table)
    report_path = report_path or scratch_dir.parent / f"{scratch_dir.name}.md"
    markdown = [f"# Rebase report: {upstream.name} onto {base_label}", "", "| patch | result | detail |", "|---|---|---|"]
    markdown += [f"| {r.name} | {r.result} | {r.detail} |" for r in reports]
    report_path.write_text("\n".join(markdown) + "\n")
    log(f"report written to {report_path}; rebased scratch tree at {scratch_dir}")
    return 1 if any(r.result in (CONFLICT, FUZZ) for r in reports) else 0
