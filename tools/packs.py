#!/usr/bin/env python3
"""NAM56R upstream filing packs CLI. `python tools/packs.py --help` lists the commands."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nam56r_patchlane.packs_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
