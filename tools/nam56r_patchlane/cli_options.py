"""What both command lines (tools/apply_patches.py and tools/packs.py) share: the checkout they act
on by default, the interpreter that runs reproducers and formatters, and the note every command
that writes the checkout carries in its help."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from .checkout_lock import CHECKOUT_LOCK_RELATIVE_PATH
from .errors import PatchlaneError

DEFAULT_ROOT = Path(__file__).resolve().parents[2]
LOCK_NOTE = (f"It holds {CHECKOUT_LOCK_RELATIVE_PATH} while it runs: another command that writes this checkout waits"
             " for it, naming it once, or gives up after --lock-timeout SECONDS (0: refuses at once, exit 75).")
# apply_patches.py's `add(name, func, help_text, writes=False)`: one subcommand, its parser returned for its arguments.
AddCommand = Callable[..., argparse.ArgumentParser]


def default_python(args) -> str:
    """--python (absolute: reproducers run in their pack's folder), else the build's environment
    (<root>/.venv) when it exists, else this interpreter."""
    if args.python:
        found = shutil.which(args.python)
        if found is None:
            raise PatchlaneError(f"--python {args.python}: no such interpreter", "pass a path to a python executable or a name on PATH")
        return os.path.abspath(found)
    venv_python = args.root / ".venv" / "bin" / "python"
    return str(venv_python) if venv_python.exists() else sys.executable
