"""Command line of the patch lane: `python tools/apply_patches.py <command> --help`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import apply as ops
from .artifacts import default_cache_dir
from .build import BuildOptions, run_build
from .bump_cli import add_bump_parser
from .cache_commands import add_cache_parser
from .check import run_ci_gate
from .checkout_lock import CHECKOUT_LOCK_RELATIVE_PATH, checkout_lock
from .cli_options import DEFAULT_ROOT, LOCK_NOTE, default_python
from .console import format_table
from .errors import PatchlaneError
from .gittree import UpstreamTree, is_git_tree
from .lock import Lock, load_lock
from .manifest_commands import add_manifest_parser
from .patchfile import CATEGORIES
from .rebase import run_rebase
from .series import read_series
from .upstream_tests_cli import add_upstream_tests_parser

EPILOG = """\
Typical flow:
  build                      materialize + patch + install every upstream (no-op when nothing changed)
  status                     pin, source, applied N/M, dirty/clean per upstream
  (edit files in third_party/<name>)
  new SLUG -u NAME --subject ... --category ... --retire-when ... --upstream-tests ... --why ...
  refresh -u NAME            fold further edits into the top patch, header kept
  check                      the CI gate
  rebase -u NAME --to 0.20.0 report how the series fares on another upstream version
  upstream-tests [-u NAME]   upstream's own tests on the release and on the series, side by side
  bump -u NAME --to 0.19.2 --tag T --commit SHA   move a pin; the lock changes only when every gate passes

One command at a time writes a checkout: build, push, pop, new, refresh, import, export, rebase and
cache fill hold third_party/.patchlane.lock while they run. A second one waits, naming the holder
(pid, command, since when) once; Ctrl-C stops waiting and changes nothing. --lock-timeout SECONDS
bounds the wait (0 refuses at once, exit 75). A holder that died never blocks: the kernel releases
its lock. Records are appended to patches/manifest.toml one process at a time (patches/.manifest.lock).
"""


def _tree(root: Path, lock: Lock, name: str):
    upstream = lock.get(name)
    path = root / upstream.path
    if not is_git_tree(path):
        raise PatchlaneError(f"{path} is not materialized", "run `python tools/apply_patches.py build` first")
    tree = UpstreamTree(path)
    state = tree.read_state()
    if state is None:
        raise PatchlaneError(f"{path} has no patch-lane state", "run `python tools/apply_patches.py build` first")
    return upstream, tree, state, read_series(root / "patches", name)


def cmd_build(args, lock: Lock) -> int:
    env_dir = None if args.python else (args.env or args.root / ".venv")
    options = BuildOptions(
        root=args.root, cache_dir=args.cache, offline=args.offline, env_dir=env_dir, python=args.python,
        profile=args.profile, discard=args.discard, only=args.only or None, install=not args.no_install,
        base_python=args.base_python, with_te=args.with_te,
    )
    return run_build(lock, options)


def cmd_status(args, lock: Lock) -> int:
    rows = []
    for upstream in lock.select(args.only):
        series = read_series(args.root / "patches", upstream.name)
        path = args.root / upstream.path
        if not is_git_tree(path) or UpstreamTree(path).read_state() is None:
            rows.append([upstream.name, upstream.version, upstream.commit[:10], "-", f"0/{len(series.entries)}", "not materialized"])
            continue
        tree = UpstreamTree(path)
        state = tree.read_state()
        dirty, foreign = ops.unsaved_work(tree, state)
        stale = ops.applied_prefix(state, series) < len(state.applied)
        condition = "dirty" if dirty else "clean"
        if foreign:
            condition += f", {len(foreign)} unexported commit(s)"
        if stale:
            condition += ", series changed (build re-applies)"
        applied = f"{len(state.applied)}/{len(series.entries)}"
        rows.append([upstream.name, upstream.version, upstream.commit[:10], state.source, applied, condition])
    print(format_table(["upstream", "pin", "commit", "source", "applied", "tree"], rows))
    return 0


def cmd_series(args, lock: Lock) -> int:
    for upstream in lock.select(args.only):
        series = read_series(args.root / "patches", upstream.name)
        path = args.root / upstream.path
        state = UpstreamTree(path).read_state() if is_git_tree(path) else None
        applied = {a.name: a.sha256 for a in state.applied} if state else {}
        print(f"{upstream.name} ({len(series.entries)} patch(es)):")
        for entry in series.entries:
            if entry.name not in applied:
                mark = "-"
            else:
                mark = "+" if entry.path.is_file() and applied[entry.name] == entry.sha256() else "!"
            print(f"  {mark} {entry.name}")
    print("(+ applied, - not applied, ! applied but the file changed since)")
    return 0


def cmd_push(args, lock: Lock) -> int:
    upstream, tree, state, series = _tree(args.root, lock, args.upstream)
    ops.ensure_no_unsaved_work(tree, state, discard=False)
    if args.all:
        upto = len(series.entries)
    elif args.name:
        upto = series.index_of(args.name) + 1
    else:
        upto = len(state.applied) + 1
    if upto > len(series.entries) or upto <= len(state.applied):
        print(f"{upstream.name}: nothing to push ({len(state.applied)}/{len(series.entries)} applied)")
        return 0
    if ops.applied_prefix(state, series) < len(state.applied):
        raise PatchlaneError(f"{upstream.name}: applied patches differ from their files", "run `build` to re-apply the series")
    ops.push_patches(tree, state, series, upto)
    print(f"{upstream.name}: {len(state.applied)}/{len(series.entries)} applied")
    return 0


def cmd_pop(args, lock: Lock) -> int:
    upstream, tree, state, series = _tree(args.root, lock, args.upstream)
    if args.all:
        keep = 0
    elif args.name:
        keep = series.index_of(args.name) + 1
    else:
        keep = max(len(state.applied) - 1, 0)
    if keep >= len(state.applied):
        print(f"{upstream.name}: nothing to pop ({len(state.applied)}/{len(series.entries)} applied)")
        return 0
    ops.pop_patches(tree, state, keep, args.discard)
    print(f"{upstream.name}: {len(state.applied)}/{len(series.entries)} applied")
    return 0


def cmd_new(args, lock: Lock) -> int:
    _, tree, state, series = _tree(args.root, lock, args.upstream)
    fields = [
        ("Subject", args.subject), ("Pack", args.pack), ("Category", args.category),
        ("Upstream-Status", args.upstream_status), ("Retire-When", args.retire_when), ("Reproducer", args.reproducer),
        ("Upstream-Tests", args.upstream_tests),
    ]
    ops.record_new_patch(tree, state, series, args.name, fields, args.why)
    return 0


def cmd_refresh(args, lock: Lock) -> int:
    _, tree, state, series = _tree(args.root, lock, args.upstream)
    ops.refresh_top(tree, state, series)
    return 0


def cmd_import(args, lock: Lock) -> int:
    _, tree, state, series = _tree(args.root, lock, args.upstream)
    ops.import_patch(tree, state, series, Path(args.file))
    return 0


def cmd_export(args, lock: Lock) -> int:
    names = [args.upstream] if args.upstream else [u.name for u in lock.upstreams if is_git_tree(args.root / u.path)]
    for name in names:
        _, tree, state, series = _tree(args.root, lock, name)
        if tree.dirty_paths():
            raise PatchlaneError(
                f"{name}: uncommitted edits in {tree.path}", "commit them (with a patch header as message), or use `refresh`/`new`"
            )
        written = ops.export_series(tree, state, series)
        print(f"{name}: {len(written)} patch file(s) written")
    return 0


def cmd_check(args, lock: Lock) -> int:
    return run_ci_gate(lock, args.root, args.cache, args.offline, default_python(args), args.only)


def cmd_rebase(args, lock: Lock) -> int:
    return run_rebase(args.root, lock.get(args.upstream), args.to, Path(args.report) if args.report else None, default_python(args))


def _add_common(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """Options accepted before or after the command; after it they override."""
    def default(value):
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--root", type=Path, default=default(DEFAULT_ROOT), help="repository root (default: this checkout)")
    parser.add_argument("--cache", type=Path, default=default(default_cache_dir()),
                        help=f"artifact cache directory (default: {default_cache_dir()})")
    parser.add_argument("--offline", action="store_true", default=default(False), help="never reach the package index; use only --cache")
    parser.add_argument("--python", default=default(None), help="target interpreter, used as is (build default: --env)")
    parser.add_argument("--lock-timeout", type=float, metavar="SECONDS", default=default(None),
                        help=f"commands that write the checkout hold {CHECKOUT_LOCK_RELATIVE_PATH} and wait for another"
                        " holder (default: as long as it takes); give up after SECONDS, 0: refuse at once (exit 75)")


def _add_build_parser(add) -> None:
    p = add("build", cmd_build, "materialize, patch and install every upstream into the target environment", writes=True)
    p.add_argument("--env", type=Path, help="virtual environment to create/update (default: <root>/.venv)")
    p.add_argument("--profile", choices=["auto", "cpu", "gpu"], default="auto", help="cpu skips GPU-only builds, loudly (default: auto)")
    p.add_argument("--discard", action="store_true", help="set aside (under refs/patchlane/discarded/) edits and commits not in the series")
    p.add_argument("--no-install", action="store_true", help="materialize and patch only")
    p.add_argument("--base-python", metavar="EXE",
                   help="create --env with this interpreter, seeing its installed packages (a cluster's CUDA torch) after"
                   " its own; nothing is installed into EXE's environment")
    p.add_argument("--with-te", action="store_true",
                   help="also install TransformerEngine and Apex as the lock pins them, compiling their torch extensions"
                        " once per torch/CUDA/arch/python (gpu profile; offline: from a cache filled with --profile gpu-te)")
    p.add_argument("only", nargs="*", help="upstream names (default: all)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apply_patches.py",
        description="NAM56R patch lane: pinned upstreams as git trees under third_party/, quilt-style patch series under patches/.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(parser, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, defaults=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_text: str, writes: bool = False) -> argparse.ArgumentParser:
        """writes: the command changes third_party/ trees, .venv or the cache, so it holds the checkout's lock."""
        description = f"{help_text}. {LOCK_NOTE}" if writes else help_text
        p = sub.add_parser(name, help=help_text, description=description, parents=[common])
        p.set_defaults(func=func, writes=writes)
        return p

    _add_build_parser(add)
    p = add("status", cmd_status, "per upstream: pin, source, applied N of M, dirty or clean")
    p.add_argument("only", nargs="*")
    p = add("series", cmd_series, "list each series with what is applied")
    p.add_argument("only", nargs="*")

    for name, func, text in (
        ("push", cmd_push, "apply the next patch, up to NAME, or --all"),
        ("pop", cmd_pop, "unapply the top patch, down to NAME, or --all"),
    ):
        p = add(name, func, text, writes=True)
        p.add_argument("name", nargs="?", help="patch file name or slug")
        p.add_argument("--all", action="store_true")
        p.add_argument("-u", "--upstream", required=True)
        if name == "pop":
            p.add_argument("--discard", action="store_true", help="set aside edits and commits not in the series first")

    p = add("new", cmd_new, "record the tree's uncommitted edits as a new patch on top of the series", writes=True)
    p.add_argument("name", help="slug, e.g. dsa-index-score-memory")
    p.add_argument("-u", "--upstream", required=True)
    p.add_argument("--subject", required=True)
    p.add_argument("--category", required=True, choices=CATEGORIES)
    p.add_argument("--retire-when", required=True, help="when this patch can be deleted")
    p.add_argument("--why", required=True, help="why the patch exists (the description)")
    p.add_argument("--pack", default="none")
    p.add_argument("--upstream-status", default="not-filed")
    p.add_argument("--reproducer", default="none")
    p.add_argument("--upstream-tests", required=True, metavar="PATHS",
                   help="upstream's own test files or directories covering the patch, space-separated"
                        " (e.g. 'tests/unit_tests/test_optimizer.py'), or 'none: reason'")

    p = add("refresh", cmd_refresh, "fold uncommitted edits into the top applied patch and rewrite its file (header kept)",
            writes=True)
    p.add_argument("-u", "--upstream", required=True)
    p = add("import", cmd_import, "apply a patch file on top, add it to the series in canonical form", writes=True)
    p.add_argument("file")
    p.add_argument("-u", "--upstream", required=True)
    p = add("export", cmd_export, "write every patch file from the tree's commits (byte-identical after apply)", writes=True)
    p.add_argument("-u", "--upstream")
    p = add("check", cmd_check, "CI gate: series apply cleanly to a fresh base, headers valid, numbering agrees, canonical form")
    p.add_argument("only", nargs="*")
    p = add("rebase", cmd_rebase, "re-apply a series onto another upstream version and report per patch", writes=True)
    p.add_argument("-u", "--upstream", required=True)
    p.add_argument("--to", required=True, help="a git ref in the tree, or a PyPI version of the upstream")
    p.add_argument("--report", help="markdown report path (default: third_party/.rebase/<name>-<ref>.md)")

    add_cache_parser(add, common)
    add_manifest_parser(add, common)
    add_upstream_tests_parser(add)
    add_bump_parser(add)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        lock = load_lock(args.root)
        if not getattr(args, "writes", False):
            return args.func(args, lock)
        with checkout_lock(args.root, args.lock_timeout):
            return args.func(args, lock)
    except PatchlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
