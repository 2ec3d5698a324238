"""Command line of the filing packs: `python tools/packs.py <command> --help`."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..cli_options import DEFAULT_ROOT, default_python
from ..errors import PatchlaneError
from ..lock import Lock, load_lock
from .filing import approve, export_bundle, mark_filed
from .filing_checklist import Item, report_filing_checklist, run_filing_checklist
from .pack import Pack, coverage_problems, get_pack, load_packs, pack_problems
from .run import SIDES, VERDICTS, PackOutcome, run_pack
from .waves import plan_waves, render_waves

EPILOG = """\
A pack (patches/packs/<id>/: pack.toml, body.md, repro.py; see patches/packs/README.md) is one
upstream contribution, or a regression guard for a bug the pinned release already fixed.
Typical flow:
  list                         every pack: kind, wave, upstream state, approval
  run ID                       reproducer on the unpatched base and the patched tree; appends both to the manifest
  run --all [--needs gpu]      every pack (or those needing a GPU); one failing pack does not stop the others
  preflight ID                 the pre-filing checklist; exit 1 names every failing item
  waves                        the next 2-4 ready packs per repository, honouring the pause after a filing
  approve ID --by NAME         the human gate (nothing is filed by this tool)
  export ID --out DIR          the bundle a person attaches: body, patches, reproducer, manifest excerpt
  filed ID --url URL           record where a person filed an approved pack
"""


def _today(args) -> dt.date:
    return dt.date.fromisoformat(args.today) if args.today else dt.datetime.now(dt.UTC).date()


def _checklist(pack: Pack, args, lock: Lock, with_approval: bool = True) -> list[Item]:
    """The pack's filing checklist, judged as of --today with --max-age-days; formatters run with --python."""
    return run_filing_checklist(pack, args.root, lock, _today(args), args.max_age_days, default_python(args), with_approval)


def cmd_list(args, lock: Lock) -> int:
    rows = []
    for pack in load_packs(args.root):
        state = pack.upstream_state.state + (f" {pack.upstream_state.fixed_in}" if pack.upstream_state.fixed_in else "")
        approval = pack.filing.approved_by or "-"
        rows.append((pack.id, pack.target, pack.kind, pack.wave, pack.reproducer.needs, state, approval,
                     ", ".join(pack.patches) or "(guard)"))
    headers = ("pack", "target", "kind", "wave", "needs", "upstream state", "approved by", "patches")
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, *rows]:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    problems = [p for pack in load_packs(args.root) for p in pack_problems(pack, args.root, lock)] + coverage_problems(args.root, lock)
    for problem in problems:
        print(f"  ERROR {problem}")
    return 0 if not problems else 1


def _run_one(pack_id: str, args, lock: Lock, log=print) -> PackOutcome:
    """One pack's run; a pack that cannot run (bad pack.toml, a tree out of step) is an ERROR outcome, not an abort."""
    started = time.monotonic()
    try:
        pack = get_pack(args.root, pack_id)
        problems = pack_problems(pack, args.root, lock)
        if problems:
            raise PatchlaneError(f"{pack.id}: pack.toml has problems:\n" + "\n".join(f"  {p}" for p in problems))
        sides = SIDES if args.side == "both" else (args.side,)
        return run_pack(pack, args.root, lock, default_python(args), sides, record=not args.no_record, timeout=args.timeout,
                        keep=args.keep / pack.id if args.keep else None, log=log)
    except PatchlaneError as exc:
        log(f"{pack_id}: ERROR: {exc}")
        return PackOutcome(pack_id, "ERROR", problems=(str(exc),), seconds=time.monotonic() - started)


def _prefixed(pack_id: str):
    def log(line: str) -> None:
        print(f"[{pack_id}] {line}", flush=True)
    return log


def run_exit_code(outcomes: list[PackOutcome]) -> int:
    """1 when any pack failed or could not run; else 3 when any needs a GPU this host lacks; else 0."""
    codes = {o.exit_code for o in outcomes}
    return 1 if 1 in codes else 3 if 3 in codes else 0


def cmd_run(args, lock: Lock) -> int:
    packs = load_packs(args.root)
    ids = [p.id for p in packs if not args.needs or p.reproducer.needs == args.needs] if args.all else args.ids
    if args.all and args.alone != "with-others":
        alone = {p.id for p in packs if p.reproducer.alone}
        ids = [i for i in ids if (i in alone) == (args.alone == "only")]
    if not ids and not args.all:
        raise PatchlaneError("name a pack (or --all)", "`python tools/packs.py list` shows them")
    if args.jobs < 1:
        raise PatchlaneError(f"--jobs {args.jobs}: give 1 or more")
    if args.jobs == 1 or len(ids) == 1:
        outcomes = [_run_one(pack_id, args, lock) for pack_id in ids]
    else:  # each pack in its own scratch trees; output lines carry the pack's id; `alone` packs after, one by one
        alone = {p.id for p in packs if p.reproducer.alone}
        together = [i for i in ids if i not in alone]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            outcomes = list(pool.map(lambda pack_id: _run_one(pack_id, args, lock, _prefixed(pack_id)), together))
        outcomes += [_run_one(pack_id, args, lock, _prefixed(pack_id)) for pack_id in ids if pack_id in alone]
    code = run_exit_code(outcomes)
    if len(outcomes) > 1:
        print(f"packs run: {len(outcomes)} pack(s): " + ", ".join(
            f"{sum(o.verdict == v for o in outcomes)} {v}" for v in VERDICTS if any(o.verdict == v for o in outcomes)))
        for outcome in outcomes:
            print(f"  {outcome.pack:40s} {outcome.verdict}")
    if args.json:
        report = {"exit_code": code, "packs": [o.to_json() for o in outcomes]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"packs run: report written to {args.json}")
    return code


def cmd_preflight(args, lock: Lock) -> int:
    code = 0
    ids = [p.id for p in load_packs(args.root)] if args.all else args.ids
    for pack_id in ids:
        pack = get_pack(args.root, pack_id)
        code = max(code, report_filing_checklist(pack, _checklist(pack, args, lock)))
    return code


def cmd_waves(args, lock: Lock) -> int:
    today = _today(args)
    waves = plan_waves(args.root, lock, today, args.pause_days, args.max_age_days, default_python(args))
    print(render_waves(waves, today, args.pause_days), end="")
    return 0


def cmd_approve(args, lock: Lock) -> int:
    pack = get_pack(args.root, args.id)
    failed = [i for i in _checklist(pack, args, lock, with_approval=False) if not i.ok]
    if failed:
        report_filing_checklist(pack, failed)
        raise PatchlaneError(f"{pack.id} is not ready: approve it once its preflight passes (above)")
    pack = approve(pack, args.by, _today(args))
    print(f"{pack.id}: approved by {pack.filing.approved_by} on {pack.filing.approved_on} (recorded in {pack.folder / 'pack.toml'});"
          " nothing was filed")
    return 0


def cmd_filed(args, lock: Lock) -> int:
    pack = mark_filed(get_pack(args.root, args.id), args.url, _today(args))
    print(f"{pack.id}: filed at {pack.filing.filed_url} on {pack.filing.filed_on} (approved by {pack.filing.approved_by})")
    return 0


def cmd_export(args, lock: Lock) -> int:
    pack = get_pack(args.root, args.id)
    items = _checklist(pack, args, lock, with_approval=not args.draft)
    blocking = [i for i in items if not i.ok and (not args.draft or i.name.startswith(("no private", "pack.toml")))]
    if blocking:
        report_filing_checklist(pack, items)
        raise PatchlaneError(f"{pack.id}: not exported: preflight failed"
                             + ("" if args.draft else " (--draft exports an unapproved or stale pack, never one that leaks)"))
    written = export_bundle(pack, args.root, args.out)
    print(f"{pack.id}: bundle written{' (DRAFT: preflight not clean)' if any(not i.ok for i in items) else ''}:")
    for path in written:
        print(f"  {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packs.py", description="NAM56R upstream filing packs: run, preflight, waves, approve, export.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="repository root (default: this checkout)")
    parser.add_argument("--python", help="interpreter that runs reproducers and formatters (default: <root>/.venv, else this one)")
    parser.add_argument("--today", help="the date to judge ages and pauses by (YYYY-MM-DD; default: today, UTC)")
    parser.add_argument("--max-age-days", type=int, default=7, help="a manifest record older than this is stale (default: 7)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    add("list", cmd_list, "every pack with its kind, wave, upstream state and approval; exit 1 on an invalid pack or an unpacked patch")
    p = add("run", cmd_run, "run a pack's reproducer on its unpatched base and on the patched tree, and record both in the manifest")
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="every pack (with --needs: only those)")
    p.add_argument("--needs", choices=["cpu", "gpu"], help="with --all: only packs whose reproducer needs this")
    p.add_argument("--side", choices=["both", *SIDES], default="both")
    p.add_argument("--no-record", action="store_true", help="check only; append nothing to the manifest")
    p.add_argument("--timeout", type=float, help="seconds per side before the reproducer is killed")
    p.add_argument("--jobs", type=int, default=1,
                   help="packs run at the same time (default 1); their reproducers then share the host and the GPU,"
                        " so a pack that times host against GPU work is best run alone")
    p.add_argument("--alone", choices=["with-others", "skip", "only"], default="with-others",
                   help="with --all: packs marked `alone = true` (their verdict times host against GPU work) run after the"
                        " others, one at a time (with-others, the default), are left out (skip), or run by themselves (only)")
    p.add_argument("--keep", type=Path, help="keep the side trees under this folder (default: a temporary one, removed)")
    p.add_argument("--json", type=Path, help="also write every pack's verdict, sides and appended manifest records to this JSON file")
    p = add("preflight", cmd_preflight, "the pre-filing checklist; exit 1 names every failing item")
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true")
    p = add("waves", cmd_waves, "propose the next filing wave per target repository")
    p.add_argument("--pause-days", type=int, default=2, help="days a repository rests after its last filing (default: 2)")
    p = add("approve", cmd_approve, "record a person's approval to file a pack (the human gate; files nothing)")
    p.add_argument("id")
    p.add_argument("--by", required=True, help="who approves")
    p = add("filed", cmd_filed, "record where a person filed an approved pack (refused without an approval)")
    p.add_argument("id")
    p.add_argument("--url", required=True, help="the issue or PR on the target repository")
    p = add("export", cmd_export, "write the filing bundle (body, patches, reproducer, manifest excerpt) for a person to attach")
    p.add_argument("id")
    p.add_argument("--out", type=Path, required=True, help="folder to write <out>/<id>/ into")
    p.add_argument("--draft", action="store_true", help="export even without approval or a fresh run (never with a private leak)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, load_lock(args.root))
    except PatchlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
