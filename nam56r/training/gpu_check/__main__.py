"""`python -m nam56r.training.gpu_check`: the GPU node's acceptance check (the package's docstring says what it runs)."""

import sys

from nam56r.training.gpu_check.cli import main

sys.exit(main())
