#!/usr/bin/env python3
"""NAM56R patch lane CLI. `python tools/apply_patches.py --help` lists the commands."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nam56r_patchlane.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
