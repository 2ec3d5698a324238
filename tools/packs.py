#!/usr/bin/env python3
"""NAM56R upstream filing packs CLI. `python tools/packs.py --help` lists the commands."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    from nam56r_patchlane.packs.cli import main  # noqa: E402
except ModuleNotFoundError as exc:
    if exc.name != "git":
        raise
    sys.exit(f"{Path(sys.argv[0]).name} needs GitPython, which {sys.executable} lacks: run it as `nox -s packs -- ...`, "
             "or `pip install gitpython` into that interpreter")

if __name__ == "__main__":
    sys.exit(main())
