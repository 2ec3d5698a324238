"""`apply_patches.py manifest [list|add|merge]`: the validation manifest's commands and their arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli_options import AddCommand, default_python
from .console import format_table
from .lock import Lock
from .manifest import Record, append_record, host_stamp, merge_records, now_utc, parse_host_line, patch_checksum, read_records


def cmd_manifest_add(args, lock: Lock) -> int:
    upstream = lock.get(args.upstream)
    stamp = parse_host_line(args.host_line) if args.host_line else host_stamp(default_python(args))
    patch = args.root / args.what
    record = Record(
        what=args.what, upstream=upstream.name, upstream_commit=upstream.commit,
        patch_sha256=patch_checksum(patch) if patch.is_file() else "", host=stamp, command=args.command_line,
        exit_code=args.exit_code, sentinels=tuple(args.sentinel or ()), date=now_utc(), figures=args.figures or "",
    )
    path = append_record(args.root, record)
    print(f"appended to {path}: {record.what} exit {record.exit_code} {stamp.line()}")
    return 0


def cmd_manifest_merge(args, lock: Lock) -> int:
    added = merge_records(args.root, args.file)
    print(f"{added} record(s) from {args.file} appended to {args.root / 'patches' / 'manifest.toml'}")
    return 0


def cmd_manifest_list(args, lock: Lock) -> int:
    rows = [[r["date"], r["what"], r["host"]["gpu"], str(r["exit_code"]), " ".join(r["sentinels"])] for r in read_records(args.root)]
    print(format_table(["date", "what", "gpu", "exit", "sentinels"], rows) if rows else "(no records)")
    return 0


def add_manifest_parser(add: AddCommand, common: argparse.ArgumentParser) -> None:
    """The `manifest` command (alone it lists) and its list, add and merge actions, each taking the `common` options too."""
    p = add("manifest", cmd_manifest_list, "list validation records; `manifest add` appends one")
    msub = p.add_subparsers(dest="manifest_command")
    msub.add_parser("list", help="list validation records", parents=[common]).set_defaults(func=cmd_manifest_list)
    m = msub.add_parser("add", help="append a validation record", parents=[common])
    m.set_defaults(func=cmd_manifest_add)
    m.add_argument("--what", required=True, help="patch file path (relative to root) or pack id")
    m.add_argument("-u", "--upstream", required=True)
    m.add_argument("--command", dest="command_line", required=True)
    m.add_argument("--exit-code", type=int, required=True)
    m.add_argument("--sentinel", action="append")
    m.add_argument("--figures")
    m.add_argument("--host-line", help="the reproducer's first output line, when it ran on another host (e.g. the GPU node)")
    m = msub.add_parser("merge", help="append the records of another copy of the manifest (e.g. from a GPU node) not yet here",
                        parents=[common])
    m.set_defaults(func=cmd_manifest_merge)
    m.add_argument("file", type=Path, help="the other manifest.toml")
