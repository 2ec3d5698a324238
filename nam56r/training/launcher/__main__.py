"""`python -m nam56r.training.launcher`: train NAM56R (`nam56r.training.launcher.train` says how)."""

import sys

from nam56r.training.launcher.train import main

sys.exit(main())
