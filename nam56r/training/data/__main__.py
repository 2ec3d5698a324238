"""`python -m nam56r.training.data`: build, check or convert training data (`nam56r.training.data.cli` says how)."""

import sys

from nam56r.training.data.cli import main

sys.exit(main())
