"""`apply_patches.py cache fill|verify|split`: the offline cache's commands and their arguments."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cachefill import FillOptions, run_fill
from .cachemanifest import size_table, split_cache, verify_cache
from .cli_options import LOCK_NOTE, AddCommand
from .console import format_table
from .environment import detect_profile
from .errors import PatchlaneError
from .lock import Lock
from .te_lock import TE_PROFILE
from .wheeltarget import WheelTarget


def cmd_cache_fill(args, lock: Lock) -> int:
    profile, why = (TE_PROFILE, "chosen with --profile") if args.profile == TE_PROFILE else detect_profile(args.profile)
    try:
        target = WheelTarget.create(args.python_version, args.platform, profile)
    except ValueError as exc:
        raise PatchlaneError(str(exc)) from exc
    if args.profile == "auto":
        print(f"profile {profile}: {why} (name the target's with --profile)")
    options = FillOptions(root=args.root, cache_dir=args.dir, target=target, exclude=tuple(args.exclude or ()),
                          only=args.only or None, refresh=args.refresh, artifacts_only=args.artifacts_only,
                          extra=tuple(args.wheels or ()), tests_from=None if args.no_upstream_tests else _tests_from(args.tests_from),
                          apex_from=args.apex_from)
    if args.apex_from and profile != TE_PROFILE:
        raise PatchlaneError(f"--apex-from is for --profile {TE_PROFILE} (profile {profile} carries no Apex)")
    return run_fill(lock, options)


def _tests_from(pairs: list[str] | None) -> dict[str, str]:
    sources = {}
    for pair in pairs or ():
        name, sep, source = pair.partition("=")
        if not sep or not name or not source:
            raise PatchlaneError(f"--tests-from {pair!r} is not NAME=URL_OR_PATH", "e.g. --tests-from megatron-lm=/src/Megatron-LM")
        sources[name] = source
    return sources


def cmd_cache_verify(args, lock: Lock) -> int:
    manifest = verify_cache(args.dir, args.python_version)
    target = manifest.target
    print(f"{args.dir}: every file matches its manifest (python {target.python_version}, profile {target.profile},"
          f" left out: {', '.join(target.exclude) or 'nothing'})")
    print(format_table(["kind", "files", "MiB"], size_table(manifest)))
    return 0


def cmd_cache_split(args, lock: Lock) -> int:
    manifest = verify_cache(args.dir)
    parts = split_cache(args.dir, manifest, args.max_mib)
    print(f"{len(parts)} part(s) under {args.dir}/.parts, each laid out like the cache. Carry each, then put them"
          f" back together with: cp -a {args.dir}/.parts/*/. {args.dir}/   (`cache verify {args.dir}` checks the result)")
    return 0


def add_cache_parser(add: AddCommand, common: argparse.ArgumentParser) -> None:
    """The `cache` command and its fill, verify and split actions, each taking the `common` options too."""
    p = add("cache", cmd_cache_fill, "offline cache: `fill` it where an index is reachable, `verify` it, `split` it for transfers")
    csub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    c = csub.add_parser("fill", parents=[common], help="pinned artifacts + every wheel an offline build and nox need, for one target",
                        description="Gather the pinned artifacts and every wheel an --offline build, nox and its sessions need on"
                        " a target interpreter and platform, through pip; idempotent; ends with the cache's size per kind. "
                        + LOCK_NOTE)
    c.set_defaults(func=cmd_cache_fill, writes=True)
    c.add_argument("dir", type=Path)
    c.add_argument("--python-version", help="the target interpreter, e.g. 3.12 (default: this interpreter and its platform)")
    c.add_argument("--platform", action="append",
                   help="target platform tag, e.g. manylinux_2_28_x86_64 (older manylinux tags are added); repeatable")
    c.add_argument("--profile", choices=["auto", "cpu", "gpu", TE_PROFILE], default="auto",
                   help="cpu: torch comes from the cache; gpu: the target's own CUDA torch is used, torch is left out;"
                        f" {TE_PROFILE}: gpu plus what `build --with-te` installs (TransformerEngine, Apex) (default: auto)")
    c.add_argument("--exclude", action="append", metavar="DIST",
                   help="a distribution the target already has; it, and what only it needs, is left out (repeatable)")
    c.add_argument("--wheels", nargs="+", metavar="REQ", help="more requirements to carry (with their dependencies)")
    c.add_argument("--refresh", action="store_true", help="resolve again even when the manifest matches; remove what is no longer needed")
    c.add_argument("--artifacts-only", action="store_true", help="only the lock's pinned artifacts, no wheels")
    c.add_argument("--tests-from", action="append", metavar="NAME=URL_OR_PATH",
                   help="take upstream NAME's own tests from this git URL or local clone holding the pinned tag"
                        " (default: the lock's git_url); repeatable")
    c.add_argument("--apex-from", metavar="PATH_OR_URL",
                   help=f"--profile {TE_PROFILE}: take Apex's source from this git URL or local clone or mirror holding the"
                        " lock's commit (default: the lock's git_url)")
    c.add_argument("--no-upstream-tests", action="store_true",
                   help="leave upstream's own tests out (`upstream-tests` then refuses to run from this cache)")
    c.add_argument("only", nargs="*", default=None, help="upstream names whose artifacts to fetch (default: all)")
    c = csub.add_parser("verify", parents=[common], help="check every file against the cache's manifest")
    c.set_defaults(func=cmd_cache_verify)
    c.add_argument("dir", type=Path)
    c.add_argument("--python-version", help="also refuse a cache filled for another python, e.g. 3.12")
    c = csub.add_parser("split", parents=[common], help="hard-link the files into DIR/.parts/NN of at most --max-mib each")
    c.set_defaults(func=cmd_cache_split)
    c.add_argument("dir", type=Path)
    c.add_argument("--max-mib", type=float, required=True, help="the largest part, in MiB")
