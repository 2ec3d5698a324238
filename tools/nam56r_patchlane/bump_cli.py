"""`apply_patches.py bump`: its arguments, read into BumpOptions."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import bump
from .cli_options import AddCommand, default_python
from .errors import PatchlaneError
from .lock import Lock
from .lock_fields import OBJECT_ID


def cmd_bump(args, lock: Lock) -> int:
    if not OBJECT_ID.match(args.commit):
        raise PatchlaneError(f"--commit {args.commit!r} is not a 40-hex git commit", "the full commit id of the new tag")
    options = bump.BumpOptions(root=args.root, name=args.upstream, version=args.to, tag=args.tag, commit=args.commit,
                               python=default_python(args), artifact=args.artifact, tests_from=args.tests_from,
                               suite=None if args.no_suite else args.suite, base_includes=tuple(args.base_includes or ()))
    return bump.run_bump(lock, options)


def add_bump_parser(add: AddCommand) -> None:
    p = add("bump", cmd_bump, "move an upstream's pin to a new release: rebase, re-run the gates on a candidate checkout,"
            " rewrite the lock and gitlink only when they pass", writes=True)
    p.description = f"{p.description}\n\n{bump.__doc__}"
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("-u", "--upstream", required=True)
    p.add_argument("--to", required=True, metavar="VERSION", help="the new PyPI version, e.g. 0.19.2")
    p.add_argument("--tag", required=True, help="its git tag, e.g. core_v0.19.2")
    p.add_argument("--commit", required=True, help="the tag's full commit id")
    p.add_argument("--artifact", type=Path, help="the new release's sdist (or wheel) file (default: pip downloads it)")
    p.add_argument("--tests-from", metavar="URL_OR_PATH", help="a git source holding the tag (default: the lock's git_url)")
    p.add_argument("--suite", default="python3 -m nox -s tests", help="the CPU suite, run in the candidate (default: %(default)s)")
    p.add_argument("--no-suite", action="store_true", help="do not run the suite (then nothing is rewritten)")
    p.add_argument("--base-includes", action="append", metavar="PATCH", help="passed to upstream-tests (see its --help)")
